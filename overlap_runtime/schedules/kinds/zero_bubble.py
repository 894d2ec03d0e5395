"""Zero-bubble pipeline, schedule ZB-H1 (Qi et al. 2023, *Zero Bubble Pipeline Parallelism*).

Kind ``zero_bubble``: one stage per rank, the backward split into ``I`` (input gradient, on the
critical path: it feeds the previous stage) and ``W`` (weight gradient, needed by nobody until
the optimizer step). 1F1B's order with ``I`` in place of ``B``, except that rank ``r`` holds
back its ``W`` passes: it keeps up to ``r`` of them pending and runs the oldest one right after
each ``I`` once more than ``r`` are pending; the last ``r`` run at the end. Later ranks thus
send their input gradients upstream one ``W`` earlier per step of the cool-down, and their
``W`` fill the tail that 1F1B leaves idle. Diagram, pp=4, m=6 (``F``/``I``/``W`` + microbatch)::

    rank 0  F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5      held back: 0
    rank 1  F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5      held back: 1
    rank 2  F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5      held back: 2
    rank 3  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5      held back: 3

Bubble (free communication, m >= pp, costs t_F, t_I, t_W): ``(pp - 1)(t_F + t_I - t_W)`` per
rank, against 1F1B's ``(pp - 1)(t_F + t_I + t_W)``: with equal costs a third (docs/schedules.md,
"Zero bubble and DualPipeV"). The per-rank order equals torch's ``ScheduleInterleavedZeroBubble``
with one stage per rank (tested); the peak number of microbatches in flight per rank is that of
1F1B (``pp - r``), so ZB-H1 keeps 1F1B's activation memory apart from what pending ``W`` hold.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..ir import Action, ActionKind, Schedule
from ..kind import PublishedBubble, ScheduleKind, stages_of_rank

if TYPE_CHECKING:
    from ...graph.simulate import CostModel
    from ..spec import ScheduleSpec

_F, _I, _W = ActionKind.F, ActionKind.I, ActionKind.W


def _check(spec: "ScheduleSpec") -> None:
    if spec.overlap_b_f:
        raise ValueError(
            "overlap_b_f=True does not apply to kind='zero_bubble': OVERLAP_B_F pairs a full "
            "backward B with a forward, and zero_bubble splits every backward into I and W "
            "(rule: overlap_b_f only for kinds with full backwards)"
        )


def build_zero_bubble(spec: "ScheduleSpec") -> Schedule:
    """ZB-H1: ``pp-1-rank`` warm-up forwards, F/I pairs, rank r holds back up to r ``W`` passes.

    ``split_backward`` makes no difference (every backward is already split).
    """
    m, p = spec.num_microbatches, spec.pp_size
    out: Schedule = {}
    for rank in range(p):
        stage = stages_of_rank(spec, rank)[0]
        warmup = min(p - 1 - rank, m)
        order: list[Action | None] = [Action(stage, _F, i) for i in range(warmup)]
        held: deque[Action] = deque()
        for i in range(m):
            if warmup + i < m:
                order.append(Action(stage, _F, warmup + i))
            order.append(Action(stage, _I, i))
            held.append(Action(stage, _W, i))
            if len(held) > rank:
                order.append(held.popleft())
        order.extend(held)
        out[rank] = order
    return out


def _idle(pp: int, costs: "CostModel") -> float:
    """``(pp - 1)(F + I - W)`` = ``(pp - 1)(F + B - 2 W)`` with B = I + W."""
    b = costs.I + costs.W
    return (pp - 1) * (costs.F + b - 2 * costs.W)


def _published(spec: "ScheduleSpec", costs: "CostModel",
               compute_only: "Callable[[bool], float]") -> PublishedBubble:
    """ZB-H1's idle ``(p - 1)(F + I - W)`` per rank over ``work + idle`` (Qi et al. 2023,
    section 3.1; docs/schedules.md section 9)."""
    p, m, c = spec.pp_size, spec.num_microbatches, costs
    idle = _idle(p, c)
    why = []
    if not c.W == c.F <= c.I:
        why.append(f"ZB-H1's fixed order reaches the formula only for W = F <= I (here "
                   f"F={c.F:g} I={c.I:g} W={c.W:g}); Qi et al. search other ratios")
    if m < p:
        why.append(f"m={m} < p={p}: the formula assumes m >= p")
    work = spec.virtual_stages * m * (c.F + c.I + c.W)
    return PublishedBubble(idle / (work + idle), f"idle (p - 1)(F + I - W) = {idle:g} per rank",
                           tuple(why))


KIND = ScheduleKind(
    "zero_bubble", build_zero_bubble, max_virtual=1, overlap_b_f=False, split_backward=True,
    check=_check, idle_per_rank=_idle, published="ZB-H1 (Qi et al. 2023, section 3.1)",
    published_bubble=_published, docs_section="9",
    description="ZB-H1: 1F1B with I/W split, W held back to fill the tail (Qi et al. 2023)",
)
