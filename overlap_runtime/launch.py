"""Starting ranks: ``spawn`` for the embedded default, ``init_from_env`` for torchrun.

``spawn(fn, world_size)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` child processes
that form one process group, and returns each rank's return value. It never hangs and never
leaves orphans:

* the rendezvous store is hosted by the parent on a port the OS picks (no free-port race),
  listening on the loopback address only (``store_host`` / ``OVERLAP_RUNTIME_STORE_HOST`` pick
  another address to bind);
* each child reports through its own pipe; the parent waits on pipes and process sentinels at
  once, so a child that raises, exits or crashes is seen at once;
* on the first failure every other child is killed and :class:`RankFailedError` carries the
  failing rank's traceback (``failure_grace_s`` first gives the others that long to end on their
  own, and collects their errors: how a job fails, seen from every rank);
* at the deadline the parent asks the survivors for their Python stacks (``faulthandler`` on
  SIGUSR1), kills them, and raises :class:`RanksTimeoutError` naming the ranks still running
  with their stacks;
* nothing outlives a SIGKILLed parent: ranks carry ``PR_SET_PDEATHSIG`` and close their inherited
  copy of the forkserver's "alive" pipe, so the forkserver (the ranks' parent) sees EOF and exits
  when the parent dies, which kills the ranks; the ranks' stack files are unlinked temporary files
  passed by descriptor, so no path is left on disk; and the forkserver, exiting after its
  launcher died, removes the launcher's multiprocessing directory (``pymp-*``, holding the
  forkserver's socket), which only the launcher's clean exit would have removed
  (:func:`_forkserver_removes_dead_launchers_temp_dir`).

Children start from a forkserver that has already imported torch, torch.distributed's DTensor,
FSDP2, DCP, torch._dynamo and this package's stack (no Triton kernel module; a spawn whose ``env``
sets ``TRITON_INTERPRET`` starts fresh interpreters instead: :mod:`overlap_runtime.rank_start`), so a
rank costs a fork, not a fresh interpreter and its imports (the first spawn in a process pays them
once). The forkserver is started with this process's import path, and every rank first checks
that it runs the same ``overlap_runtime`` as this process (an ``ImportError`` naming both
directories otherwise): a copy of the package in the working directory must not replace the
parent's in the ranks (:mod:`overlap_runtime.rank_start`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import io
import multiprocessing.connection as mpc
import multiprocessing.reduction as mp_reduction
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from overlap_runtime import rank_start
from overlap_runtime.platform import (DeviceUnavailableError, backend_for, device_kind,
                                      resolve_device, set_device)

DEFAULT_SPAWN_TIMEOUT_S = 300.0
#: ``<launcher pid>:<launcher's pymp dir>``, set while the forkserver starts (and only then)
LAUNCHER_TEMP_ENV = "OVERLAP_RUNTIME_LAUNCHER_TEMP_DIR"
_LAUNCHER_GONE_WAIT_S = 2.0  # how long the exiting forkserver waits to see its launcher gone
DEFAULT_STORE_HOST = "127.0.0.1"
STORE_HOST_ENV = "OVERLAP_RUNTIME_STORE_HOST"
_SETTLE_S = 1.0  # after a first failure, how long a death may take to be seen (see spawn)


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended badly.

    Attributes:
        rank: the rank.  exc_type: the exception's class name (None when the rank died without
        a result).  message: ``str(exception)``, or how it died.  traceback: the rank's
        traceback ("" when it died).  exit_code: the process's exit code when it died (negative:
        killed by that signal).  after_s: seconds after the job's first failure that the parent
        saw it (0 for the first).
    """

    rank: int
    exc_type: str | None
    message: str
    traceback: str = ""
    exit_code: int | None = None
    after_s: float = 0.0

    @property
    def died(self) -> bool:
        return self.exc_type is None

    def summary(self) -> str:
        """One line: ``rank 0 raised TrainStepError: <first line>`` / ``rank 2 ... died ...``."""
        if self.died:
            return self.message
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"rank {self.rank} raised {self.exc_type}: {first}"


class RankFailedError(RuntimeError):
    """A rank raised or died; ``rank`` and ``child_traceback`` say which and where.

    ``failures`` holds every rank that failed before the job ended (the first one and, with
    ``spawn(failure_grace_s=...)``, those that failed in the grace period after it), by rank;
    ``unfinished`` the ranks still running when the job was killed.
    """

    def __init__(self, rank: int, message: str, child_traceback: str = "",
                 failures: dict[int, RankFailure] | None = None,
                 unfinished: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback
        self.failures = dict(failures or {})
        self.unfinished = list(unfinished)


class RanksTimeoutError(TimeoutError):
    """Ranks were still running at the deadline; ``ranks`` lists them, ``stacks`` their stacks."""

    def __init__(self, message: str, ranks: list[int], stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.stacks = stacks


@dataclass(frozen=True)
class RankContext:
    """What a rank knows about itself after :func:`init_from_env`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun started this process: ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` all set.

    A command that would spawn its own ranks joins torchrun's group instead
    (:func:`init_from_env`) when this is True. ``environ`` defaults to ``os.environ``.

    Raises:
        RuntimeError: only some of the three are set (naming which), a half-configured
            environment that neither spawning nor joining would handle correctly.
    """
    env = os.environ if environ is None else environ
    present = [k for k in TORCHRUN_ENV if k in env]
    if present and len(present) < len(TORCHRUN_ENV):
        missing = [k for k in TORCHRUN_ENV if k not in env]
        raise RuntimeError(
            f"torchrun environment incomplete: {present} set but {missing} not; start the "
            f"command with torchrun, or unset {present} to let it spawn its own ranks"
        )
    return bool(present)


class _PassedFd:
    """A file descriptor that travels to a child in ``Process`` args (dup'd by multiprocessing)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild_fd, (mp_reduction.DupFd(self.fd),)


def _rebuild_fd(dup: Any) -> int:
    return int(dup.detach())


def _fd_of(x: _PassedFd | int) -> int:
    """The child's descriptor: an int after pickling (spawn/forkserver), the object under fork."""
    return x.fd if isinstance(x, _PassedFd) else int(x)


def init_from_env(
    device: str | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_SPAWN_TIMEOUT_S,
) -> RankContext:
    """Join the process group described by torchrun's environment.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a missing one raises naming
    it). ``device`` is a kind (``cpu``/``cuda``/``npu``); accelerators get ``<kind>:LOCAL_RANK``.
    ``backend`` defaults to the device kind's backend (gloo/nccl/hccl).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env: environment variables {missing} are not set; start the program "
            f"with torchrun or use overlap_runtime.launch.spawn"
        )
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device or "cpu", local_rank=local_rank)
    set_device(dev)
    be = backend or backend_for(dev)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if dev.type != "cpu":
            kwargs["device_id"] = dev
        dist.init_process_group(
            backend=be,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    return RankContext(rank, world_size, local_rank, dev, be)


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    conn: mpc.Connection,
    store_addr: str,
    store_port: int,
    backend: str,
    device: str,
    timeout_s: float,
    stack_fd: _PassedFd | int,
    env: dict[str, str],
    num_threads: int,
    expected_parent: int | None,
    package_dir: str,
    python_env: dict[str, str | None],
) -> None:
    rank_start.die_with_parent(expected_parent)
    rank_start.release_forkserver()
    rank_start.restore_python_env(python_env)  # the forkserver's PYTHONPATH is ours, not theirs
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": store_addr,
            "MASTER_PORT": str(store_port),
        }
    )
    stack_fh = open(_fd_of(stack_fd), "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    status: tuple[str, Any]
    try:
        rank_start.check_same_package(package_dir, rank)
        dev = resolve_device(device, local_rank=rank)
        set_device(dev)
        store = dist.TCPStore(
            store_addr,
            store_port,
            world_size=None,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        status = ("ok", buf.getvalue())
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        status = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
    try:
        conn.send(status)
    finally:
        conn.close()
    if status[0] == "ok" and dist.is_initialized():
        # Leave together: a rank that exits while a peer is still connecting its gloo mesh
        # breaks the peer's init ("connection closed by peer"). Bounded; errors are moot here.
        try:
            work = dist.barrier(async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=min(timeout_s, 60.0)))
        except Exception:  # noqa: BLE001 - the result is already with the parent
            pass
    # No destroy_process_group and no interpreter teardown: both can block on the gloo threads of
    # a group whose peer failed, and the parent already has the result.
    stack_fh.flush()
    os._exit(0 if status[0] == "ok" else 1)


# What a rank's collective raises when a peer's process went away (gloo, NCCL, HCCL): the error
# of a rank that was waiting on the failing one, not a cause of its own.
_PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer",
                      "gloo/transport/tcp", "communicator was aborted", "Broken pipe")


def _is_peer_loss(f: RankFailure) -> bool:
    """``f`` is a rank's collective failing because a peer's connection closed."""
    return not f.died and any(m in f.message for m in _PEER_LOSS_MARKERS)


def _rank_failed(failures: dict[int, RankFailure], results: dict[int, Any], world_size: int,
                 grace_s: float) -> RankFailedError:
    """The job's RankFailedError: the first failure's message and traceback, then (with a grace
    period) one line per other rank: how it ended and when.

    The head is the first failure, except that within ``_SETTLE_S`` of it a rank that died
    without a result comes first, and a rank whose error is its own comes before one whose error
    only says a peer went away (:func:`_is_peer_loss`): a rank that raises or dies makes its
    peers' collectives fail within milliseconds (their connections to it close), and the parent
    may read their errors first (even in the same wakeup)."""
    def key(f: RankFailure) -> tuple[bool, bool, float, int]:
        settling = f.after_s <= _SETTLE_S
        return (not (f.died and settling), settling and _is_peer_loss(f), f.after_s, f.rank)

    head = min(failures.values(), key=key)
    if head.died:
        message = head.message
    else:
        message = (f"rank {head.rank} of {world_size} raised {head.exc_type}: {head.message}\n"
                   f"--- rank {head.rank} traceback ---\n{head.traceback}")
    unfinished = sorted(set(range(world_size)) - set(failures) - set(results))
    if grace_s > 0:
        lines = []
        for r in range(world_size):
            if r == head.rank:
                continue
            if r in failures:
                f = failures[r]
                lines.append(f"  +{f.after_s:.2f}s {f.summary()}")
            elif r in results:
                lines.append(f"  rank {r} finished")
            else:
                lines.append(f"  rank {r} still running after the {grace_s:g}s grace: killed")
        message += (f"\n--- the other ranks within {grace_s:g}s of rank {head.rank}'s failure ---\n"
                    + "\n".join(lines))
    return RankFailedError(head.rank, message, head.traceback, failures, unfinished)


def _kill_all(procs: Sequence[Any], grace_s: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _death_message(rank: int, world_size: int, code: int | None) -> str:
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"died with exit code {code}"
    return f"rank {rank} of {world_size} {how} without a result"


def _read(fh: Any) -> str:
    """What a rank's faulthandler wrote to its (unlinked) stack file, read without seeking."""
    try:
        size = os.fstat(fh.fileno()).st_size
        return os.pread(fh.fileno(), size, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _host_store(host: str, timeout_s: float) -> tuple[Any, str]:
    """Host the rendezvous TCPStore listening on ``host`` only; return it and the address the
    children connect to.

    TCPStore's own server binds every interface, so the socket is bound and listening here and
    handed over (``master_listen_fd``). A wildcard ``host`` (``0.0.0.0``/``::``) binds every
    interface on purpose; the children then connect through loopback.
    """
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(
            f"spawn: store_host {host!r} does not resolve ({exc}); give an address of this "
            f"machine to bind the rendezvous store to (default {DEFAULT_STORE_HOST})"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        bound, port = sock.getsockname()[:2]
        # The store owns (and closes) the descriptor it is given: give it a duplicate.
        store = dist.TCPStore(
            bound, port, world_size=None, is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
            master_listen_fd=os.dup(sock.fileno()),
        )
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    return store, wildcard.get(bound, bound)


#: Descriptors a spawned job needs per rank, in the parent and in each rank: the parent holds
#: a pipe end, a stack file and a process sentinel per rank (3); each rank holds a socket to
#: every peer of its gloo group and one to the store (world_size + a few). A margin covers
#: everything else a process has open.
FDS_PER_RANK = 4
FD_MARGIN = 256


@contextlib.contextmanager
def _launcher_temp_dir_told() -> Iterator[None]:
    """While the forkserver may start: :data:`LAUNCHER_TEMP_ENV` names this process and its
    multiprocessing temporary directory, for the forkserver to remove if this process dies."""
    from multiprocessing import util

    saved = os.environ.get(LAUNCHER_TEMP_ENV)
    os.environ[LAUNCHER_TEMP_ENV] = f"{os.getpid()}:{util.get_temp_dir()}"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LAUNCHER_TEMP_ENV, None)
        else:
            os.environ[LAUNCHER_TEMP_ENV] = saved


def _remove_if_launcher_gone(directory: str, launcher: int, server: int) -> None:
    """At the forkserver's exit: remove ``directory`` if the launcher is gone (the forkserver
    was re-parented), waiting at most ``_LAUNCHER_GONE_WAIT_S`` for the kernel to re-parent it.
    A launcher still alive (it stopped its forkserver) keeps its directory."""
    if os.getpid() != server:  # a rank forked from the server inherited this handler
        return
    deadline = time.monotonic() + _LAUNCHER_GONE_WAIT_S
    while os.getppid() == launcher and time.monotonic() < deadline:
        time.sleep(0.01)
    if os.getppid() != launcher:
        shutil.rmtree(directory, ignore_errors=True)


def _forkserver_removes_dead_launchers_temp_dir() -> None:
    """In the forkserver (which imports this module at start, ``rank_start``): arrange to
    remove the launcher's ``pymp-*`` directory when the server exits because the launcher died.

    multiprocessing removes that directory in the launcher's exit handlers, which a SIGKILL
    skips; the forkserver outlives its launcher by the moment it takes to see EOF on its "alive"
    pipe, and exits normally then (its exit handlers do run). Only the launcher's direct child
    that finds :data:`LAUNCHER_TEMP_ENV` naming its parent registers (the forkserver); the
    variable is cleared so that nothing started later inherits it.
    """
    spec = os.environ.pop(LAUNCHER_TEMP_ENV, None)
    if not spec:
        return
    pid, _, directory = spec.partition(":")
    if not pid.isdigit() or not directory or os.getppid() != int(pid):
        return
    atexit.register(_remove_if_launcher_gone, directory, int(pid), os.getpid())


_forkserver_removes_dead_launchers_temp_dir()


def check_open_files(world_size: int) -> None:
    """Raise ValueError before any rank starts when ``world_size`` ranks would run out of file
    descriptors (``RLIMIT_NOFILE``'s soft limit: EMFILE halfway through the spawn otherwise).

    The need is ``FDS_PER_RANK * world_size + FD_MARGIN``; the soft limit is not raised here
    (``ulimit -n`` is the user's choice).
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FDS_PER_RANK * world_size + FD_MARGIN
    if soft != resource.RLIM_INFINITY and need > soft:
        raise ValueError(
            f"world_size={world_size} ranks need about {need} open files ({FDS_PER_RANK} per "
            f"rank: pipes and stack files here, a socket to every peer in each rank) but this "
            f"process may open {soft} (RLIMIT_NOFILE; hard limit "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}): use fewer ranks or "
            f"raise the limit (ulimit -n)")


def check_world(device: str, world_size: int) -> None:
    """Raise before any rank starts when ``world_size`` ranks on ``device`` cannot run here.

    Every rank of an accelerator kind takes its own device (``<kind>:<rank>``), so ``world_size``
    devices of that kind must exist; CPU ranks need nothing.

    Raises:
        ValueError: ``world_size < 1``, or more ranks than file descriptors allow
            (:func:`check_open_files`).
        DeviceUnavailableError: the kind is not available, or has fewer devices than ranks
            (naming the kind and both counts).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_open_files(world_size)
    if device_kind(device) == "cpu":
        return
    try:
        resolve_device(device, local_rank=world_size - 1)
    except DeviceUnavailableError as exc:
        raise DeviceUnavailableError(
            f"{world_size} ranks on {device!r} (one device each) cannot start here: {exc}"
        ) from None


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str | None = None,
    device: str = "cpu",
    timeout_s: float = DEFAULT_SPAWN_TIMEOUT_S,
    env: dict[str, str] | None = None,
    num_threads: int = 1,
    store_host: str | None = None,
    failure_grace_s: float = 0.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return their results.

    Args:
        fn: a module-level (picklable) function. Its return value is sent back with torch.save,
            so tensors and plain Python data are fine.
        world_size: number of ranks (>= 1).
        backend: process-group backend; defaults to the device kind's (cpu -> gloo).
        device: device kind for every rank; accelerators use ``<kind>:<rank>``.
        timeout_s: wall-clock limit for the whole job, also the process group's timeout.
        env: extra environment variables for the children; one that a forked rank cannot
            honour (``rank_start.FRESH_INTERPRETER_ENV``: ``TRITON_INTERPRET``) makes the
            ranks fresh interpreters.
        num_threads: torch intra-op threads per rank (0 leaves torch's default).
        store_host: address the rendezvous store listens on; default the environment variable
            ``OVERLAP_RUNTIME_STORE_HOST``, else ``127.0.0.1`` (loopback: no other machine can
            reach it). ``0.0.0.0`` or ``::`` listen on every interface.
        failure_grace_s: after the first rank fails, how long the others may take to end on
            their own (their own errors, e.g. a peer-failure or timeout naming what they waited
            for, are collected in ``RankFailedError.failures``) before every rank still running
            is killed. 0 (default): kill at once once a rank died, else after at most 1 s (a
            rank's death and its peers' "connection closed" errors race to the parent; the
            death is reported as the failure).

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or died; with a grace
            period the message ends with one line per other rank.
        RanksTimeoutError: ranks were still running after ``timeout_s`` (named, with stacks).
        ValueError: a bad argument (named), e.g. a ``store_host`` that does not resolve.
        DeviceUnavailableError: fewer devices of ``device``'s kind than ranks
            (:func:`check_world`), before any rank starts.
    """
    check_world(device, world_size)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not failure_grace_s >= 0:
        raise ValueError(f"failure_grace_s must be >= 0, got {failure_grace_s}")
    be = backend or backend_for(device)
    ctx = rank_start.context_for(env)
    store, store_addr = _host_store(
        store_host or os.environ.get(STORE_HOST_ENV) or DEFAULT_STORE_HOST, timeout_s
    )
    with _launcher_temp_dir_told():  # read by a forkserver started now
        expected_parent = rank_start.expected_parent(ctx.get_start_method())
    package_dir, python_env = rank_start.package_dir(), rank_start.python_env()
    # Unlinked files (O_TMPFILE on Linux): no path exists, so none can outlive a killed parent.
    stack_files = [tempfile.TemporaryFile(prefix="overlap_runtime_spawn_")
                   for _ in range(world_size)]
    procs: list[Any] = []
    conns: dict[Any, int] = {}
    try:
        for r in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child_main,
                args=(fn, r, world_size, tuple(args), child_conn, store_addr, store.port, be,
                      device,
                      timeout_s, _PassedFd(stack_files[r].fileno()), dict(env or {}), num_threads,
                      expected_parent, package_dir, python_env),
                name=f"overlap_runtime-rank{r}",
                daemon=True,
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns[parent_conn] = r
        results: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        first: list[float] = []  # monotonic time of the first failure, once there is one
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        deadline = time.monotonic() + timeout_s

        def failed(r: int, exc_type: str | None, message: str, tb: str = "") -> None:
            now = time.monotonic()
            if not first:
                first.append(now)
            failures[r] = RankFailure(r, exc_type, message, tb, procs[r].exitcode,
                                      round(now - first[0], 3))

        # After the first failure the others get failure_grace_s to end on their own, and at least
        # _SETTLE_S: a rank that dies makes its peers fail within milliseconds, and the parent may
        # read one of their errors before it sees the death, which is the root (_rank_failed).
        after_first = max(failure_grace_s, _SETTLE_S)
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if first:
                remaining = min(deadline, first[0] + after_first) - now
                if remaining <= 0:
                    break
            else:
                remaining = deadline - now
            if remaining <= 0:
                running = sorted(set(range(world_size)) - set(results))
                stacks = {}
                for r in running:
                    if procs[r].is_alive():
                        try:
                            os.kill(procs[r].pid, signal.SIGUSR1)
                        except ProcessLookupError:
                            pass
                time.sleep(0.5)
                for r in running:
                    stacks[r] = _read(stack_files[r])
                _kill_all(procs)
                detail = "\n".join(f"--- rank {r} stack ---\n{stacks[r] or '(no stack)'}" for r in running)
                raise RanksTimeoutError(
                    f"{len(running)} of {world_size} ranks still running after {timeout_s:.1f}s: "
                    f"ranks {running}\n{detail}",
                    running,
                    stacks,
                )
            ready = mpc.wait(list(conns) + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in conns:
                    r = conns.pop(obj)
                    try:
                        kind, payload = obj.recv()
                    except EOFError:
                        procs[r].join(2.0)
                        failed(r, None, _death_message(r, world_size, procs[r].exitcode))
                        continue
                    if kind == "error":
                        exc_type, exc_msg, tb = payload
                        failed(r, exc_type, exc_msg, tb)
                        continue
                    results[r] = torch.load(io.BytesIO(payload), weights_only=False)
                elif obj in sentinels:
                    r = sentinels.pop(obj)
                    procs[r].join(0.1)
                    if r in results or r in failures or not any(c_r == r for c_r in conns.values()):
                        continue
                    # Give the pipe a moment: the result may be in flight behind the exit.
                    c = next(c for c, c_r in conns.items() if c_r == r)
                    if c.poll(1.0):
                        continue
                    del conns[c]
                    c.close()
                    failed(r, None, _death_message(r, world_size, procs[r].exitcode))
            if first and failure_grace_s <= 0 and any(f.died for f in failures.values()):
                break
        if failures:
            _kill_all(procs)
            raise _rank_failed(failures, results, world_size, failure_grace_s)
        return [results[r] for r in range(world_size)]
    finally:
        _kill_all(procs)
        for c in conns:
            c.close()
        for f in stack_files:
            f.close()
        del store
