"""How a rank process of :func:`overlap_runtime.launch.spawn` starts, and what it checks first.

* **The forkserver imports what the parent imported.** multiprocessing starts its forkserver as
  ``python -c ...``, which puts the *current directory* first on ``sys.path``, and (Python 3.11)
  ignores the ``sys_path`` it is handed; it then preloads :data:`FORKSERVER_PRELOAD_OURS`. Run
  from a directory that holds another copy of ``overlap_runtime`` (an old checkout, a decoy), the
  forkserver -- and every rank forked from it -- imported that copy while the parent ran the one
  on ``PYTHONPATH`` or installed: the ranks ran other code than the parent, silently.
  :func:`start_forkserver` starts it with the parent's ``sys.path`` as ``PYTHONPATH`` and
  ``PYTHONSAFEPATH=1`` (no current directory first; Python >= 3.11), and
  :func:`restore_python_env` gives each rank the parent's own values of those two variables back
  (a subprocess a rank starts must see the user's environment, not ours). On Python 3.10, which
  has no ``PYTHONSAFEPATH``, the forkserver does not preload ``overlap_runtime`` at all: each rank
  imports it after multiprocessing set the parent's ``sys.path``.
* **Each rank checks it.** :func:`check_same_package` (the first thing a rank does) compares its
  ``overlap_runtime`` and its ``overlap_runtime.launch`` with the parent's package directory
  (:func:`package_dir`, passed in the rank's arguments) and raises an ``ImportError`` naming
  both paths when they differ.
* **A rank dies with its parent** (:func:`die_with_parent`, :func:`release_forkserver`): see
  :mod:`overlap_runtime.launch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
from typing import Any, Iterator

import overlap_runtime

_PR_SET_PDEATHSIG = 1
#: the environment variables the forkserver is started with (then given back to each rank)
PATH_ENV = ("PYTHONPATH", "PYTHONSAFEPATH")
_SAFE_PATH = sys.version_info >= (3, 11)  # PYTHONSAFEPATH exists

_CTX: Any = None


def package_dir() -> str:
    """The directory of the ``overlap_runtime`` package this process imported (real path)."""
    return os.path.dirname(os.path.realpath(overlap_runtime.__file__))


def python_env() -> dict[str, str | None]:
    """This process's values of :data:`PATH_ENV` (None: unset), for :func:`restore_python_env`."""
    return {k: os.environ.get(k) for k in PATH_ENV}


def restore_python_env(values: dict[str, str | None]) -> None:
    """Set (or unset, for None) :data:`PATH_ENV` to the parent's values in a rank."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def check_same_package(expected_dir: str, rank: int) -> None:
    """Raise ``ImportError`` unless this rank's ``overlap_runtime`` (and this module) come from
    ``expected_dir``, the parent's :func:`package_dir`."""
    mine = os.path.dirname(os.path.realpath(overlap_runtime.__file__))
    here = os.path.dirname(os.path.realpath(__file__))
    for what, got in (("overlap_runtime", mine), ("overlap_runtime.rank_start", here)):
        if got != expected_dir:
            raise ImportError(
                f"rank {rank} imported {what} from {got}, but the process that spawned it "
                f"imported overlap_runtime from {expected_dir}: the rank would run other code "
                f"(is there another copy of overlap_runtime in the working directory "
                f"{os.getcwd()} or earlier on sys.path?); run from another directory, or put the "
                f"copy you mean first on PYTHONPATH"
            )


def _parent_sys_path() -> list[str]:
    """``sys.path`` as the forkserver's ``PYTHONPATH``: '' (the current directory) made absolute;
    an entry holding the path separator cannot be passed and is left out (the rank's
    :func:`check_same_package` catches what that changes)."""
    out = []
    for p in sys.path:
        p = p or os.getcwd()
        if os.pathsep not in p and p not in out:
            out.append(p)
    return out


@contextlib.contextmanager
def _forkserver_environment() -> Iterator[None]:
    """While the forkserver starts: :data:`PATH_ENV` set to import like this process.

    ``os.environ`` is changed for the moment the forkserver (and multiprocessing's resource
    tracker) are started, then restored; another thread reading the environment just then would
    see the change.
    """
    saved = python_env()
    os.environ["PYTHONPATH"] = os.pathsep.join(_parent_sys_path())
    if _SAFE_PATH:
        os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        restore_python_env(saved)


#: What the forkserver imports once, so that a rank forked from it does not: torch and the
#: torch.distributed modules every parallel feature loads (DTensor with its sympy shape code,
#: FSDP2, DCP: ~1 s of CPU each time a rank imported them itself), and ``torch._dynamo``, which
#: ``fully_shard`` and every optimizer import on first use (about 1 s of CPU per rank). None of
#: them starts a thread. ``torch._dynamo`` imports the ``triton`` package (not a kernel of ours):
#: see :data:`FRESH_INTERPRETER_ENV`.
FORKSERVER_PRELOAD_TORCH = ("torch", "torch.distributed", "torch.distributed.tensor",
                            "torch.distributed.fsdp", "torch.distributed.checkpoint",
                            "torch._dynamo")
#: Variables of a spawn's ``env`` that a rank forked from the forkserver cannot honour, so such a
#: spawn starts its ranks as fresh interpreters (multiprocessing's ``spawn``: about 3 s of
#: imports each): triton decorates its own ``triton.language`` helpers when it is imported, as
#: interpreted functions or not by ``TRITON_INTERPRET``, and the forkserver has imported it.
FRESH_INTERPRETER_ENV = ("TRITON_INTERPRET",)
#: Ours, where the forkserver can be made to import them from the parent's path (see the module
#: doc): ``trainer.loop`` imports the whole stack below it, and no Triton kernel module (those of
#: a rank that sets ``TRITON_INTERPRET`` must be decorated after it did).
FORKSERVER_PRELOAD_OURS = ("overlap_runtime.launch", "overlap_runtime.trainer.loop")


_EXTRA_PRELOAD: list[str] = []


def _forkserver_running() -> bool:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None) is not None


def preload_in_forkserver(*modules: str) -> None:
    """Import ``modules`` in the forkserver too, once, so that every rank forked from it starts
    with them imported instead of importing them itself (e.g. ``pytest`` where the rank function
    lives in a test module: about 0.4 s of CPU per rank, or a training script's own heavy
    imports).

    Rules: call it before this process starts its first rank (a running forkserver has imported
    what it will import: ``RuntimeError`` naming the modules); the modules are preloaded where
    :data:`FORKSERVER_PRELOAD_OURS` is (Python >= 3.11: the forkserver imports from this
    process's path, see the module doc); none of them may import a Triton kernel module (the
    kernels of a rank that sets ``TRITON_INTERPRET`` must be decorated after it did). A module that fails to import in
    the forkserver is left to each rank to import, as multiprocessing does.
    """
    if _forkserver_running():
        raise RuntimeError(f"preload_in_forkserver{modules}: the forkserver is already running "
                           f"(this process started ranks before); call it before the first "
                           f"spawn")
    for m in modules:
        if m not in _EXTRA_PRELOAD:
            _EXTRA_PRELOAD.append(m)
    if _CTX is not None and _CTX.get_start_method() == "forkserver":
        _CTX.set_forkserver_preload(_preload_list())


def _preload_list() -> list[str]:
    preload = list(FORKSERVER_PRELOAD_TORCH)
    if _SAFE_PATH:
        preload += [*FORKSERVER_PRELOAD_OURS, *_EXTRA_PRELOAD]
    return preload


def context() -> Any:
    """The multiprocessing context of the ranks: ``OVERLAP_RUNTIME_START_METHOD`` (default
    ``forkserver``, preloading :data:`FORKSERVER_PRELOAD_TORCH`, and
    :data:`FORKSERVER_PRELOAD_OURS` with what :func:`preload_in_forkserver` added where the
    forkserver can be made to import them from the parent's path: see the module doc)."""
    global _CTX
    if _CTX is None:
        method = os.environ.get("OVERLAP_RUNTIME_START_METHOD", "forkserver")
        _CTX = mp.get_context(method)
        if method == "forkserver":
            _CTX.set_forkserver_preload(_preload_list())
    return _CTX


def context_for(env: dict[str, str] | None) -> Any:
    """The context of one spawn whose ranks get ``env``: :func:`context`, except that an ``env``
    setting a variable of :data:`FRESH_INTERPRETER_ENV` gets multiprocessing's ``spawn``
    context when :func:`context` is the forkserver's."""
    ctx = context()
    if ctx.get_start_method() == "forkserver" and any(k in (env or {})
                                                       for k in FRESH_INTERPRETER_ENV):
        return mp.get_context("spawn")
    return ctx


def start_forkserver() -> int | None:
    """Start multiprocessing's forkserver with this process's import path (a running one is
    reused: it was started here before, or by other code) and return its pid (None if
    unknown)."""
    from multiprocessing import forkserver

    with _forkserver_environment():
        forkserver.ensure_running()
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def expected_parent(method: str) -> int | None:
    """The pid a rank's parent must have: this process, or the forkserver (started here)."""
    if method != "forkserver":
        return os.getpid()
    return start_forkserver()


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux only).

    ``expected_parent`` closes the race where the parent died before the ``prctl``: if the parent
    is no longer that pid, this process exits at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # pragma: no cover - non-glibc systems
        pass
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def release_forkserver() -> None:
    """Close this rank's copy of the forkserver's "alive" pipe write end.

    multiprocessing hands every forkserver child that write end so the child could start
    processes through the same server; while any child holds it the server never sees EOF, so
    it (and, through it, ``PR_SET_PDEATHSIG``) outlived a SIGKILLed parent. A rank never uses the
    inherited server (a nested start launches a new one), so the descriptor only did harm.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
