"""``build_schedule``: a spec's compute schedule, and the passes over compute schedules.

Each rank's list is the order in which that rank runs its compute; the lists carry no timing
padding (``lower`` and the simulator find the timing). The kind's builder (looked up by name in
:mod:`overlap_runtime.schedules.registry`; each kind's diagram is in its file under
``schedules/kinds/``) makes the base order; then ``split_backward`` replaces every ``B`` by
``I`` then ``W``, and ``overlap_b_f`` pairs every steady-state ``B_i`` with the forward right
after it into one ``(B_i;F_j)OVERLAP_B_F`` step. Warm-up forwards and cool-down backwards stay
alone.
"""

from __future__ import annotations

from .ir import Action, ActionKind, Schedule
from .registry import get_schedule_kind
from .spec import ScheduleSpec

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def build_schedule(spec: ScheduleSpec) -> Schedule:
    """Build the compute schedule for ``spec``, then apply ``split_backward`` / ``overlap_b_f``."""
    schedule = get_schedule_kind(spec.kind).build(spec)
    if spec.split_backward:
        schedule = split_backward(schedule)
    if spec.overlap_b_f:
        schedule = pair_backward_forward(schedule)
    return schedule


# -- passes over compute schedules -----------------------------------------------------------


def split_backward(schedule: Schedule) -> Schedule:
    """Replace every full backward ``sB m`` by ``sI m`` followed by ``sW m``."""
    out: Schedule = {}
    for rank, actions in schedule.items():
        new: list[Action | None] = []
        for a in actions:
            if a is not None and a.kind is _B:
                new.append(Action(a.stage, _I, a.microbatch))
                new.append(Action(a.stage, _W, a.microbatch))
            else:
                new.append(a)
        out[rank] = new
    return out


def pair_backward_forward(schedule: Schedule) -> Schedule:
    """Fuse each full backward with the forward right after it into ``OVERLAP_B_F``.

    In a 1F1B-style order a backward directly followed by a forward only happens in the
    steady state (warm-up has no backward, cool-down no forward), so this pairs exactly the
    steady-state ``B_i`` with the next forward ``F_{i+1}``. Bubbles
    (``None``) are dropped from the paired lists. Actions already compound stay as they are.
    """
    out: Schedule = {}
    for rank, actions in schedule.items():
        steps = [a for a in actions if a is not None]
        new: list[Action | None] = []
        i = 0
        while i < len(steps):
            a = steps[i]
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            if a.kind is _B and nxt is not None and nxt.kind is _F:
                new.append(Action.compound(ActionKind.OVERLAP_B_F, a, nxt))
                i += 2
            else:
                new.append(a)
                i += 1
        out[rank] = new
    return out
