"""``ScheduleKind``: what one schedule kind is (its rules on a spec, its builder, its published
bubble), and the helpers builders share.

Every kind is one file in :mod:`overlap_runtime.schedules.kinds` that defines ``KIND =
ScheduleKind(...)``; :mod:`overlap_runtime.schedules.registry` lists those files and looks kinds
up by name. This module imports only the IR (the spec and the cost model are type hints only),
so a kind file can import it without reaching the spec that validates against the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .ir import Action, Schedule

if TYPE_CHECKING:
    from ..graph.simulate import CostModel
    from .spec import ScheduleSpec

Builder = Callable[["ScheduleSpec"], Schedule]
"""``build(spec) -> Schedule``: the compute actions of every rank (no SEND/RECV)."""

IdleFormula = Callable[[int, "CostModel"], float]
"""``idle(pp, costs) -> float``: the published idle time per rank of one step (free comm)."""


@dataclass(frozen=True)
class PublishedBubble:
    """A kind's published bubble for one spec and cost model: the ratio, the formula as text
    (with its figure filled in), and why a simulated timeline may differ from it here."""

    ratio: float
    formula: str
    why_different: tuple[str, ...] = ()


BubbleFormula = Callable[["ScheduleSpec", "CostModel", Callable[[bool], float]], PublishedBubble]
"""``formula(spec, costs, compute_only) -> PublishedBubble``; ``compute_only(overlapped_as_unit)``
is the bubble of the compute-only simulation of the spec (for a note that compares with it)."""


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule kind: the constraints it puts on a :class:`ScheduleSpec` and its builder.

    - ``name``: the ``ScheduleSpec.kind`` string.
    - ``build(spec)``: the compute schedule (``split_backward`` / ``overlap_b_f`` are applied
      afterwards by :func:`~overlap_runtime.schedules.build.build_schedule`).
    - ``min_virtual`` / ``max_virtual``: bounds of ``virtual_stages`` (``None``: unbounded).
    - ``placements``: the stage placements the builder handles.
    - ``overlap_b_f``: the kind has a 1F1B steady state whose backward i and forward i+1 can be
      paired; ``split_backward``: the kind accepts ``split_backward=True``.
    - ``check(spec)``: the kind's own rules (raise ``ValueError`` naming the values and the
      rule); runs after the virtual-stage and placement rules, before the flag rules.
    - ``idle_per_rank(pp, costs)``: the published idle time per rank, if there is one
      (:mod:`overlap_runtime.schedules.bubbles`).
    - ``published``: where the published bubble comes from (``"GPipe (Huang et al. 2019)"``)
      and ``published_bubble``: its figure, formula text and caveats for a spec
      (:class:`PublishedBubble`); ``docs_section``: the section of docs/schedules.md that
      derives it. ``overlap-runtime schedule`` prints them beside the simulated bubble.
    """

    name: str
    build: Builder
    description: str = ""
    min_virtual: int = 1
    max_virtual: int | None = None
    placements: tuple[str, ...] = ("loop",)
    overlap_b_f: bool = True
    split_backward: bool = True
    check: Callable[["ScheduleSpec"], None] | None = None
    idle_per_rank: IdleFormula | None = None
    published: str = ""
    published_bubble: BubbleFormula | None = None
    docs_section: str = ""


def stages_of_rank(spec: "ScheduleSpec", rank: int) -> list[int]:
    """Global stages of ``rank`` ordered by chunk (chunk 0 first).

    Chunk ``c`` holds stages ``c * pp .. c * pp + pp - 1``, one per rank, so the stage of
    ``rank`` in chunk ``c`` is found from the placement directly: O(virtual_stages) per rank,
    not O(stages) (scanning every stage for every rank made building quadratic in ``pp``).
    """
    p = spec.pp_size
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is outside 0..{p - 1}")
    out = []
    for c in range(spec.virtual_stages):
        pos = p - 1 - rank if spec.placement == "v" and c % 2 == 1 else rank
        stage = c * p + pos
        if spec.stage_to_rank(stage) != rank:  # a placement this inversion does not know
            raise ValueError(f"placement {spec.placement!r} puts stage {stage} on rank "
                             f"{spec.stage_to_rank(stage)}, not on rank {rank}")
        out.append(stage)
    return out


def interleave_1f1b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action | None]:
    """``warmup`` forwards, then F/B pairs, then the remaining backwards."""
    n = len(fwd)
    order: list[Action | None] = list(fwd[:warmup])
    for i in range(n - warmup):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[n - warmup:])
    return order


def one_f_one_b_bubble(spec: "ScheduleSpec", costs: "CostModel",
                       compute_only: Callable[[bool], float]) -> PublishedBubble:
    """The published bubble of GPipe, 1F1B and interleaved 1F1B: ``1 - v m / (v max(m, p) +
    min(m, p) - 1)``, ``(p - 1)/(v m + p - 1)`` when m >= p; any F:B ratio, every stage equally
    costly, free communication (docs/schedules.md section 7)."""
    p, m, v = spec.pp_size, spec.num_microbatches, spec.virtual_stages
    ratio = 1 - v * m / (v * max(m, p) + min(m, p) - 1)
    formula = ("(p - 1)/(v m + p - 1)" if m >= p else
               "1 - v m/(v max(m, p) + min(m, p) - 1)") + " (every stage equally costly)"
    why = ()
    if spec.split_backward:
        why = ("with --split-backward only I crosses the ranks and W runs after it, so a rank "
               "idles (p - 1)(F + I), not (p - 1)(F + B)",)
    return PublishedBubble(ratio, formula, why)

