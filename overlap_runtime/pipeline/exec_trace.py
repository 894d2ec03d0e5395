"""Execution traces: when every action and comm wait really ran, per rank and thread.

A :class:`ExecutionTrace` is passed to ``PipelineSchedule.step(..., trace=t)`` and filled there
(per-call state, never on the schedule). ``gather_traces`` collects every rank's events over the
pipeline group (bounded waits), ``chrome_trace_events`` turns them into one Chrome/Perfetto trace
(one process per rank, one track per thread), and ``measured_bubble`` computes the bubble ratio
the same way the simulator does: ``1 - mean busy time / makespan``.

Events travel between ranks as JSON (UTF-8 bytes in a uint8 tensor): plain data that is
checked field by field when read back, never a format whose loading can run code.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from overlap_runtime.graph.intervals import WAIT_CATEGORIES, busy_intervals, measured_bubble
from overlap_runtime.ops.comm import all_gather


@dataclass(frozen=True)
class TraceEvent:
    """One interval: ``cat`` is ``compute`` (F/B/I/W), ``compound`` or ``comm`` (a wait)."""

    rank: int
    thread: str
    name: str
    cat: str
    start_ns: int
    end_ns: int


@dataclass
class ExecutionTrace:
    """Events of one step on one rank; thread-safe ``record``."""

    rank: int = 0
    events: list[TraceEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, name: str, cat: str, start_ns: int, end_ns: int) -> None:
        ev = TraceEvent(self.rank, threading.current_thread().name, name, cat, start_ns, end_ns)
        with self._lock:
            self.events.append(ev)

    def span(self, name: str, cat: str) -> "_Span":
        """``with trace.span("1F3", "compute"):`` records the block's wall interval."""
        return _Span(self, name, cat)


class _Span:
    def __init__(self, trace: ExecutionTrace, name: str, cat: str) -> None:
        self.trace, self.name, self.cat = trace, name, cat

    def __enter__(self) -> None:
        self.t0 = time.time_ns()

    def __exit__(self, *exc: Any) -> None:
        self.trace.record(self.name, self.cat, self.t0, time.time_ns())


_FIELDS = (("rank", int), ("thread", str), ("name", str), ("cat", str), ("start_ns", int),
           ("end_ns", int))


def encode_events(events: list[TraceEvent]) -> bytes:
    """``events`` as UTF-8 JSON: a list of ``[rank, thread, name, cat, start_ns, end_ns]``."""
    return json.dumps([[getattr(e, f) for f, _ in _FIELDS] for e in events]).encode()


def decode_events(raw: bytes, source: str = "trace") -> list[TraceEvent]:
    """The inverse of :func:`encode_events`; raises ValueError naming ``source`` and the first
    malformed event (a peer on another version, a truncated message)."""
    try:
        rows = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{source}: not a JSON list of trace events: {exc}") from exc
    if not isinstance(rows, list):
        raise ValueError(f"{source}: expected a JSON list of events, got {type(rows).__name__}")
    events = []
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == len(_FIELDS) and all(
            isinstance(v, t) and not isinstance(v, bool) for v, (_, t) in zip(row, _FIELDS))
        if not ok:
            raise ValueError(f"{source}: event {i} is {row!r}, expected "
                             f"[{', '.join(f'{f}: {t.__name__}' for f, t in _FIELDS)}]")
        events.append(TraceEvent(*row))
    return events


def gather_traces(trace: ExecutionTrace, group: dist.ProcessGroup | None = None,
                  timeout_s: float | None = None) -> list[TraceEvent]:
    """Every rank's events of ``group``, on every rank (two bounded all-gathers of cpu tensors:
    the lengths, then the JSON bytes padded to the longest; a gloo group)."""
    with trace._lock:
        raw = encode_events(trace.events)
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n = all_gather(torch.tensor([payload.numel()], dtype=torch.int64), group=group,
                   timeout_s=timeout_s)
    width = int(n.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    allp = all_gather(padded[None], dim=0, group=group, timeout_s=timeout_s)
    events: list[TraceEvent] = []
    for r in range(allp.shape[0]):
        events.extend(decode_events(allp[r, : int(n[r])].numpy().tobytes(),
                                    f"the trace of group rank {r}"))
    return events


def chrome_trace_events(events: list[TraceEvent]) -> dict[str, Any]:
    """One Chrome trace: pid = rank, tid = thread, times in microseconds from the first event."""
    if not events:
        return {"traceEvents": []}
    t0 = min(e.start_ns for e in events)
    out: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for e in sorted(events, key=lambda e: (e.rank, e.start_ns)):
        key = (e.rank, e.thread)
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == e.rank])
            out.append({"name": "thread_name", "ph": "M", "pid": e.rank, "tid": tids[key],
                        "args": {"name": e.thread}})
            out.append({"name": "process_name", "ph": "M", "pid": e.rank, "tid": 0,
                        "args": {"name": f"rank {e.rank}"}})
        out.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": e.rank, "tid": tids[key],
                    "ts": (e.start_ns - t0) / 1e3, "dur": (e.end_ns - e.start_ns) / 1e3})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_execution_trace(events: list[TraceEvent], path: str | os.PathLike[str]) -> None:
    """Write the merged trace to ``path`` (JSON)."""
    with open(path, "w") as fh:
        json.dump(chrome_trace_events(events), fh)


