"""MoE op costs measured on a real step, as the cost model of a compiled step's pricing pass.

The graph is the compiled step's (``stepgraph.compile_step``: every MoE layer's router,
all-to-alls, experts, shared expert and combine wait, OVERLAP_B_F pairings in the
coordinator's launch order); this module only says what each op costs.
:func:`op_costs_from_trace` reads the mean costs from a run's execution trace (the serial
run's: no OVERLAP_B_F), :func:`moe_op_seconds` prices a compiled step's ops with them::

    moe.dispatch_counts / moe.dispatch    mean span of "<tag>.dispatch_counts fwd" / "... fwd"
    moe.combine                           mean combine span less the shared expert (the shared
                                          expert runs while the combine flies)
    moe.experts / moe.shared_expert       mean span of "<tag>.experts" / "<tag>.shared_expert"
    *.bwd all-to-alls                     mean span of "<tag>.combine bwd" / "dispatch bwd"
    moe.experts.bwd / shared_expert.bwd   twice the forward (not measured separately)
    any other compute op of an action     the action's rest, split over these ops by FLOPs

The rest of a ``(stage, kind)`` action is its mean span less the all-to-alls and receive waits
inside it (``comm`` spans) and less its MoE compute (above). Messages without a measured mean
(pipeline sends) cost ``message_s``; receives 0 (they finish with their send).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from overlap_runtime.graph.tasks import Task
from overlap_runtime.schedules.ir import parse_compute_action

if TYPE_CHECKING:
    from overlap_runtime.stepgraph.compose import StepGraph

_A2A = ("moe.dispatch_counts", "moe.dispatch", "moe.combine", "moe.combine.bwd",
        "moe.dispatch.bwd")


@dataclass(frozen=True)
class MoEOpCosts:
    """Mean seconds of the MoE ops (module doc) and ``rest[(stage, kind)]``: the seconds of
    one action of that stage and kind outside its MoE ops."""

    dispatch_counts: float = 0.0
    dispatch: float = 0.0
    combine: float = 0.0
    dispatch_bwd: float = 0.0
    combine_bwd: float = 0.0
    experts: float = 0.0
    shared_expert: float = 0.0
    rest: Mapping[tuple[int, str], float] = field(default_factory=dict)

    def op(self, name: str) -> float | None:
        """Seconds of MoE op ``name`` (``recompute.`` prefix ignored); None for another op."""
        n = name.removeprefix("recompute.")
        return {"moe.dispatch_counts": self.dispatch_counts, "moe.dispatch": self.dispatch,
                "moe.combine": self.combine, "moe.dispatch.bwd": self.dispatch_bwd,
                "moe.combine.bwd": self.combine_bwd, "moe.experts": self.experts,
                "moe.shared_expert": self.shared_expert, "moe.experts.bwd": 2 * self.experts,
                "moe.shared_expert.bwd": 2 * self.shared_expert}.get(n)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``rest`` keyed ``"<stage><kind>"``)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in (
            "dispatch_counts", "dispatch", "combine", "dispatch_bwd", "combine_bwd", "experts",
            "shared_expert")}
        out["rest"] = {f"{s}{k}": v for (s, k), v in sorted(self.rest.items())}
        return out


def op_costs_from_trace(events: Iterable[Any], layers_of: Mapping[int, int]) -> MoEOpCosts:
    """Mean op costs (seconds) from a serial run's trace events (module doc).

    ``layers_of[stage]``: MoE layers of each stage (for the rest of an action). Raises
    ValueError when the trace has no F or B action span.
    """
    evs = list(events)

    def mean(sel: list[Any]) -> float:
        return statistics.fmean([(e.end_ns - e.start_ns) / 1e9 for e in sel]) if sel else 0.0

    def a2a(suffix: str) -> float:
        return mean([e for e in evs if e.cat == "a2a" and e.name.endswith(suffix)])

    experts = mean([e for e in evs if e.cat == "moe_compute" and e.name.endswith(".experts")])
    shared = mean([e for e in evs if e.cat == "moe_compute"
                   and e.name.endswith(".shared_expert")])
    spans: dict[tuple[int, str], list[float]] = {}
    for s in evs:
        parsed = parse_compute_action(s.name) if s.cat == "compute" else None
        if parsed is None or parsed[1] not in ("F", "B"):
            continue
        direction = "fwd" if parsed[1] == "F" else "bwd"
        inner = [e for e in evs if e.rank == s.rank and e.thread == s.thread
                 and ((e.cat == "a2a" and e.name.endswith(direction)) or e.cat == "comm")
                 and s.start_ns <= e.start_ns and e.end_ns <= s.end_ns]
        spans.setdefault((parsed[0], parsed[1]), []).append(
            (s.end_ns - s.start_ns - sum(e.end_ns - e.start_ns for e in inner)) / 1e9)
    if not spans:
        raise ValueError("op_costs_from_trace: the trace has no F or B action span (compute "
                         "events named like '0F1')")
    rest = {}
    for (stage, kind), per in spans.items():
        moe = layers_of.get(stage, 0) * (experts if kind == "F" else 2 * (experts + shared))
        rest[(stage, kind)] = max(0.0, statistics.fmean(per) - moe)
    return MoEOpCosts(
        dispatch_counts=a2a(".dispatch_counts fwd"), dispatch=a2a(".dispatch fwd"),
        combine=max(0.0, a2a(".combine fwd") - shared), dispatch_bwd=a2a(".dispatch bwd"),
        combine_bwd=a2a(".combine bwd"), experts=experts, shared_expert=shared, rest=rest)


def moe_op_seconds(costs: MoEOpCosts, step: "StepGraph", *, message_s: float = 0.0
                   ) -> Callable[[Task], float]:
    """The cost model of ``step``'s ops (module doc). Raises ValueError (when called) for an
    action whose ``(stage, kind)`` has no measured rest."""
    g = step.graph
    flops: dict[tuple[int, str], float] = {}  # (rank, action) -> FLOPs of its other ops
    count: dict[tuple[int, str], int] = {}
    for rank, acts in step.actions.items():
        for action, ids in acts.items():
            others = [g.task(i) for i in ids if g.task(i).comm is None
                      and costs.op(g.task(i).meta["op"].name) is None]
            flops[(rank, action)] = sum(float(t.meta.get("flops") or 0.0) for t in others)
            count[(rank, action)] = len(others)

    def seconds(t: Task) -> float:
        op = t.meta.get("op")
        if t.comm is not None and t.comm.op == "recv":
            return 0.0
        if op is None:  # a pipeline send
            return message_s
        known = costs.op(op.name)
        if known is not None:
            return known
        if t.comm is not None:
            raise ValueError(f"moe_op_seconds: no measured cost for message {t.label!r}")
        action = t.meta["action"]
        parsed = parse_compute_action(action)
        key = (parsed[0], parsed[1]) if parsed is not None else None
        if key not in costs.rest:
            raise ValueError(f"moe_op_seconds: no measured rest for action {action!r} (stage, "
                             f"kind) = {key}; measured: {sorted(costs.rest)}")
        total = flops[(t.rank, action)]
        share = (float(t.meta.get("flops") or 0.0) / total if total > 0
                 else 1.0 / count[(t.rank, action)])
        return costs.rest[key] * share

    return seconds
