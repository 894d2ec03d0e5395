"""Lowering: add SEND/RECV actions to a compute schedule, in a deadlock-free order.

Where a forward of stage s feeds stage s+1 on another rank, ``sSEND_Fm`` goes to the producer's
rank and ``(s+1)RECV_Fm`` to the consumer's; a backward of stage s sends ``sSEND_Bm`` to stage
s-1, received as ``(s-1)RECV_Bm``. Adjacent stages on one rank hand off locally: no action.

Why the order cannot hang, even when every send blocks until its receive is posted
(rendezvous). Lowering replays the compute schedule in *rounds*: in each round every rank runs
its next step if that step's inputs were produced in earlier rounds; the messages produced in
the round are then exchanged. Each rank's list is exactly this replay, so the replay itself is
an execution in which every send meets its receive:

- compute steps of round t only use data exchanged at the end of rounds < t;
- the messages of round t are put in one global order and appended, in that order, to the
  lists of both endpoints; the global order is a linearization, so when a rank reaches a
  message every earlier message of both endpoints has completed, and the partner is at the
  same message.

The global order groups a round's messages into *phases* in which each rank talks to at most
one peer (a greedy edge colouring of the links between ranks, e.g. links 0-1 and 2-3 first,
then 1-2). Were it simply "by sender rank", rank p-1 would wait for a chain of p rendezvous in each
round (the naive order that broke once latency was non-zero in the simulator); with phases the
chain is at most a few messages long. Within a link the lower rank's message goes first.

The lazy alternative (receive right before the consumer, send right after the producer)
deadlocks in the 1F1B steady state: rank 0 sends F(m+1) while rank 1 sends B(m), and each
waits for the other's receive.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

from ..graph._gc import gc_paused
from ..graph.grid import format_grid
from .ir import Action, ActionKind, Schedule
from .rules import ScheduleValidationError, infer_stage_to_rank

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


class LoweringError(ScheduleValidationError):
    """The compute schedule has steps whose inputs can never be produced."""


@gc_paused
def lower(
    schedule: Schedule,
    stage_to_rank: Mapping[int, int] | None = None,
    *,
    num_stages: int | None = None,
) -> Schedule:
    """Return a new schedule with SEND/RECV actions inserted and bubbles (``None``) dropped.

    ``stage_to_rank`` defaults to the placement seen in ``schedule``; ``num_stages`` to the
    largest stage + 1. The input must be compute only (F, B, I, W and compound steps).
    Raises :class:`LoweringError` (with the grid, blocked steps marked) when the compute
    order cannot make progress, e.g. a backward listed before its own forward.
    """
    for rank, actions in schedule.items():
        for step, a in enumerate(actions):
            if a is not None and a.is_comm:
                raise LoweringError(
                    f"rank {rank} step {step}: {a} is a communication action; lower() takes a "
                    "compute-only schedule (rule: lower once)"
                )
    if stage_to_rank is None:
        stage_to_rank = infer_stage_to_rank(schedule)
    if num_stages is None:
        num_stages = max(stage_to_rank, default=-1) + 1
    queues = {r: [a for a in schedule[r] if a is not None] for r in sorted(schedule)}
    pos = {r: 0 for r in queues}
    out: Schedule = {r: [] for r in queues}
    done: set[tuple[ActionKind, int, int]] = set()  # (F|B|W, stage, mb); I counts as B
    last = num_stages - 1
    plans = _message_plans(stage_to_rank, num_stages)
    trusted = Action._trusted

    def missing(a: Action) -> tuple[ActionKind, int, int] | None:
        """The first input of ``a`` not produced yet, or ``None`` when ``a`` can run."""
        s, k, m = a.stage, a.kind, a.microbatch
        if k is _F:
            key = (_F, s - 1, m)
            return None if s == 0 or key in done else key
        if k is _B or k is _I:
            key = (_F, s, m)
            if key not in done:
                return key
            key = (_B, s + 1, m)
            return None if s == last or key in done else key
        key = (_B, s, m)  # W after I
        return None if key in done else key

    # Rounds, event-driven: a rank whose next step waits for an input is parked under that
    # input and looked at again only in the round after it is produced (a rank that ran a step
    # is looked at in the next round). Scanning every rank in every round was O(ranks x
    # rounds), quadratic in pp; this is O(actions) and gives the same rounds, so the same lists.
    waiting: dict[tuple[ActionKind, int, int], list[int]] = {}
    candidates = sorted(r for r in queues if queues[r])
    while candidates:
        produced: list[tuple[ActionKind, int, int]] = []
        messages: list[tuple[tuple[int, ...], int, _Plan]] = []
        ran: list[int] = []
        for r in candidates:
            a = queues[r][pos[r]]
            leaves = a.sub_actions or (a,)
            blocked = None
            for x in leaves:
                blocked = missing(x)
                if blocked is not None:
                    break
            if blocked is not None:
                waiting.setdefault(blocked, []).append(r)
                continue
            pos[r] += 1
            out[r].append(a)
            if pos[r] < len(queues[r]):
                ran.append(r)
            for x in leaves:
                k = x.kind
                produced.append((_B if k is _I else k, x.stage, x.microbatch))
                plan = plans.get((_B if k is _I else k, x.stage))
                if plan is not None:
                    messages.append((plan.order, x.microbatch, plan))
        if not produced:
            raise _stuck_error(schedule, queues, pos, done, last)
        done.update(produced)
        woken = ran
        for key in produced:
            parked = waiting.pop(key, None)
            if parked:
                woken.extend(parked)
        candidates = sorted(set(woken))
        messages.sort()
        for _, m, plan in messages:
            out[plan.src].append(trusted(plan.send_stage, plan.send_kind, m))
            out[plan.dst].append(trusted(plan.recv_stage, plan.recv_kind, m))
    if any(pos[r] < len(queues[r]) for r in queues):  # parked on inputs nobody produces
        raise _stuck_error(schedule, queues, pos, done, last)
    return out


class _Plan(NamedTuple):
    """The message an output of (kind, stage) needs, and its place in a round's order."""

    order: tuple[int, ...]
    src: int
    dst: int
    send_stage: int
    send_kind: ActionKind
    recv_stage: int
    recv_kind: ActionKind


def _message_plans(
    stage_to_rank: Mapping[int, int], num_stages: int
) -> dict[tuple[ActionKind, int], _Plan]:
    """Per (F|B, stage) whose output crosses ranks: who sends, who receives, and the sort key.

    The key puts a round's messages in phases: the links between ranks are coloured greedily
    so that in one phase a rank has at most one peer; within a link the lower rank's messages
    go first (then forward before backward, then by stage; the microbatch breaks ties).
    """
    raw: list[tuple[ActionKind, int, int, int]] = []
    for s in range(num_stages):
        if s + 1 < num_stages and stage_to_rank[s] != stage_to_rank[s + 1]:
            raw.append((_F, s, stage_to_rank[s], stage_to_rank[s + 1]))
        if s > 0 and stage_to_rank[s] != stage_to_rank[s - 1]:
            raw.append((_B, s, stage_to_rank[s], stage_to_rank[s - 1]))
    links = sorted({(min(a, b), max(a, b)) for _, _, a, b in raw})
    phase_busy: list[set[int]] = []
    phase_of: dict[tuple[int, int], int] = {}
    for link in links:
        ph = 0
        while ph < len(phase_busy) and (link[0] in phase_busy[ph] or link[1] in phase_busy[ph]):
            ph += 1
        if ph == len(phase_busy):
            phase_busy.append(set())
        phase_busy[ph].update(link)
        phase_of[link] = ph
    plans: dict[tuple[ActionKind, int], _Plan] = {}
    for kind, s, src, dst in raw:
        link = (min(src, dst), max(src, dst))
        order = (phase_of[link], link[0], link[1], src, 0 if kind is _F else 1, s)
        if kind is _F:
            plans[(kind, s)] = _Plan(order, src, dst, s, ActionKind.SEND_F, s + 1,
                                     ActionKind.RECV_F)
        else:
            plans[(kind, s)] = _Plan(order, src, dst, s, ActionKind.SEND_B, s - 1,
                                     ActionKind.RECV_B)
    return plans


def _stuck_error(  # type: ignore[no-untyped-def]
    schedule, queues, pos, done, last
) -> LoweringError:
    reasons = []
    marks = set()
    steps_of: dict[int, list[int]] = {}
    for r, actions in schedule.items():
        steps_of[r] = [i for i, a in enumerate(actions) if a is not None]
    for r, q in queues.items():
        if pos[r] >= len(q):
            continue
        a = q[pos[r]]
        marks.add((r, steps_of[r][pos[r]]))
        missing = []
        for x in a.leaves():
            s, k, m = x.stage, x.kind, x.microbatch
            if k is _F and s > 0 and (_F, s - 1, m) not in done:
                missing.append(f"{s - 1}F{m}")
            if k in (_B, _I):
                if (_F, s, m) not in done:
                    missing.append(f"{s}F{m}")
                if s != last and (_B, s + 1, m) not in done:
                    missing.append(f"{s + 1}B{m} (or {s + 1}I{m})")
            if k is _W and (_B, s, m) not in done:
                missing.append(f"{s}I{m}")
        reasons.append(f"rank {r} step {steps_of[r][pos[r]]}: {a} waits for {', '.join(missing)}")
    programs = {r: ["" if a is None else str(a) for a in acts] for r, acts in schedule.items()}
    return LoweringError(
        "compute schedule cannot make progress (rule: every step's inputs must be produced by "
        "steps that can run before it); blocked steps:\n  " + "\n  ".join(reasons)
        + "\n\n" + format_grid(programs, marks)
    )
