"""Interval arithmetic on half-open intervals ``[start, end)`` of one timeline.

The one home for the measures the simulator and the trace readers take: busy time (the length
of a union), exposed communication (a union minus another) and hidden time (an interval's
overlap with a union). Works on ints (nanosecond trace stamps) and floats (simulated seconds)
alike and returns the type it was given.

A *union* here is what :func:`union` returns: sorted, pairwise disjoint, non-empty intervals
(touching ones merged). Functions that take a union check it and raise ``ValueError`` naming
the offending pair, so an unsorted list fails instead of giving a wrong measure.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Sequence, TypeVar

T = TypeVar("T", int, float)


def union(intervals: Iterable[tuple[T, T]]) -> list[tuple[T, T]]:
    """The union of any intervals as sorted, disjoint, non-empty intervals.

    Empty intervals (``start == end``) vanish; touching ones (``a.end == b.start``) merge. An
    interval with ``end < start`` raises ValueError.
    """
    out: list[tuple[T, T]] = []
    for a, b in sorted(intervals):
        if b < a:
            raise ValueError(f"interval ({a}, {b}) ends before it starts")
        if b == a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _check_union(name: str, iv: Sequence[tuple[T, T]]) -> None:
    prev_end = None
    for a, b in iv:
        if not a < b:
            raise ValueError(f"{name}: interval ({a}, {b}) is empty or reversed; pass union(...)")
        if prev_end is not None and a <= prev_end:
            raise ValueError(f"{name}: interval ({a}, {b}) starts at or before the previous end "
                             f"{prev_end}; a union is sorted and disjoint (pass union(...))")
        prev_end = b


def total_length(u: Sequence[tuple[T, T]]) -> T:
    """Sum of the lengths of a union (0 for an empty one)."""
    _check_union("total_length", u)
    return sum((b - a for a, b in u), start=0)  # type: ignore[return-value]


def measure(intervals: Iterable[tuple[T, T]]) -> T:
    """Length of the union of any intervals (overlaps counted once)."""
    return total_length(union(intervals))


def overlap(start: T, end: T, u: Sequence[tuple[T, T]]) -> T:
    """Length of ``[start, end) ∩ u`` for a union ``u`` (0 when ``end <= start``)."""
    _check_union("overlap", u)
    total: T = 0  # type: ignore[assignment]
    if end <= start:
        return total
    i = bisect.bisect_right(u, (start, start))
    if i > 0 and u[i - 1][1] > start:  # the interval that starts before ``start`` may reach in
        i -= 1
    while i < len(u) and u[i][0] < end:
        a, b = u[i]
        total += min(end, b) - max(start, a)
        i += 1
    return total


def minus(a: Sequence[tuple[T, T]], b: Sequence[tuple[T, T]]) -> list[tuple[T, T]]:
    """The union ``a`` minus the union ``b``, as a union."""
    _check_union("minus (a)", a)
    _check_union("minus (b)", b)
    out: list[tuple[T, T]] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:  # b is sorted: intervals ending before s never matter
            j += 1
        cur = s
        k = j
        while k < len(b) and b[k][0] < e:
            bs, be = b[k]
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def measure_minus(a: Sequence[tuple[T, T]], b: Sequence[tuple[T, T]]) -> T:
    """Length of the union ``a`` minus the union ``b``."""
    return total_length(minus(a, b))


#: event categories during which a thread waits (a receive, an all-to-all, a hook hand-over)
WAIT_CATEGORIES = ("comm", "a2a", "hook")


def busy_intervals(events: "list[Any]", rank: int) -> list[tuple[int, int]]:
    """When ``rank``'s device computes: per thread, its ``compute`` spans minus its own waits
    (:data:`WAIT_CATEGORIES`), then the union over threads.

    An F waits for its input inside its own span (``ActionContext.forward`` calls
    ``wait_recv``), and an MoE layer waits for its all-to-alls inside the F or B span; that time
    is idle, not compute. Counting it as busy made a 1F1B pp=4 step measure a bubble of 0.089
    where the trace's own idle time gives ~0.3 (docs/benchmarks.md, "Predicted step times").
    """
    threads: dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
    for e in events:
        if e.rank != rank:
            continue
        comp, wait = threads.setdefault(e.thread, ([], []))
        if e.cat == "compute":
            comp.append((e.start_ns, e.end_ns))
        elif e.cat in WAIT_CATEGORIES:
            wait.append((e.start_ns, e.end_ns))
    busy: list[tuple[int, int]] = []
    for comp, wait in threads.values():
        busy.extend(minus(union(comp), union(wait)))
    return union(busy)


def measured_bubble(events: "list[Any]") -> float:
    """``1 - mean_r busy_r / makespan``: busy is :func:`busy_intervals` (compute of any thread
    less the waits inside it), the makespan spans every rank's first to last event."""
    if not events:
        return 0.0
    start = min(e.start_ns for e in events)
    end = max(e.end_ns for e in events)
    span = max(1, end - start)
    ranks = sorted({e.rank for e in events})
    busy = [total_length(busy_intervals(events, r)) for r in ranks]
    return 1.0 - (sum(busy) / len(ranks)) / span
