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

Why a process-wide slot rather than an argument: the launches sit deep inside autograd
functions and worker threads that no caller can hand a recorder to; the slot is set and
cleared by one context manager, and a recorder is never shared between processes.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterator

__all__ = ["RecordEntry", "StepRecorder", "recording", "task_scope", "note_comm", "active"]


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
    try:
        yield recorder
    finally:
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
