"""The pipeline rules a schedule (compute-only or lowered) must follow.

Rules, each named in the error it raises:

1. a stage sits on exactly one rank;
2. compound steps: ``OVERLAP_B_F`` is (backward, forward), ``OVERLAP_F_B`` is (forward,
   backward), and their sub-actions belong to the step's rank;
3. each stage runs, per microbatch, F once and either B once or I once and W once;
4. on its rank, a stage's F(m) comes before its B/I(m), and I(m) before W(m);
5. in a lowered schedule (one with SEND/RECV), every output that crosses ranks has its send on
   the producer's rank after the producer, its receive on the consumer's rank before the
   consumer, and there are no other SEND/RECV actions.

Errors print the steps x ranks grid with the offending cells marked ``*...*``.

Deadlock freedom is not checked here: it is a property of the compiled task graph, proven in
one place, :mod:`overlap_runtime.schedules.compile` (``validate_schedule`` = these rules + that
proof; ``compile_spec`` runs both). This module imports only the IR and the grid printer, so
lowering and compilation can use its errors and :func:`infer_stage_to_rank`.
"""

from __future__ import annotations

from typing import Mapping

from ..graph._gc import gc_paused
from ..graph.grid import format_grid
from .ir import COMM_KINDS, ActionKind, Schedule

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_BACKWARD = (_B, _I)


class ScheduleValidationError(ValueError):
    """A schedule that breaks a pipeline rule; the message names the rule and shows the grid."""


def _programs(schedule: Schedule) -> dict[int, list[str]]:
    return {r: ["" if a is None else str(a) for a in acts] for r, acts in schedule.items()}


def _fail(schedule: Schedule, rule: str, problems: list[str], marks: set[tuple[int, int]]) -> None:
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise ScheduleValidationError(
        f"{len(problems)} problem(s), rule: {rule}\n  " + "\n  ".join(problems[:20]) + more
        + "\n\n" + format_grid(_programs(schedule), marks)
    )


def infer_stage_to_rank(schedule: Schedule) -> dict[int, int]:
    """``{stage: rank}`` from the compute actions (rule 1); raises if a stage is on two ranks."""
    mapping: dict[int, int] = {}
    where: dict[int, tuple[int, int]] = {}
    for rank in sorted(schedule):
        for step, a in enumerate(schedule[rank]):
            if a is None or a.is_comm:
                continue
            for x in a.leaves():
                prev = mapping.setdefault(x.stage, rank)
                if prev != rank:
                    _fail(
                        schedule, "a stage sits on exactly one rank",
                        [f"stage {x.stage} runs on rank {prev} (step {where[x.stage][1]}) and on "
                         f"rank {rank} (step {step}: {a})"],
                        {where[x.stage], (rank, step)},
                    )
                where.setdefault(x.stage, (rank, step))
    return mapping


@gc_paused
def check_pipeline_rules(
    schedule: Schedule,
    *,
    num_microbatches: int | None = None,
    num_stages: int | None = None,
    stage_to_rank: Mapping[int, int] | None = None,
) -> tuple[Mapping[int, int], int, bool]:
    """Raise :class:`ScheduleValidationError` unless ``schedule`` follows rules 1-5 above.

    ``num_microbatches`` / ``num_stages`` default to the largest index seen + 1;
    ``stage_to_rank`` to the placement seen. Returns ``(stage_to_rank, num_stages, lowered)``
    as checked (``lowered``: the schedule holds SEND/RECV actions).
    """
    inferred = infer_stage_to_rank(schedule)
    if stage_to_rank is None:
        stage_to_rank = inferred
    else:
        wrong = [(s, r) for s, r in inferred.items() if stage_to_rank.get(s) != r]
        if wrong:
            s, r = wrong[0]
            _fail(schedule, "stages run on the rank the placement gives them",
                  [f"stage {s} runs on rank {r} but the placement puts it on rank "
                   f"{stage_to_rank.get(s)}"], set())
    # where each leaf / comm action runs: first occurrence, and any further ones in ``dups``
    leaves: dict[tuple[ActionKind, int, int], list[tuple[int, int]]] = {}
    comms: dict[tuple[ActionKind, int, int], list[tuple[int, int]]] = {}
    dups = False
    problems: list[str] = []
    marks: set[tuple[int, int]] = set()
    for rank in sorted(schedule):
        for step, a in enumerate(schedule[rank]):
            if a is None:
                continue
            kind = a.kind
            if kind in COMM_KINDS:
                key = (kind, a.stage, a.microbatch)
                if key in comms:
                    comms[key].append((rank, step))  # type: ignore[index]
                else:
                    comms[key] = [(rank, step)]  # type: ignore[index]
                continue
            if a.sub_actions:
                kinds = tuple(x.kind for x in a.sub_actions)
                ok = len(kinds) == 2 and (
                    (kind is ActionKind.OVERLAP_B_F and kinds[0] in _BACKWARD and kinds[1] is _F)
                    or (kind is ActionKind.OVERLAP_F_B and kinds[0] is _F
                        and kinds[1] in _BACKWARD)
                )
                if not ok:
                    problems.append(f"rank {rank} step {step}: {a} must pair one backward and one "
                                    f"forward in the order its name gives")
                    marks.add((rank, step))
            for x in a.sub_actions or (a,):
                key = (x.kind, x.stage, x.microbatch)
                if key in leaves:
                    leaves[key].append((rank, step))  # type: ignore[index]
                    dups = True
                else:
                    leaves[key] = [(rank, step)]  # type: ignore[index]
    if problems:
        _fail(schedule, "OVERLAP_B_F = (B|I;F), OVERLAP_F_B = (F;B|I)", problems, marks)

    stages = sorted(stage_to_rank)
    n_stages = num_stages if num_stages is not None else (stages[-1] + 1 if stages else 0)
    n_mb = num_microbatches
    if n_mb is None:
        n_mb = max((k[2] for k in leaves), default=-1) + 1
    for (kind, s, m), where in leaves.items():
        if s >= n_stages or m >= n_mb:
            problems.append(
                f"{s}{kind.value}{m} is outside {n_stages} stages x {n_mb} microbatches")
            marks.update(where)
    # fast path: F everywhere once, and per (stage, mb) exactly B, or exactly I and W
    by_kind: dict[ActionKind, set[tuple[int, int]]] = {k: set() for k in (_F, _B, _I, _W)}
    for kind, s, m in leaves:
        by_kind[kind].add((s, m))
    n_cells = n_stages * n_mb
    fast_ok = (
        not dups and not problems
        and len(by_kind[_F]) == n_cells
        and by_kind[_I] == by_kind[_W]
        and not (by_kind[_B] & by_kind[_I])
        and len(by_kind[_B]) + len(by_kind[_I]) == n_cells
    )
    if not fast_ok:
        for s in range(n_stages):
            for m in range(n_mb):
                f = leaves.get((_F, s, m), [])
                b = leaves.get((_B, s, m), [])
                i = leaves.get((_I, s, m), [])
                w = leaves.get((_W, s, m), [])
                if len(f) != 1:
                    problems.append(f"stage {s} microbatch {m}: forward {s}F{m} runs {len(f)} "
                                    "times, expected once")
                    marks.update(f)
                counts = (len(b), len(i), len(w))
                if counts not in ((1, 0, 0), (0, 1, 1)):
                    if counts == (0, 0, 0):
                        problems.append(f"stage {s} microbatch {m} has no backward (expected "
                                        f"{s}B{m}, or {s}I{m} and {s}W{m})")
                    else:
                        problems.append(f"stage {s} microbatch {m}: backward runs B x{len(b)}, "
                                        f"I x{len(i)}, W x{len(w)}; expected B once, or I once "
                                        "and W once")
                    marks.update(b + i + w)
    if problems:
        _fail(schedule, "each stage runs F and B (or I and W) exactly once per microbatch",
              problems, marks)

    for (kind, s, m), where in leaves.items():
        if kind in _BACKWARD or kind is _W:
            pred = (_F, s, m) if kind is not _W else (_I, s, m)
            pw = leaves.get(pred)
            if pw and where[0] < pw[0]:
                problems.append(f"rank {where[0][0]} step {where[0][1]}: {s}{kind.value}{m} runs "
                                f"before {s}{pred[0].value}{m} (step {pw[0][1]})")
                marks.update([where[0], pw[0]])
    if problems:
        _fail(schedule, "F(m) before B/I(m), and I(m) before W(m), on the stage's rank",
              problems, marks)

    if comms:
        _check_comm(schedule, leaves, comms, stage_to_rank, n_stages)
    return stage_to_rank, n_stages, bool(comms)


def _check_comm(  # type: ignore[no-untyped-def]
    schedule, leaves, comms, stage_to_rank, n_stages
) -> None:
    problems: list[str] = []
    marks: set[tuple[int, int]] = set()
    expected: set[tuple[ActionKind, int, int]] = set()
    for (kind, s, m), where in leaves.items():
        if kind is _F:
            if s + 1 >= n_stages or stage_to_rank[s] == stage_to_rank.get(s + 1):
                continue
            src, dst = stage_to_rank[s], stage_to_rank[s + 1]
            send, recv = (ActionKind.SEND_F, s, m), (ActionKind.RECV_F, s + 1, m)
            consumers = [(_F, s + 1, m)]
        elif kind in _BACKWARD:
            if s == 0 or stage_to_rank[s] == stage_to_rank.get(s - 1):
                continue
            src, dst = stage_to_rank[s], stage_to_rank[s - 1]
            send, recv = (ActionKind.SEND_B, s, m), (ActionKind.RECV_B, s - 1, m)
            consumers = [(_B, s - 1, m), (_I, s - 1, m)]
        else:
            continue
        expected.add(send)
        expected.add(recv)
        for act, rank, role in ((send, src, "send"), (recv, dst, "receive")):
            text = f"{act[1]}{act[0].value}{act[2]}"
            got = comms.get(act, [])
            if len(got) != 1 or got[0][0] != rank:
                found = f"{len(got)}" + (f" on rank {got[0][0]}" if got else "")
                problems.append(f"missing {role} {text} on rank {rank} for {s}{kind.value}{m} "
                                f"(found {found})")
                marks.update(where + got)
                for ck in consumers:  # mark who waits for it too
                    marks.update(leaves.get(ck, ())[:1])
                continue
            if role == "send" and got[0][1] < where[0][1]:
                problems.append(f"rank {rank}: {text} (step {got[0][1]}) comes before its "
                                f"producer {s}{kind.value}{m} (step {where[0][1]})")
                marks.update([got[0], where[0]])
            if role == "receive":
                for ck in consumers:
                    cw = leaves.get(ck)
                    if cw and cw[0][1] < got[0][1]:
                        problems.append(f"rank {rank}: {text} (step {got[0][1]}) comes after its "
                                        f"consumer {ck[1]}{ck[0].value}{m} (step {cw[0][1]})")
                        marks.update([got[0], cw[0]])
    for act, where in comms.items():
        if act not in expected:
            problems.append(f"{act[1]}{act[0].value}{act[2]} at rank {where[0][0]} step "
                            f"{where[0][1]} matches no output that crosses ranks")
            marks.update(where)
    if problems:
        _fail(schedule, "every cross-rank output has one send (after its producer) and one "
              "receive (before its consumer)", problems, marks)
