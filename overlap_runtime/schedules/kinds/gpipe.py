"""GPipe (Huang et al. 2019): every rank runs all its forwards, then all its backwards.

Kind ``gpipe``: one stage per rank, no 1F1B steady state (so no ``overlap_b_f``). Diagram,
pp=2, m=3::

    rank 0  F0 F1 F2 B0 B1 B2
    rank 1  F0 F1 F2 B0 B1 B2

Idle time per rank with free communication: ``(pp - 1)(F + B)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir import Action, ActionKind, Schedule
from ..kind import ScheduleKind, one_f_one_b_bubble, stages_of_rank

if TYPE_CHECKING:
    from ...graph.simulate import CostModel
    from ..spec import ScheduleSpec

_F, _B = ActionKind.F, ActionKind.B


def build_gpipe(spec: "ScheduleSpec") -> Schedule:
    """All forwards, then all backwards, on every rank."""
    m = spec.num_microbatches
    out: Schedule = {}
    for rank in range(spec.pp_size):
        stage = stages_of_rank(spec, rank)[0]
        out[rank] = [Action(stage, _F, i) for i in range(m)] + [
            Action(stage, _B, i) for i in range(m)
        ]
    return out


def _idle(pp: int, costs: "CostModel") -> float:
    b = costs.I + costs.W
    return (pp - 1) * (costs.F + b)


KIND = ScheduleKind(
    "gpipe", build_gpipe, max_virtual=1, overlap_b_f=False, idle_per_rank=_idle,
    published="GPipe (Huang et al. 2019)", published_bubble=one_f_one_b_bubble, docs_section="7",
    description="all forwards, then all backwards (Huang et al. 2019)",
)
