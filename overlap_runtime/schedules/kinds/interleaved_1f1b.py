"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2), depth first.

Kind ``interleaved_1f1b``: ``v`` model chunks per rank in loop placement, rank r holding stages
``c * pp + r``. Microbatches go through the chunks in groups of ``g`` (``g = pp`` when pp
divides m; in general ``g = m // max(1, m // pp)``, which relaxes Megatron's ``m % pp == 0`` the
way torch does): forwards run ``g`` microbatches on chunk 0, the same ``g`` on chunk 1, ...,
then the next group; backwards run the chunks in reverse. The k-th forward of a rank is chunk
``(k // g) % v``, microbatch ``(k // (g v)) g + k % g``. Warm-up is ``(v - 1) g + 2 (pp - 1 -
rank)`` forwards (capped at ``m v``): enough that the last rank reaches its first backward on
chunk v-1 and every earlier rank stays two steps ahead of the next one, as in the paper.

Rule: ``num_microbatches`` is a multiple of the number of rounds ``max(1, m // pp)``.
The bubble (equal stage costs, free comm) is ``(pp-1) / (v m + pp - 1)`` for ``m >= pp``
(docs/schedules.md); no published formula for unequal F/I/W costs is attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir import Action, ActionKind, Schedule
from ..kind import ScheduleKind, one_f_one_b_bubble, interleave_1f1b, stages_of_rank

if TYPE_CHECKING:
    from ..spec import ScheduleSpec

_F, _B = ActionKind.F, ActionKind.B


def _check(spec: "ScheduleSpec") -> None:
    rounds = max(1, spec.num_microbatches // spec.pp_size)
    if spec.num_microbatches % rounds != 0:
        raise ValueError(
            f"num_microbatches={spec.num_microbatches} must be a multiple of the number "
            f"of rounds max(1, num_microbatches // pp_size)={rounds} for "
            f"kind='interleaved_1f1b' (pp_size={spec.pp_size})"
        )


def build_interleaved_1f1b(spec: "ScheduleSpec") -> Schedule:
    """Depth-first interleaved 1F1B (see the module doc)."""
    m, p, v = spec.num_microbatches, spec.pp_size, spec.virtual_stages
    g = m // max(1, m // p)
    out: Schedule = {}
    for rank in range(p):
        stages = stages_of_rank(spec, rank)
        fwd: list[Action] = []
        bwd: list[Action] = []
        for k in range(m * v):
            chunk = (k // g) % v
            mb = (k // (g * v)) * g + k % g
            fwd.append(Action(stages[chunk], _F, mb))
            bwd.append(Action(stages[v - 1 - chunk], _B, mb))
        warmup = min((v - 1) * g + 2 * (p - 1 - rank), m * v)
        out[rank] = interleave_1f1b(fwd, bwd, warmup)
    return out


KIND = ScheduleKind(
    "interleaved_1f1b", build_interleaved_1f1b, min_virtual=1, check=_check,
    published="interleaved 1F1B (Narayanan et al. 2021)", published_bubble=one_f_one_b_bubble, docs_section="7",
    description="1F1B over v model chunks per rank, depth first (Narayanan et al. 2021)",
)
