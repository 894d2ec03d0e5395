"""Measured expert all-to-all overlap: how much of the time an all-to-all was in flight some
thread of the rank spent computing, from one step's execution trace.

Input: the :class:`~overlap_runtime.pipeline.ExecutionTrace` events of one rank and step, as the
runtime records them: ``a2a`` spans of the MoE dispatcher (launch to completed wait, forward
and backward, dispatch and combine), ``hook`` spans (waits in the HookCoordinator's sync hooks),
``comm`` spans (pipeline point-to-point waits), ``moe_compute`` spans (routed experts, the shared
expert, also inside a combine window) and ``compute`` spans (F/B/I/W actions, and the deferred
expert W tasks that run inside an all-to-all window, named ``<tag>.W x<n> in <where>``).

::

    A        = union of the a2a spans (any thread)
    idle_t   = thread t's a2a, hook and comm spans            (t waits, it does not compute)
    work_t   = (compute_t - idle_t)  U  moe_compute_t  U  W-in-window_t
    hidden   = |A  n  union_t work_t|
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

from overlap_runtime.graph.intervals import minus, total_length, union
from overlap_runtime.pipeline.exec_trace import TraceEvent

__all__ = ["a2a_overlap_ns"]

_IDLE = frozenset({"a2a", "hook", "comm"})


def a2a_overlap_ns(events: Iterable[TraceEvent]) -> tuple[int, int]:
    """``(in_flight_ns, hidden_ns)`` of one rank's events (module doc); ``(0, 0)`` without
    all-to-alls."""
    per_thread: dict[str, dict[str, list[tuple[int, int]]]] = defaultdict(
        lambda: defaultdict(list))
    a2a: list[tuple[int, int]] = []
    for e in events:
        span = (e.start_ns, e.end_ns)
        if e.cat == "a2a":
            a2a.append(span)
        if e.cat in _IDLE:
            per_thread[e.thread]["idle"].append(span)
        elif e.cat == "moe_compute" or (e.cat == "compute" and ".W x" in e.name):
            per_thread[e.thread]["window"].append(span)
        elif e.cat == "compute":
            per_thread[e.thread]["compute"].append(span)
    in_flight = union(a2a)
    if not in_flight:
        return 0, 0
    work: list[tuple[int, int]] = []
    for spans in per_thread.values():
        busy = minus(union(spans["compute"]), union(spans["idle"]))
        work.extend(busy)
        work.extend(spans["window"])
    exposed = minus(in_flight, union(work))
    total = total_length(in_flight)
    return total, total - total_length(exposed)
