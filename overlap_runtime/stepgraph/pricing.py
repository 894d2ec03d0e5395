"""Price a compiled step: each op's seconds from a cost model, then the simulated step.

:func:`price_step` is a pass over the graph of :func:`~.compose.compile_step`: every task gets
the cost ``op_seconds(task)`` returns (seconds; a compute op on its rank's device, a send or
a collective on its communication lane; a receive finishes with its send, so its own price
is not used); every task keeps the expansion's ``meta['action_lane']``, the lane of the
pipeline action it belongs to (``fwd`` / ``bwd`` inside an OVERLAP_B_F step), so the all-to-all
overlap of :func:`overlap_runtime.graph.comm_overlap.simulated_a2a_overlap` can tell paired
all-to-alls from the rest. :func:`predict_priced` simulates the priced graph:

    step_s    the simulated step (list scheduler, ``graph.simulate``)
    serial_s  max over ranks of the rank's summed op costs (receives excluded): the step with
              nothing overlapped on any rank and no waiting

The cost model is the caller's: a function of the op task (``task.meta['op']`` is its
:class:`~.layer_program.LayerOp`, ``task.meta['action']`` its action, ``task.rank`` the global
rank). A cost must be a finite number >= 0 (ValueError naming the task otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from overlap_runtime.graph.simulate import SimulationResult, simulate
from overlap_runtime.graph.task_graph import TaskGraph
from overlap_runtime.graph.tasks import Task

from .layer_program import LayerOp

if TYPE_CHECKING:
    from .compose import StepGraph

#: The cost model of a pricing pass: seconds of one op task of a compiled step.
OpSeconds = Callable[[Task], float]


def priced_op(name: str, kind: str, cost: float, group: str | None = None,
              group_size: int = 1, join: str | None = None,
              program_only: bool = False) -> LayerOp:
    """A priced :class:`~.layer_program.LayerOp` built directly (no layer program behind it),
    for an op source (``stepgraph.expand``): ``name`` (shown in traces), ``kind`` (its task's
    kind, the cost-model key), ``cost`` (seconds), for communication the ``group`` name and
    ``group_size`` (a collective). ``join``: a non-blocking message (the MoE combine): it forks
    from the op before it and the next op named ``join`` waits for it; None: blocking.
    ``program_only``: a leading op that only the program order waits for (the runtime's own
    work between two program steps): the task's inputs go to the op after it, so it overlaps
    the wait for them."""
    return LayerOp(name, "compute" if group is None else "collective", group,  # type: ignore[arg-type]
                   cost=float(cost), task_kind=kind, group_size=group_size, join=join,
                   program_only=program_only)


@dataclass(frozen=True)
class StepPrediction:
    """A priced step simulated: ``step_s`` and ``serial_s`` (seconds, module doc), the priced
    ``graph`` and the simulator's ``result`` (timeline, bubble, exposed communication)."""

    step_s: float
    serial_s: float
    graph: TaskGraph
    result: SimulationResult


def price_step(step: "StepGraph", op_seconds: OpSeconds) -> TaskGraph:
    """A copy of ``step.graph`` with every task's cost from ``op_seconds`` (module doc).

    Raises ValueError naming the task whose cost is negative or not finite.
    """
    g = step.graph
    tasks = []
    for t in g.tasks():
        cost = float(op_seconds(t))
        if not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"price_step: task {t.label or t.id!r} costs {cost} s; a cost "
                             f"must be a finite number >= 0")
        tasks.append(t._replace(cost=cost))
    out = TaskGraph(g.name)
    out.add_tasks(tasks)
    for kind in ("program", "data", "match"):
        out.add_edges([(u, v) for u, v, _ in g.edges(kind)], kind)
    out.programs = dict(g.programs)
    return out


def _serial_seconds(graph: TaskGraph) -> float:
    """Max over ranks of the rank's summed task costs, receives excluded (module doc)."""
    per: dict[int, float] = {}
    for t in graph.tasks():
        if t.comm is not None and t.comm.op == "recv":
            continue
        per[t.rank] = per.get(t.rank, 0.0) + float(t.cost or 0.0)
    return max(per.values(), default=0.0)


def predict_priced(step: "StepGraph", op_seconds: OpSeconds) -> StepPrediction:
    """Price ``step`` (:func:`price_step`) and simulate it (module doc)."""
    graph = price_step(step, op_seconds)
    result = simulate(graph)
    return StepPrediction(result.makespan, _serial_seconds(graph), graph, result)


def by_op_name(seconds: Mapping[str, float], *, default: float | None = None) -> OpSeconds:
    """The simplest cost model: seconds by op name (``task.meta['op'].name``); receives cost
    0, a task without an op (a pipeline message) ``default``. An op missing from ``seconds``
    costs ``default``, or raises ValueError naming it when ``default`` is None."""

    def price(t: Task) -> float:
        if t.comm is not None and t.comm.op == "recv":
            return 0.0
        op = t.meta.get("op")
        if op is not None and op.name in seconds:
            return float(seconds[op.name])
        if default is None:
            raise ValueError(f"by_op_name: no cost for {t.label or t.id!r} (op "
                             f"{getattr(op, 'name', None)!r}) and no default")
        return default

    return price
