"""1F1B / PipeDream-Flush (Narayanan et al. 2021): ``pp-1-rank`` warm-up forwards, then
alternate F and B.

Kind ``1f1b``: one stage per rank. Diagram, pp=4, m=6 (rank 3 holds the last stage)::

    rank 0  F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5      warm-up 3 = pp-1-rank
    rank 1  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5      warm-up 2
    rank 2  F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5      warm-up 1
    rank 3  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5      warm-up 0

With ``overlap_b_f`` every steady-state ``B_i`` and the forward right after it become one
``(B_i;F_j)OVERLAP_B_F`` step: rank 3 above becomes ``F0 (B0;F1) (B1;F2) ... (B4;F5) B5``.
Idle time per rank with free communication: ``(pp - 1)(F + B)``, as GPipe's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir import Action, ActionKind, Schedule
from ..kind import ScheduleKind, one_f_one_b_bubble, interleave_1f1b, stages_of_rank

if TYPE_CHECKING:
    from ...graph.simulate import CostModel
    from ..spec import ScheduleSpec

_F, _B = ActionKind.F, ActionKind.B


def build_1f1b(spec: "ScheduleSpec") -> Schedule:
    """``pp-1-rank`` warm-up forwards, then F/B pairs, then the remaining backwards."""
    m, p = spec.num_microbatches, spec.pp_size
    out: Schedule = {}
    for rank in range(p):
        stage = stages_of_rank(spec, rank)[0]
        warmup = min(p - 1 - rank, m)
        fwd = [Action(stage, _F, i) for i in range(m)]
        bwd = [Action(stage, _B, i) for i in range(m)]
        out[rank] = interleave_1f1b(fwd, bwd, warmup)
    return out


def _idle(pp: int, costs: "CostModel") -> float:
    b = costs.I + costs.W
    return (pp - 1) * (costs.F + b)


KIND = ScheduleKind(
    "1f1b", build_1f1b, max_virtual=1, idle_per_rank=_idle,
    published="1F1B (Narayanan et al. 2021)", published_bubble=one_f_one_b_bubble, docs_section="7",
    description="one forward one backward (PipeDream-Flush; Narayanan et al. 2021)",
)
