"""Triton-interpreter children forked from the ranks' forkserver instead of started as fresh
interpreters.

``python -m tests.support.<script> *args`` with ``TRITON_INTERPRET=1`` used to cost a fresh
interpreter each: about 3 s of CPU importing torch and triton before its first case. A
:class:`ForkedChild` runs the same module as ``__main__`` in a process forked from
:func:`overlap_runtime.rank_start.context`'s forkserver, which has imported torch and
``torch._dynamo`` (and with it triton) once for the whole test process. The child first makes
triton interpreted (:func:`tests.support.interpreter.interpret_in_this_rank`: it refuses if a
kernel module of ours was imported before) and takes :data:`CHILD_ENV` (``TRITON_INTERPRET=1``,
one intra-op thread).

The parent side reads like a ``subprocess.Popen`` with text pipes: ``stdout``, ``stderr``,
``poll``, ``wait(timeout)`` (``subprocess.TimeoutExpired``), ``kill``, ``returncode`` and
``communicate(timeout)``. The child's file descriptors 1 and 2 are the two pipes, so what it
prints (a traceback included) reaches the parent; its exit code is the module's ``sys.exit``
code, 1 for an exception, ``-9`` once killed. The child dies with the forkserver, which dies
with this process.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import threading
from typing import Any

from overlap_runtime import rank_start

#: what a child sets in its environment (as a fresh interpreter child had it)
CHILD_ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


def _child_main(module: str, args: list[str], out: Any, err: Any,
                server: int | None) -> None:
    """In the forked child: fds 1 and 2 onto the pipes, triton interpreted, the module run as
    ``__main__`` with ``sys.argv[1:] = args`` (``sys.argv[0]`` its file, as under ``python -m``;
    its ``SystemExit`` code is the exit code)."""
    rank_start.die_with_parent(server)
    rank_start.release_forkserver()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(CHILD_ENV)
    import torch

    from tests.support.interpreter import interpret_in_this_rank

    torch.set_num_threads(1)
    interpret_in_this_rank()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedChild:
    """``python -m tests.support.<script> *args`` under the Triton interpreter, forked (see the
    module doc); a ``subprocess.Popen``-like handle with text ``stdout`` and ``stderr``."""

    def __init__(self, script: str, *args: str) -> None:
        self.args = [f"tests.support.{script}", *args]
        ctx = rank_start.context()
        server = rank_start.expected_parent(ctx.get_start_method())
        out_r, out_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main, daemon=True, name=" ".join(self.args),
                                 args=(self.args[0], list(args), out_w, err_w, server))
        try:
            self._proc.start()
        finally:
            out_w.close()
            err_w.close()
        self.stdout = os.fdopen(os.dup(out_r.fileno()), "r")
        self.stderr = os.fdopen(os.dup(err_r.fileno()), "r")
        out_r.close()
        err_r.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting at most ``timeout`` s (``subprocess.TimeoutExpired`` after)."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Everything the child prints and its exit, within ``timeout`` s: (stdout, stderr).
        On timeout the child is killed and ``subprocess.TimeoutExpired`` carries what it had
        printed."""
        texts: dict[str, str] = {}

        def read(name: str, stream: Any) -> None:
            texts[name] = stream.read()

        readers = [threading.Thread(target=read, args=(n, s), daemon=True)
                   for n, s in (("out", self.stdout), ("err", self.stderr))]
        for reader in readers:
            reader.start()
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(30)
            for reader in readers:
                reader.join(30)
            raise subprocess.TimeoutExpired(self.args, timeout, texts.get("out", ""),
                                            texts.get("err", "")) from None
        for reader in readers:  # the pipes close when the child exits
            reader.join(30)
        return texts.get("out", ""), texts.get("err", "")
