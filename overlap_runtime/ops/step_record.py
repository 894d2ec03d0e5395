"""What a rank really ran: a per-process recorder of communication launches and tasks.

Off unless a :class:`StepRecorder` is active (``with recording(rec):``): every site then costs
one module-attribute read. The sites, one per kind of launch, all in ``ops.comm``
(``all_to_all_single`` and its backward, ``all_gather`` and its backward, ``isend``,
``irecv``, ``ring_shift``: every message the runtime sends goes through them), plus the task
scopes: ``PipelineSchedule`` actions (``ActionContext.run``) and the trainer's forward /
backward without a pipeline (``0F0`` / ``0B0``). An entry names the task the launch belongs to
(the innermost scope of the launching thread; the OVERLAP_B_F threads each have their own),
the op (``send``, ``recv``, ``collective``), the group (name given by the trainer, and its
global ranks), the peer's global rank, the bytes and the runtime's label (``S0.L1.dispatch``,
``0SEND_F1``). ``stepgraph.conformance`` checks a step's records against the step graph.

The ``torch.distributed`` boundary: while a recorder is active, the Python collective and
point-to-point calls of ``torch.distributed`` (``dist.all_reduce``, ``dist.isend``, ... : every
name in :data:`BOUNDARY_CALLS`, on ``torch.distributed`` and ``distributed_c10d`` alike) are
tapped. A call made by ``ops.comm`` is the launch that ``ops.comm`` has just recorded; a call
made by FSDP2 (``torch.distributed.fsdp``: its unshard and reduce-scatter sit outside the step
graph by rule) is not a task of the graph; any other call is recorded with ``direct=True``, and
conformance rejects it: a collective the graph cannot see must not run unseen in a checked
step. Not seen: functional collectives (``torch.distributed._functional_collectives``, DTensor
redistribution) and names bound before the block (``from torch.distributed import
all_reduce``).

Why a process-wide slot rather than an argument: the launches sit deep inside autograd
functions and worker threads that no caller can hand a recorder to; the slot is set and
cleared by one context manager, and a recorder is never shared between processes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class RecordEntry:
    """One recorded event: a communication launch (``op`` send/recv/collective) or the start of
    a task (``op == "task"``, ``task`` its name)."""

    op: str
    task: str | None
    group: str | None = None
    group_ranks: tuple[int, ...] = ()
    peer: int | None = None
    nbytes: int = 0
    label: str = ""
    collective: str | None = None
    thread: str = ""
    direct: bool = False  # issued with torch.distributed itself, not through ops.comm

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RecordEntry":
        return RecordEntry(**{**d, "group_ranks": tuple(d.get("group_ranks", ()))})


class StepRecorder:
    """Collects :class:`RecordEntry` objects of this process (thread-safe).

    Args:
        group_names: ``{process group: name}`` (``"cp"``, ``"ep"``, ``"pp"``); launches on other
            groups are recorded with the name ``"?"``.
    """

    def __init__(self, group_names: dict[Any, str] | None = None) -> None:
        self.entries: list[RecordEntry] = []
        self._names = {id(g): n for g, n in (group_names or {}).items()}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _stack(self) -> list[str]:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def current_task(self) -> str | None:
        st = self._stack()
        return st[-1] if st else None

    def add(self, entry: RecordEntry) -> None:
        with self._lock:
            self.entries.append(entry)

    def group_info(self, group: Any) -> tuple[str, tuple[int, ...]]:
        import torch.distributed as dist

        name = self._names.get(id(group), "?")
        if group is None or group is dist.GroupMember.WORLD:
            return (name if name != "?" else "world"), tuple(range(dist.get_world_size()))
        return name, tuple(dist.get_process_group_ranks(group))


_ACTIVE: StepRecorder | None = None


def active() -> StepRecorder | None:
    """The recorder now active in this process, or None."""
    return _ACTIVE


@contextlib.contextmanager
def recording(recorder: StepRecorder) -> Iterator[StepRecorder]:
    """Record every launch of this process into ``recorder`` inside the block."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("step_record.recording: a recorder is already active in this process")
    _ACTIVE = recorder
    restore = _tap_boundary()
    try:
        yield recorder
    finally:
        restore()
        _ACTIVE = None


@contextlib.contextmanager
def _scope(rec: StepRecorder, name: str) -> Iterator[None]:
    st = rec._stack()
    st.append(name)
    rec.add(RecordEntry("task", name, thread=threading.current_thread().name))
    try:
        yield
    finally:
        st.pop()


_NULL = contextlib.nullcontext()


def task_scope(name: Any) -> contextlib.AbstractContextManager[Any]:
    """Launches inside the block belong to task ``str(name)`` (a no-op when not recording)."""
    rec = _ACTIVE
    if rec is None:
        return _NULL
    return _scope(rec, str(name))


def note_comm(op: str, group: Any, peer: int | None, nbytes: int, label: str,
              collective: str | None = None) -> None:
    """Record one launch (``peer``: a global rank) if a recorder is active."""
    rec = _ACTIVE
    if rec is None:
        return
    name, ranks = rec.group_info(group)
    rec.add(RecordEntry(op, rec.current_task(), name, ranks, peer, int(nbytes), label,
                        collective, threading.current_thread().name))


# --------------------------------------------------------------------------- the boundary

#: The ``torch.distributed`` calls tapped while recording, with the op each is recorded as.
BOUNDARY_CALLS: dict[str, str] = {
    **{n: "collective" for n in (
        "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
        "all_gather_single", "all_gather_object", "all_gather_coalesced", "all_to_all",
        "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
        "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
        "scatter_object_list", "barrier", "monitored_barrier", "_all_gather_base",
        "_reduce_scatter_base", "batch_isend_irecv")},
    **{n: "send" for n in ("send", "isend", "send_object_list")},
    **{n: "recv" for n in ("recv", "irecv", "recv_object_list")},
}
# callers whose launches are not direct: ops.comm records its own; FSDP2 is outside the graph
_KNOWN_CALLERS = ("overlap_runtime.ops.comm.", "torch.distributed.fsdp.")
_INPUTS = ("tensor", "tensors", "input", "input_tensor", "input_list", "input_tensor_list")
_tap_local = threading.local()


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _tap(name: str, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        rec = _ACTIVE
        if rec is None or getattr(_tap_local, "inside", False):  # the call's own inner calls
            return original(*args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "") + "."
        _tap_local.inside = True
        try:
            if not caller.startswith(_KNOWN_CALLERS):
                bound = signature.bind_partial(*args, **kwargs).arguments
                peer = bound.get("dst" if op == "send" else "src") if op != "collective" else None
                group, ranks = rec.group_info(bound.get("group"))
                rec.add(RecordEntry(
                    op, rec.current_task(), group, ranks,
                    peer if isinstance(peer, int) else None,
                    sum(_nbytes(bound.get(k)) for k in _INPUTS),
                    f"torch.distributed.{name}", name, threading.current_thread().name,
                    direct=True))
            return original(*args, **kwargs)
        finally:
            _tap_local.inside = False

    return call


def _tap_boundary() -> Callable[[], None]:
    """Replace every :data:`BOUNDARY_CALLS` function of ``torch.distributed`` (and of
    ``distributed_c10d``) by a recording tap; returns the function that puts them back."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved: list[tuple[Any, str, Any]] = []
    for name, op in BOUNDARY_CALLS.items():
        original = getattr(dist, name, None)
        if original is None:  # not in this torch release
            continue
        tap = _tap(name, op, original)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                saved.append((module, name, original))
                setattr(module, name, tap)

    def restore() -> None:
        for module, name, original in saved:
            setattr(module, name, original)

    return restore
