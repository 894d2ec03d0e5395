"""Published bubble formulas and the simulations that check them (docs/schedules.md, section
"Zero bubble and DualPipeV").

``analytic_idle(kind, pp, costs)`` is the idle time per rank of one step, with free
communication and enough microbatches (``m >= pp``; ``m >= 2 pp`` for DualPipeV). Each formula
lives in its kind's file (``ScheduleKind.idle_per_rank``):

- ``1f1b`` / ``gpipe``: ``(pp - 1)(F + B)``, B = I + W (Narayanan et al. 2021);
- ``zero_bubble`` (ZB-H1): ``(pp - 1)(F + I - W)`` = ``(pp - 1)(F + B - 2W)`` (Qi et al. 2023,
  section 3; the ZB1P row of the DualPipe README);
- ``dualpipev``: ``(pp - 1)(F&B + B - 3W)`` with ``F&B = F + B`` (DeepSeek-V3 report, table 2,
  ``PP/2 - 1`` with PP = 2 pp stages; in the simulator the two threads of an overlapped step
  share one device, so an overlapped pair costs F + B).

:func:`simulate_compute_only` simulates the compute schedule with data edges across ranks
(instantaneous communication that never blocks: what the runtime gets with ``overlap_p2p`` and
early-posted receives); ``overlapped_as_unit=True`` adds :func:`couple_overlapped_steps`, the
DualPipe model of an overlapped step (it starts when both sub-actions' inputs are here).
"""

from __future__ import annotations

from typing import Any

from ..graph.simulate import CostModel, SimulationResult, simulate
from ..graph.task_graph import TaskGraph
from .build import build_schedule
from .compile import compile_schedule
from .ir import Schedule
from .registry import get_schedule_kind, schedule_kinds
from .spec import ScheduleSpec


def analytic_idle(kind: str, pp: int, costs: CostModel) -> float:
    """Published idle time per rank for one step (see the module doc)."""
    formula = get_schedule_kind(kind).idle_per_rank
    if formula is None:
        known = sorted(k for k, info in schedule_kinds().items() if info.idle_per_rank is not None)
        raise ValueError(f"no published bubble formula for kind {kind!r}; known: "
                         f"{', '.join(known)}")
    return formula(pp, costs)


def analytic_bubble_ratio(spec: ScheduleSpec, costs: CostModel) -> float:
    """``idle / (work + idle)`` per rank, work = ``v m (F + I + W)``."""
    work = spec.virtual_stages * spec.num_microbatches * (costs.F + costs.I + costs.W)
    idle = analytic_idle(spec.kind, spec.pp_size, costs)
    return idle / (work + idle)


def couple_overlapped_steps(graph: TaskGraph, schedule: Schedule) -> list[tuple[str, str]]:
    """Make each compound step's sub-actions wait for each other's inputs (the step runs as one
    unit, as DualPipe's ``overlapped_forward_backward`` does); returns the edges added."""
    preds: dict[Any, list[Any]] = {}
    for u, v, _kind in graph.edges("data"):
        preds.setdefault(v, []).append(u)
    added: list[tuple[str, str]] = []
    for acts in schedule.values():
        for a in acts:
            if a is None or not a.is_compound:
                continue
            ids = [str(x) for x in a.sub_actions]
            for mine in ids:
                for other in ids:
                    if other == mine:
                        continue
                    for u in preds.get(other, []):
                        if u not in ids and (u, mine) not in added:
                            added.append((u, mine))
    graph.add_edges(added, "data")
    return added


def simulate_compute_only(spec: ScheduleSpec, costs: CostModel, *,
                          overlapped_as_unit: bool = False,
                          return_graph: bool = False) -> Any:
    """Simulate ``spec``'s compute schedule with free, non-blocking communication.

    Returns the :class:`SimulationResult`, or ``(graph, schedule)`` with ``return_graph``.
    """
    schedule = build_schedule(spec)
    graph = compile_schedule(schedule, stage_to_rank=spec.stage_mapping(),
                             num_stages=spec.num_stages,
                             name=f"{spec.kind} pp={spec.pp_size} m={spec.num_microbatches} "
                                  "compute only")
    if return_graph:
        return graph, schedule
    if overlapped_as_unit:
        couple_overlapped_steps(graph, schedule)
    result: SimulationResult = simulate(graph, costs)
    return result
