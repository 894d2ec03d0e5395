"""Run a script on N CPU ranks as torchrun runs it, from one interpreter (test support).

Usage: ``python -m tests.support.fork_launch --nproc-per-node N [--timeout S] script.py [args]``

torchrun starts a fresh interpreter per rank, and each imports torch again (~2 s of CPU each).
This launcher imports torch, ``torch.distributed``, ``torch._dynamo`` and the modules
``script.py`` imports at its top level (found with :mod:`ast`) once, then forks one child per rank; each child sets the
environment torchrun gives a rank and runs the script with
``runpy.run_path(script, run_name="__main__")`` and ``sys.argv = [script, *args]``.

Environment of rank ``r`` of ``N`` (what torchrun ``--standalone`` sets, printed from a torchrun
rank): ``RANK = LOCAL_RANK = ROLE_RANK = r``, ``WORLD_SIZE = LOCAL_WORLD_SIZE =
ROLE_WORLD_SIZE = N``, ``GROUP_RANK = 0``, ``GROUP_WORLD_SIZE = 1``, ``ROLE_NAME = default``,
``MASTER_ADDR = 127.0.0.1``, ``MASTER_PORT`` the port of the TCPStore this parent hosts (as
torchrun's agent does: ``TORCHELASTIC_USE_AGENT_STORE = True``, so every rank connects as a
client; the port is the OS's pick for a socket bound before the fork: no free-port race),
``TORCHELASTIC_RUN_ID`` (``fork_launch-<parent pid>``), ``TORCHELASTIC_RESTART_COUNT = 0``,
``TORCHELASTIC_MAX_RESTARTS = 0``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING = 1``;
``OMP_NUM_THREADS`` defaults to 1 (set before torch is imported), as torchrun's does. Not set:
``TORCHELASTIC_ERROR_FILE`` and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (torchrun's agent reads them).
The script's directory is ``sys.path[0]`` (as for ``python script.py``), and each rank's stdout
and stderr are line-buffered (torchrun runs ``python -u``; whole lines keep ranks' lines apart).

A rank exits with the script's ``SystemExit`` code (0 when the script returns; a non-int code is
printed and gives 1, as the interpreter does); an exception prints its traceback on stderr and
gives 1. After the script the rank joins its non-daemon threads and runs the exit handlers the
script registered (those inherited from this parent are dropped at the fork), flushes stdout and
stderr and leaves with ``os._exit``: it never returns into this module.

The parent polls its children (``os.waitpid(WNOHANG)``) until ``--timeout``. On the first rank
that exits nonzero (or dies by a signal) it names the rank and code on stderr, gives the others
``FAILURE_GRACE_S`` to end on their own, SIGKILLs the rest and exits with that code (128 + the
signal number for a death by signal). At the timeout it names the ranks still running, asks them
for their Python stacks (``faulthandler`` on SIGUSR1, to stderr), SIGKILLs them after
``STACK_GRACE_S`` and exits :data:`TIMEOUT_EXIT`. SIGTERM/SIGINT/SIGHUP to the parent SIGKILL
the ranks (which also die with the parent: ``PR_SET_PDEATHSIG``).

The fork is only safe before any thread starts: a parent with more than one Python thread after
its imports refuses (exit :data:`LAUNCHER_ERROR_EXIT`, naming the threads).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import datetime
import faulthandler
import importlib
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, NoReturn, Sequence

DEFAULT_TIMEOUT_S = 600.0
FAILURE_GRACE_S = 1.0  # after the first failed rank: how long the others may take to end
STACK_GRACE_S = 0.5  # at the timeout: between asking for stacks and SIGKILL
REAP_S = 10.0  # after SIGKILL: how long the kernel may take to end the ranks
POLL_S = 0.02
TIMEOUT_EXIT = 124
LAUNCHER_ERROR_EXIT = 2
HOST = "127.0.0.1"
PREFIX = "fork_launch:"


class LaunchError(RuntimeError):
    """The launcher cannot start the ranks (the message names the value and the rule)."""


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def top_level_imports(script: str) -> list[tuple[str, bool]]:
    """``(module, maybe)`` for what ``script`` imports in its module body (not inside functions,
    ``if`` or ``try``), in order: ``import a.b`` gives ``("a.b", False)``; ``from a.b import c``
    gives ``("a.b", False)`` and ``("a.b.c", True)`` (``maybe``: a module only if ``c`` is one).
    ``__future__`` and relative imports are left out."""
    with open(script, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=script)
    found: list[tuple[str, bool]] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [(a.name, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            found.append((str(node.module), False))
            found += [(f"{node.module}.{a.name}", True) for a in node.names if a.name != "*"]
    return found


def preload(script: str) -> list[str]:
    """Import torch, torch.distributed, torch._dynamo, :mod:`overlap_runtime.rank_start` (the
    ranks use it) and
    ``script``'s top-level imports (:func:`top_level_imports`); return the modules imported.

    Raises:
        LaunchError: an import failed (naming the module); a ``from m import name`` whose
            ``name`` is no module of ``m`` is not tried (``m`` has it) or not an error (the
            script's own import then says what is missing).
    """
    done = []
    # torch._dynamo: fully_shard and every optimizer import it on first use (~1 s of CPU a rank);
    # it imports triton, whose TRITON_INTERPRET the ranks inherit from this process unchanged
    wanted = [("torch", False), ("torch.distributed", False), ("torch._dynamo", False),
              ("overlap_runtime.rank_start", False), *top_level_imports(script)]
    for module, maybe in wanted:
        parent, _, attr = module.rpartition(".")
        if maybe and hasattr(sys.modules.get(parent), attr):
            continue  # ``from parent import attr``: already there (an attribute or a module)
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if maybe and exc.name == module:
                continue  # ``attr`` is no module of ``parent``
            raise LaunchError(f"preloading {module!r} (imported by {script}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            raise LaunchError(f"preloading {module!r} (imported by {script}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        done.append(module)
    return done


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun ``--standalone --nproc-per-node nproc`` gives rank ``rank``."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
        "MASTER_ADDR": HOST, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": f"fork_launch-{os.getpid()}",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def _exit_code(code: Any) -> int:
    """The process exit status of ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback of ``exc`` from the script's first frame on (as ``python script.py``
    prints it); the whole traceback when no frame is the script's (e.g. a syntax error)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def _run_rank(script: str, argv: Sequence[str], env: dict[str, str], parent: int,
              listener: socket.socket) -> NoReturn:
    """In the forked child: become the rank and run ``script``; never returns. Signal handlers
    are the interpreter's defaults (the parent installs its own only after the forks)."""
    code = 1
    try:
        from overlap_runtime import rank_start  # imported by the parent before the fork

        listener.close()  # the parent's store takes it over
        rank_start.die_with_parent(parent)
        atexit._clear()  # the parent's exit handlers are not this rank's
        os.environ.update(env)
        sys.argv = [script, *argv]
        for stream in (sys.stdout, sys.stderr):  # whole lines, even under PYTHONUNBUFFERED
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException as exc:  # noqa: BLE001 - the rank's failure, reported as python would
            _print_script_traceback(exc, script)
            code = 1
        # What the interpreter does at exit: join non-daemon threads, then the exit handlers.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failure of this function itself
        traceback.print_exc()
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - nothing left to report it to
                pass
        os._exit(code)


def _status_text(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _reap(pending: dict[int, int], codes: dict[int, int]) -> list[int]:
    """Collect the children of ``pending`` (pid -> rank) that ended; return their ranks."""
    ended = []
    for pid, rank in list(pending.items()):
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            codes[rank] = os.waitstatus_to_exitcode(status)
            del pending[pid]
            ended.append(rank)
    return ended


def _kill(pending: dict[int, int], codes: dict[int, int]) -> None:
    """SIGKILL every child still pending and reap it (at most ``REAP_S``)."""
    for pid in pending:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + REAP_S
    while pending and time.monotonic() < deadline:
        _reap(pending, codes)
        time.sleep(POLL_S)
    if pending:
        _say(f"ranks {sorted(pending.values())} (pids {sorted(pending)}) not reaped "
             f"{REAP_S:.0f} s after SIGKILL")


def _supervise(pending: dict[int, int], timeout_s: float, nproc: int) -> int:
    """Wait for the ranks (pid -> rank); return the launcher's exit code."""
    codes: dict[int, int] = {}
    first: tuple[int, int] | None = None  # (rank, code) of the first failure
    failed_at = 0.0
    deadline = time.monotonic() + timeout_s
    while pending:
        for rank in _reap(pending, codes):
            if codes[rank] != 0:
                _say(f"rank {rank} of {nproc} {_status_text(codes[rank])}")
                if first is None:
                    first, failed_at = (rank, codes[rank]), time.monotonic()
        now = time.monotonic()
        if pending and first is not None and now >= failed_at + FAILURE_GRACE_S:
            _say(f"rank {first[0]} failed first; killing ranks {sorted(pending.values())}, "
                 f"still running {FAILURE_GRACE_S:.1f} s later")
            _kill(pending, codes)
            break
        if pending and now >= deadline:
            running = sorted(pending.values())
            _say(f"timeout: ranks {running} of {nproc} still running after {timeout_s:g} s "
                 f"(--timeout); their stacks follow, then SIGKILL")
            for pid in pending:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(STACK_GRACE_S)
            _kill(pending, codes)
            return TIMEOUT_EXIT
        if pending:
            time.sleep(POLL_S)
    if first is None:
        return 0
    rank, code = first
    exit_code = 128 - code if code < 0 else code
    _say(f"exit {exit_code}: rank {rank} of {nproc} {_status_text(code)}")
    return exit_code


def launch(script: str, nproc: int, timeout_s: float = DEFAULT_TIMEOUT_S,
           argv: Sequence[str] = ()) -> int:
    """Run ``script`` on ``nproc`` forked ranks; return the launcher's exit code (0: every rank
    exited 0; the first failed rank's code; :data:`TIMEOUT_EXIT` at the timeout).

    Raises:
        LaunchError: a bad argument, a failed preload or a thread running before the fork.
    """
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {nproc}")
    if not timeout_s > 0:
        raise LaunchError(f"--timeout must be > 0, got {timeout_s}")
    if not os.path.isfile(script):
        raise LaunchError(f"script {script!r} is not a file")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, as torchrun
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # ``python script.py``'s path
    preload(script)
    import torch.distributed as dist

    threads = threading.enumerate()
    if threading.active_count() != 1:
        raise LaunchError(
            f"{threading.active_count()} threads run in the parent after the imports "
            f"({[t.name for t in threads]}): forking is only safe before any thread starts "
            f"(a module imported by {script} started one)")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    pending: dict[int, int] = {}
    try:
        listener.bind((HOST, 0))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered here may be written again by a child
        parent = os.getpid()
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _run_rank(script, argv, rank_env(rank, nproc, port), parent, listener)
            pending[pid] = rank

        def interrupted(signum: int, _frame: Any) -> None:
            raise _Interrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, interrupted)
        # The ranks connect as clients (TORCHELASTIC_USE_AGENT_STORE); the store takes over the
        # socket that was listening since before the fork (it closes the descriptor it is given).
        store = dist.TCPStore(HOST, port, world_size=None, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))
        listener.close()
        try:
            return _supervise(pending, timeout_s, nproc)
        except _Interrupted as exc:
            _say(f"got {exc}; killing ranks {sorted(pending.values())}")
            return 128 + exc.signum
        finally:
            del store
    finally:
        listener.close()
        if pending:
            _kill(pending, {})


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.fork_launch",
        description="Run a script on N CPU ranks as torchrun does, forked from one interpreter.")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for the whole run (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    try:
        return launch(ns.script, ns.nproc_per_node, ns.timeout, ns.script_args)
    except LaunchError as exc:
        _say(str(exc))
        return LAUNCHER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
