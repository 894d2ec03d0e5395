"""All-to-all overlap: one definition for measured traces and simulated timelines.

Per rank ``r``::

    A_r      = union of the rank's all-to-all intervals     (paired_only: those of OVERLAP_B_F
                                                             steps only)
    W_r      = union of the rank's work intervals           (any thread or lane)
    hidden_r = |A_r  n  W_r|
    share    = sum_r hidden_r / sum_r |A_r|

An all-to-all that its rank waits for with nothing else running counts 0; one covered by the
other OVERLAP_B_F thread's compute, the shared expert, or anything else the rank computes
counts as hidden. :func:`a2a_overlap` is that definition on plain intervals; the readers only
say which intervals are all-to-alls and which are work:
:func:`simulated_a2a_overlap` here (a :class:`~.simulate.SimulationResult`: ``comm:ep`` tasks,
compute tasks), ``trainer.a2a_overlap.trace_a2a_overlap`` (an execution trace's spans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .intervals import minus, total_length, union
from .simulate import SimulationResult


@dataclass(frozen=True)
class A2AOverlap:
    """``in_flight``: ``sum_r |A_r|``; ``hidden``: ``sum_r |A_r n W_r|`` (both in the unit of
    the intervals given: trace nanoseconds, simulated seconds); ``count``: all-to-alls counted."""

    in_flight: float
    hidden: float
    count: int

    @property
    def share(self) -> float:
        """``hidden / in_flight`` (0 without all-to-alls)."""
        return self.hidden / self.in_flight if self.in_flight else 0.0

    def to_dict(self, seconds_per_unit: float) -> dict[str, float]:
        """``share``, ``a2a_s``, ``hidden_s`` and ``count`` (a report's plain-data form);
        ``seconds_per_unit``: 1e-9 for trace nanoseconds, 1.0 for simulated seconds."""
        return {"share": self.share, "a2a_s": self.in_flight * seconds_per_unit,
                "hidden_s": self.hidden * seconds_per_unit, "count": float(self.count)}


def a2a_overlap(a2a: Iterable[tuple[int, float, float, bool]],
                work: Iterable[tuple[int, float, float]], *,
                paired_only: bool = False) -> A2AOverlap:
    """The overlap of ``a2a`` intervals ``(rank, start, end, paired)`` with ``work`` intervals
    ``(rank, start, end)`` (module doc). ``paired_only``: count only the all-to-alls with
    ``paired`` set (those of OVERLAP_B_F steps). Empty intervals are not counted."""
    spans: dict[int, list[tuple[float, float]]] = {}
    count = 0
    for rank, start, end, paired in a2a:
        if end <= start or (paired_only and not paired):
            continue
        spans.setdefault(rank, []).append((start, end))
        count += 1
    busy: dict[int, list[tuple[float, float]]] = {}
    for rank, start, end in work:
        busy.setdefault(rank, []).append((start, end))
    in_flight = hidden = 0
    for rank, intervals in spans.items():
        flight = union(intervals)
        total = total_length(flight)
        in_flight += total
        hidden += total - total_length(minus(flight, union(busy.get(rank, []))))
    return A2AOverlap(in_flight, hidden, count)


def simulated_a2a_overlap(result: SimulationResult, *, lane: str = "comm:ep",
                          paired_only: bool = False) -> A2AOverlap:
    """:func:`a2a_overlap` of a simulated timeline: the all-to-alls are the tasks on ``lane``
    (paired: their action ran on the ``fwd``/``bwd`` lane of an OVERLAP_B_F step, task
    ``meta['action_lane']``), the work every compute task (no ``comm``) of the rank. In
    seconds."""
    a2a: list[tuple[int, float, float, bool]] = []
    work: list[tuple[int, float, float]] = []
    for t, s, e in zip(result.tasks, result.start, result.end):
        if t.comm is None:
            work.append((t.rank, s, e))
        elif t.lane == lane:
            a2a.append((t.rank, s, e, t.meta.get("action_lane") in ("fwd", "bwd")))
    return a2a_overlap(a2a, work, paired_only=paired_only)
