"""Measured expert all-to-all overlap: how much of the time an all-to-all was in flight some
thread of the rank spent computing, from one step's execution trace (the definition:
``graph.comm_overlap``; this module says which spans are all-to-alls and which are work).

Input: the :class:`~overlap_runtime.pipeline.ExecutionTrace` events of one rank and step, as the
runtime records them: ``a2a`` spans of the MoE dispatcher (launch to completed wait, forward
and backward, dispatch and combine), ``hook`` spans (waits in the HookCoordinator's sync hooks),
``comm`` spans (pipeline point-to-point waits), ``moe_compute`` spans (routed experts, the shared
expert, also inside a combine window) and ``compute`` spans (F/B/I/W actions, and the deferred
expert W tasks that run inside an all-to-all window, named ``<tag>.W x<n> in <where>``).

::

    A        = union of the a2a spans (any thread; paired_only: those inside an OVERLAP_B_F
               step's ``compound`` span)
    idle_t   = thread t's a2a, hook and comm spans            (t waits, it does not compute)
    work_t   = (compute_t - idle_t)  U  moe_compute_t  U  W-in-window_t
    hidden   = |A  n  union_t work_t|                         (per rank, summed over ranks)
    overlap  = hidden / |A|

So a synchronous all-to-all with nothing else running gives 0 (its own F/B span is not work
while it waits); the shared expert running between ``combine_start`` and ``combine_wait``, the
other OVERLAP_B_F thread's compute, and deferred W tasks flushed in the window count as
hidden time. Wall-clock spans on the host: on an accelerator a kernel launched before the
window and still running is not seen (the number is a lower bound of device-side overlap).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from overlap_runtime.graph.comm_overlap import A2AOverlap, a2a_overlap
from overlap_runtime.graph.intervals import minus, overlap, union
from overlap_runtime.pipeline.exec_trace import TraceEvent

_IDLE = frozenset({"a2a", "hook", "comm"})


def trace_a2a_overlap(events: Iterable[TraceEvent], *, paired_only: bool = False) -> A2AOverlap:
    """The all-to-all overlap of trace ``events`` of one or more ranks (module doc), in
    nanoseconds. ``paired_only``: only the all-to-alls that ran inside OVERLAP_B_F steps."""
    per_thread: dict[tuple[int, str], dict[str, list[tuple[int, int]]]] = defaultdict(
        lambda: defaultdict(list))
    a2a: list[TraceEvent] = []
    windows: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        span = (e.start_ns, e.end_ns)
        where = per_thread[(e.rank, e.thread)]
        if e.cat == "a2a":
            a2a.append(e)
        if e.cat == "compound":
            windows[e.rank].append(span)
        elif e.cat in _IDLE:
            where["idle"].append(span)
        elif e.cat == "moe_compute" or (e.cat == "compute" and ".W x" in e.name):
            where["window"].append(span)
        elif e.cat == "compute":
            where["compute"].append(span)
    work: list[tuple[int, int, int]] = []
    for (rank, _), spans in per_thread.items():
        busy = minus(union(spans["compute"]), union(spans["idle"]))
        work.extend((rank, a, b) for a, b in busy + spans["window"])
    compound = {r: union(v) for r, v in windows.items()}
    flagged = [(e.rank, e.start_ns, e.end_ns,
                e.end_ns > e.start_ns and overlap(e.start_ns, e.end_ns, compound.get(e.rank, []))
                >= e.end_ns - e.start_ns) for e in a2a]
    return a2a_overlap(flagged, work, paired_only=paired_only)


def a2a_overlap_ns(events: Iterable[TraceEvent]) -> tuple[int, int]:
    """``(in_flight_ns, hidden_ns)`` of one rank's events, every all-to-all counted (module
    doc); ``(0, 0)`` without all-to-alls."""
    m = trace_a2a_overlap(events)
    return int(m.in_flight), int(m.hidden)
