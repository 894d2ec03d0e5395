"""Schedule builders: pure functions ``ScheduleSpec -> Schedule`` (compute actions only).

Each rank's list is the order in which that rank runs its compute; the lists carry no timing
padding (``lower`` and the simulator find the timing). Diagram for ``1f1b``, pp=4, m=6
(F=forward, B=backward, digit=microbatch; rank 3 holds the last stage)::

    rank 0  F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5      warm-up 3 = pp-1-rank
    rank 1  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5      warm-up 2
    rank 2  F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5      warm-up 1
    rank 3  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5      warm-up 0

With ``overlap_b_f`` every steady-state ``B_i`` and the forward right after it become one
``(B_i;F_j)OVERLAP_B_F`` step: rank 3 above becomes ``F0 (B0;F1) (B1;F2) ... (B4;F5) B5``.
Warm-up forwards and cool-down backwards stay alone.
"""

from __future__ import annotations

from typing import Callable

from .ir import Action, ActionKind, Schedule
from .spec import ScheduleSpec

__all__ = [
    "build_schedule",
    "build_gpipe",
    "build_1f1b",
    "build_interleaved_1f1b",
    "pair_backward_forward",
    "split_backward",
    "register_builder",
]

Builder = Callable[[ScheduleSpec], Schedule]
_BUILDERS: dict[str, Builder] = {}

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def register_builder(kind: str) -> Callable[[Builder], Builder]:
    """Decorator: ``@register_builder("zero_bubble")`` makes ``build_schedule`` dispatch to it.

    The kind must also be registered with
    :func:`~overlap_runtime.schedules.spec.register_schedule_kind` for specs to accept it.
    """

    def deco(fn: Builder) -> Builder:
        _BUILDERS[kind] = fn
        return fn

    return deco


def build_schedule(spec: ScheduleSpec) -> Schedule:
    """Build the compute schedule for ``spec``, then apply ``split_backward`` / ``overlap_b_f``."""
    try:
        builder = _BUILDERS[spec.kind]
    except KeyError:
        raise ValueError(
            f"no builder registered for kind {spec.kind!r}; known: {sorted(_BUILDERS)}"
        ) from None
    schedule = builder(spec)
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
    steady-state ``B_i`` with the next forward ``F_{i+1}`` (seed 001, section 2.2). Bubbles
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


# -- builders -------------------------------------------------------------------------------


@register_builder("gpipe")
def build_gpipe(spec: ScheduleSpec) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs all forwards, then all backwards."""
    m = spec.num_microbatches
    out: Schedule = {}
    for rank in range(spec.pp_size):
        stage = _stages_of_rank(spec, rank)[0]
        out[rank] = [Action(stage, _F, i) for i in range(m)] + [
            Action(stage, _B, i) for i in range(m)
        ]
    return out


@register_builder("1f1b")
def build_1f1b(spec: ScheduleSpec) -> Schedule:
    """1F1B / PipeDream-Flush: ``pp-1-rank`` warm-up forwards, then alternate F and B."""
    m, p = spec.num_microbatches, spec.pp_size
    out: Schedule = {}
    for rank in range(p):
        stage = _stages_of_rank(spec, rank)[0]
        warmup = min(p - 1 - rank, m)
        fwd = [Action(stage, _F, i) for i in range(m)]
        bwd = [Action(stage, _B, i) for i in range(m)]
        out[rank] = _interleave_1f1b(fwd, bwd, warmup)
    return out


@register_builder("interleaved_1f1b")
def build_interleaved_1f1b(spec: ScheduleSpec) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2), depth first.

    Rank r holds v chunks, stages ``c * pp + r``. Microbatches go through the chunks in groups
    of ``g`` (``g = pp`` when pp divides m; in general ``g = m // max(1, m // pp)``, which
    relaxes Megatron's ``m % pp == 0`` the way torch does): forwards run ``g`` microbatches
    on chunk 0, the same ``g`` on chunk 1, ..., then the next group; backwards run the chunks
    in reverse. The k-th forward of a rank is chunk ``(k // g) % v``, microbatch
    ``(k // (g v)) g + k % g``. Warm-up is ``(v - 1) g + 2 (pp - 1 - rank)`` forwards (capped at
    ``m v``): enough that the last rank reaches its first backward on chunk v-1 and every
    earlier rank stays two steps ahead of the next one, as in the paper.
    """
    m, p, v = spec.num_microbatches, spec.pp_size, spec.virtual_stages
    g = m // max(1, m // p)
    out: Schedule = {}
    for rank in range(p):
        stages = _stages_of_rank(spec, rank)
        fwd: list[Action] = []
        bwd: list[Action] = []
        for k in range(m * v):
            chunk = (k // g) % v
            mb = (k // (g * v)) * g + k % g
            fwd.append(Action(stages[chunk], _F, mb))
            bwd.append(Action(stages[v - 1 - chunk], _B, mb))
        warmup = min((v - 1) * g + 2 * (p - 1 - rank), m * v)
        out[rank] = _interleave_1f1b(fwd, bwd, warmup)
    return out


def _interleave_1f1b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action | None]:
    """``warmup`` forwards, then F/B pairs, then the remaining backwards."""
    n = len(fwd)
    order: list[Action | None] = list(fwd[:warmup])
    for i in range(n - warmup):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[n - warmup:])
    return order


def _stages_of_rank(spec: ScheduleSpec, rank: int) -> list[int]:
    """Global stages of ``rank`` ordered by chunk (chunk 0 first)."""
    return [s for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank]


# Kinds defined in their own modules register their kind and builder on import (kept last:
# they import this module's register_builder).
from . import builders_dualpipev, builders_zero_bubble  # noqa: E402,F401
