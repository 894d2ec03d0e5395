"""Predict a training step from measured node costs, and compare with what was measured.

:func:`predict_step` prices the trainer's compiled pipeline with :class:`~overlap_runtime.
stepgraph.costs.MeasuredCosts` and simulates it, either with one device per rank (the list
scheduler of :mod:`overlap_runtime.graph.simulate`) or, when ranks outnumber the host's cores,
with :func:`~overlap_runtime.stepgraph.shared_cores.simulate_shared_cores`.
:func:`measured_step` reads the same figures from an execution trace.

Figures compared (:class:`StepFigures`): the pipeline step (first action to last, all ranks)
and the bubble ``1 - mean_r busy_r / step``, busy being compute spans minus the communication
waits inside them (:func:`overlap_runtime.pipeline.measured_bubble`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from overlap_runtime.graph.intervals import measured_bubble
from overlap_runtime.graph.simulate import simulate
from overlap_runtime.graph.task_graph import TaskGraph
from overlap_runtime.graph.tasks import Task

from .compose import compile_step
from .costs import MeasuredCosts
from .layer_program import LayerOp
from .pricing import priced_op
from .shared_cores import simulate_shared_cores


@dataclass(frozen=True)
class StepFigures:
    """Step time (s) and bubble ratio of one step, measured or predicted."""

    step_s: float
    bubble: float
    exposed_comm_s: float = 0.0


def measured_ops(costs: MeasuredCosts, ep: int = 2, per_rank: bool = False
                 ) -> Callable[[Task, int], list[tuple[None, LayerOp]]]:
    """The op source (``stepgraph.expand``) of measured costs: a pipeline action's chain is a
    runtime op (the uncovered time per program step, on ``comm:host``), then its busy work in
    the ``n + 1`` compute regions around the ``n`` all-to-alls it ran (``costs.a2a``, shares
    ``costs.regions``), each all-to-all a collective of the ``ep`` ranks on ``comm:ep``
    costing its measured mean span. ``per_rank``: the global rank's own costs
    (``costs.by_rank``) are used."""

    def ops(t: Task, rank: int) -> list[tuple[None, LayerOp]]:
        c = costs.by_rank.get(rank, costs) if per_rank else costs
        stage = int(t.meta["stage"])
        work = c.cost(stage, t.kind)
        paired = t.lane in ("fwd", "bwd")
        key = (stage, t.kind, paired)
        if key not in c.a2a:
            key = (stage, t.kind, not paired)
        n, a2a = c.a2a.get(key, (0, 0.0))
        share = c.regions.get(key) or [1.0 / (n + 1)] * (n + 1)
        out = [priced_op("compute", t.kind, work * share[0])]
        if c.gap_s > 0 and t.lane != "bwd":  # once per program step
            out.insert(0, priced_op("runtime", "runtime", c.gap_s, group="host",
                                     program_only=True))
        for j in range(n):
            out.append(priced_op(f"a2a{j}", "a2a", a2a, group="ep", group_size=ep))
            out.append(priced_op(f"compute{j + 1}", t.kind, work * share[j + 1]))
        return [(None, op) for op in out]

    return ops


def predict_step(config: Any, costs: MeasuredCosts, *, message_s: float, cores: int | None = None,
                 per_rank: bool = True) -> StepFigures:
    """Simulated step of ``config``'s pipeline: each F/B/I/W costs its measured busy time
    around its measured all-to-alls (:func:`measured_ops`), each SEND ``message_s``, in the
    simulation view of the step graph (:func:`~overlap_runtime.stepgraph.compose.compile_step`
    with ``async_p2p`` and ``hook_waits``).

    ``per_rank`` (default): every rank simulated with its own measured costs, the expert
    all-to-alls as collectives of their EP group (peers wait for each other); False: one
    representative rank per pipeline rank with the stage's costs. ``cores``: the ranks (all
    ``world`` of them) share that many cores
    (:func:`~overlap_runtime.stepgraph.shared_cores.simulate_shared_cores`)."""
    acc = config.train.accelerator
    world = acc.resolved_world_size
    inner = world // acc.pp
    g = compile_step(config, validate=False, representative=not per_rank,
                     ops=measured_ops(costs, acc.ep, per_rank),
                     message_cost=lambda t: message_s, async_p2p=True, hook_waits=True).graph
    if cores is not None and cores < world:
        weight = 1 if per_rank else inner
        res = simulate_shared_cores(g, cores, {r: weight for r in g.ranks})
    else:
        res = simulate(g)
    return StepFigures(res.makespan, res.bubble_ratio, res.exposed_comm)


def measured_step(events: Iterable[Any]) -> StepFigures:
    """Step time and bubble of one step's trace (every rank's events)."""
    events = list(events)
    start = min(e.start_ns for e in events)
    end = max(e.end_ns for e in events)
    return StepFigures((end - start) / 1e9, measured_bubble(events))
