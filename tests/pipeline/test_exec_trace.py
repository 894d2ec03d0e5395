"""ExecutionTrace: events cross ranks as checked JSON (never pickle) and the measured bubble
uses the one interval arithmetic of graph/intervals.py."""

from __future__ import annotations

import threading

import pytest

from overlap_runtime.pipeline.exec_trace import (ExecutionTrace, TraceEvent, decode_events,
                                                 encode_events, gather_traces, measured_bubble,
                                                 busy_intervals)
from overlap_runtime.testing import run_ranks


def _rank_events(rank: int) -> list[TraceEvent]:
    """Different counts per rank (the gather pads to the longest) and awkward text."""
    out = [TraceEvent(rank, "MainThread", f"{rank}F{m}", "compute", 10 * m + rank,
                      10 * m + rank + 7) for m in range(3 + 2 * rank)]
    out.append(TraceEvent(rank, 'bwd "thread" ü', "wait 0RECV_B1 \\ ✓", "comm", 2**62 + rank,
                          2**62 + rank + 1))
    return out


def _gather(rank: int, world: int) -> list[tuple]:
    trace = ExecutionTrace(rank=rank, events=_rank_events(rank))
    return [tuple(vars(e).values()) for e in gather_traces(trace, timeout_s=30)]


def test_gathered_trace_round_trips_on_two_ranks() -> None:
    res = run_ranks(_gather, 2, timeout_s=60)
    expected = [tuple(vars(e).values()) for r in range(2) for e in _rank_events(r)]
    assert res[0] == expected and res[1] == expected, res


def test_encode_decode_round_trip_and_empty() -> None:
    trace = ExecutionTrace(rank=3)
    assert decode_events(encode_events(trace.events)) == []
    with trace.span("3F0", "compute"):
        pass
    worker = threading.Thread(target=trace.record, args=("3W0", "compute", 5, 9), name="bwd")
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert decode_events(encode_events(trace.events)) == trace.events
    assert {e.thread for e in trace.events} == {threading.current_thread().name, "bwd"}


@pytest.mark.parametrize("raw, needle", [
    (b"\x80\x04K\x01.", "not a JSON list"),                     # a pickle stream is refused
    (b'{"rank": 0}', "expected a JSON list of events"),
    (b'[[0, "t", "0F0", "compute", 1]]', "event 0"),            # a field missing
    (b'[[0, "t", "0F0", "compute", 1, 2.5]]', "end_ns: int"),   # wrong type
    (b'[[true, "t", "0F0", "compute", 1, 2]]', "event 0"),      # a bool is not a rank
])
def test_malformed_peer_trace_is_a_named_error(raw: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match="the trace of group rank 1") as info:
        decode_events(raw, "the trace of group rank 1")
    assert needle in str(info.value), str(info.value)


def test_measured_bubble_counts_overlapping_compute_once() -> None:
    """Rank 0 computes [0, 6) on two threads that overlap ([0, 4) and [2, 6)); rank 1 [5, 10).
    Makespan 10, busy 6 and 5: bubble = 1 - 5.5 / 10. A wait on a thread of its own is not
    busy time and takes nothing from the others."""
    events = [TraceEvent(0, "a", "0F0", "compute", 0, 4), TraceEvent(0, "b", "0B0", "compute", 2, 6),
              TraceEvent(0, "c", "wait", "comm", 0, 10), TraceEvent(1, "a", "1F0", "compute", 5, 10)]
    assert measured_bubble(events) == pytest.approx(0.45)
    assert measured_bubble([]) == 0.0


def test_measured_bubble_waits_inside_an_action_are_idle() -> None:
    """An F that waits for its input inside its own span (``wait_recv`` in ``forward``), an MoE
    all-to-all inside a B: rank 0's F [0, 10) waits [0, 6), its B [10, 20) waits [12, 14) on
    the same thread while thread b computes [12, 13); rank 1 computes [0, 20). Busy 4 + 8 + 1
    and 20: bubble = 1 - 16.5 / 20 (counting the waits as busy gave 0)."""
    events = [TraceEvent(0, "a", "1F0", "compute", 0, 10),
              TraceEvent(0, "a", "wait 1RECV_F0", "comm", 0, 6),
              TraceEvent(0, "a", "1B0", "compute", 10, 20),
              TraceEvent(0, "a", "S1.L0.combine bwd", "a2a", 12, 14),
              TraceEvent(0, "b", "1F1", "compute", 12, 13),
              TraceEvent(1, "a", "0F0", "compute", 0, 20)]
    assert busy_intervals(events, 0) == [(6, 13), (14, 20)]
    assert measured_bubble(events) == pytest.approx(1 - 16.5 / 20)
