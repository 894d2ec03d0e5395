"""DualPipeV: DeepSeek's DualPipe cut in half (DeepSeek-V3 technical report, arXiv:2412.19437,
section 3.2.1; the ``DualPipeV`` schedule of github.com/deepseek-ai/DualPipe).

Kind ``dualpipev``: two stages per rank in V placement (``virtual_stages=2``,
``placement='v'``): rank r holds stage ``r`` (chunk 0, going down the ranks) and stage
``2 pp - 1 - r`` (chunk 1, coming back up), so the first and last stage both sit on rank 0 and
the turn of the V (stages ``pp - 1`` and ``pp``) is a local hand-off on the last rank. In the
steady state every step is ``(F;B)OVERLAP_F_B``: the forward of one chunk with the full backward
of the other, two microbatches with no data dependency between them, whose communication can
hide behind each other's compute. Backwards split into ``I`` and ``W`` (zero bubble) only where
that shortens the fill and the drain.

Per rank r (pp ranks, m >= 2 pp microbatches; d = stage r, u = stage 2 pp - 1 - r)::

    1  2 (pp - 1 - r)   F(d)                          fill chunk 0
    2  r + 1            F(d) F(u)                     both chunks start
    3  pp - 1 - r       I(u) W F(u)                   zero bubble: W of the I just run
    4  m - 2 pp + r + 1 (F(d);B(u)) (F(u);B(d))       steady state, all overlapped
                        (the last rank runs its very first pair as F(d) B(u): shorter fill)
    5  pp - 1 - r       B(u) (F(u);B(d))              chunk 0 has run out of forwards
    6  r + 1            B(u) B(d), the later half as I(u) I(d)
    7  pp - 1 - r       W I(d)                        zero bubble
    8  r + 1            W                             drain the held-back weight passes

``W`` always takes the oldest pending weight pass of the rank (either chunk). Bubble with free
communication, per rank: ``(pp - 1)(F&B + B - 3 W)`` where ``F&B`` is one overlapped step
(docs/schedules.md, "Zero bubble and DualPipeV", derives it for the simulator, whose two
threads share the device so ``F&B = F + B``). The per-rank order equals torch's
``ScheduleDualPipeV`` (tested).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..ir import Action, ActionKind, Schedule
from ..kind import PublishedBubble, ScheduleKind, stages_of_rank

if TYPE_CHECKING:
    from ...graph.simulate import CostModel
    from ..spec import ScheduleSpec

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def _check(spec: "ScheduleSpec") -> None:
    if spec.num_microbatches < 2 * spec.pp_size:
        raise ValueError(
            f"num_microbatches={spec.num_microbatches} is too small for kind='dualpipev' with "
            f"pp_size={spec.pp_size}: rule num_microbatches >= 2 * pp_size "
            f"= {2 * spec.pp_size} (both chunks of every rank need a steady state)"
        )
    if spec.overlap_b_f:
        raise ValueError(
            "overlap_b_f=True does not apply to kind='dualpipev': its steady state is already "
            "made of (F;B)OVERLAP_F_B steps (rule: overlap_b_f only for 1F1B-style kinds)"
        )


class _RankProgram:
    """One rank's compute list while it is built: microbatch counters per (stage, pass) and
    the FIFO of weight passes that an ``I`` left pending."""

    def __init__(self) -> None:
        self.steps: list[Action | None] = []
        self._next: dict[tuple[int, ActionKind], int] = {}
        self._pending_w: deque[Action] = deque()

    def _take(self, stage: int, kind: ActionKind) -> int:
        key = (stage, kind)
        mb = self._next.get(key, 0)
        self._next[key] = mb + 1
        return mb

    def forward(self, stage: int) -> Action:
        return Action(stage, _F, self._take(stage, _F))

    def backward(self, stage: int, split: bool = False) -> Action:
        """The stage's next backward: ``B``, or ``I`` with its ``W`` left pending."""
        mb = self._take(stage, _B)
        if not split:
            return Action(stage, _B, mb)
        self._pending_w.append(Action(stage, _W, mb))
        return Action(stage, _I, mb)

    def overlapped(self, f_stage: int, b_stage: int) -> Action:
        return Action.compound(ActionKind.OVERLAP_F_B, self.forward(f_stage),
                               self.backward(b_stage))

    def emit(self, *actions: Action) -> None:
        self.steps.extend(actions)

    def emit_oldest_w(self) -> None:
        if self._pending_w:
            self.steps.append(self._pending_w.popleft())


def build_dualpipev(spec: "ScheduleSpec") -> Schedule:
    """DualPipeV's eight phases per rank (see the module doc)."""
    m, p = spec.num_microbatches, spec.pp_size
    out: Schedule = {}
    for r in range(p):
        d, u = stages_of_rank(spec, r)  # chunk 0 (down) = stage r, chunk 1 (up) = 2p-1-r
        prog = _RankProgram()
        for _ in range(2 * (p - 1 - r)):
            prog.emit(prog.forward(d))
        for _ in range(r + 1):
            prog.emit(prog.forward(d), prog.forward(u))
        for _ in range(p - 1 - r):
            prog.emit(prog.backward(u, split=True))
            prog.emit_oldest_w()
            prog.emit(prog.forward(u))
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                # the turn of the V: 1F of chunk 1 needs the F(d) just run, so overlapping
                # them would serialise anyway; alone they let B(u) start one step earlier
                prog.emit(prog.forward(d), prog.backward(u))
            else:
                prog.emit(prog.overlapped(d, u))
            prog.emit(prog.overlapped(u, d))
        for _ in range(p - 1 - r):
            prog.emit(prog.backward(u))
            prog.emit(prog.overlapped(u, d))
        # second half of the drain as I (+ W later): the odd ranks switch one backward earlier
        half = (r + 1) // 2
        for i in range(r + 1):
            prog.emit(prog.backward(u, split=i > half or (i == half and r % 2 == 1)))
            prog.emit(prog.backward(d, split=i >= half))
        for _ in range(p - 1 - r):
            prog.emit_oldest_w()
            prog.emit(prog.backward(d, split=True))
        for _ in range(r + 1):
            prog.emit_oldest_w()
        if prog._pending_w:  # pragma: no cover - the phase counts above balance exactly
            raise AssertionError(f"rank {r}: weight passes left pending: {list(prog._pending_w)}")
        out[r] = prog.steps
    return out


def _idle(pp: int, costs: "CostModel") -> float:
    """``(pp - 1)(F&B + B - 3 W)`` with ``F&B = F + B`` (one overlapped step), B = I + W."""
    b = costs.I + costs.W
    return (pp - 1) * ((costs.F + b) + b - 3 * costs.W)


def _published(spec: "ScheduleSpec", costs: "CostModel",
               compute_only: "Callable[[bool], float]") -> PublishedBubble:
    """DualPipe's idle ``(PP/2 - 1)(F&B + B - 3W)`` per rank over ``work + idle`` (DeepSeek-V3
    report, table 2; docs/schedules.md section 9)."""
    p, c = spec.pp_size, costs
    idle = _idle(p, c)
    unit = compute_only(True)
    why = [f"the formula starts each overlapped F&B step as one unit once both inputs are here "
           f"({unit:.4f} in that model, compute only); the timeline above starts each half on "
           f"its own input (less idle) and puts a rank's SEND/RECV on one in-order comm lane, "
           f"where a receive can hold up a send a peer needs now (more idle from p = 4)"]
    if c.B != c.I + c.W:
        why.append(f"B steps cost {c.B:g} here, the formula takes B = I + W = {c.I + c.W:g}")
    work = spec.virtual_stages * spec.num_microbatches * (c.F + c.I + c.W)
    formula = (f"idle (PP/2 - 1)(F&B + B - 3W), PP = 2p = {2 * p} stages, F&B = F + B (no "
               f"overlap gain at this granularity), B = I + W: {idle:g} per rank")
    return PublishedBubble(idle / (work + idle), formula, tuple(why))


KIND = ScheduleKind(
    "dualpipev", build_dualpipev, min_virtual=2, max_virtual=2, placements=("v",),
    overlap_b_f=False, split_backward=False, check=_check, idle_per_rank=_idle,
    published="DualPipe (DeepSeek-V3 report, table 2)", published_bubble=_published,
    docs_section="9",
    description="DualPipeV: two chunks per rank in a V, overlapped F/B steady state "
                "(DeepSeek-V3, 2024)",
)
