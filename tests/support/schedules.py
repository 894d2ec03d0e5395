"""Shared helpers for the schedule tests (not collected: no test_ prefix)."""

from __future__ import annotations

from types import SimpleNamespace

from overlap_runtime.schedules import Action, ActionKind, Schedule


def torch_pipelining():
    import torch.distributed.pipelining.schedules as torch_schedules

    return torch_schedules


def dummy_stages(pp: int, v: int, rank: int = 0) -> list[SimpleNamespace]:
    """Stand-ins with the attributes torch's schedule constructors read (no process group)."""
    return [
        SimpleNamespace(group_size=pp, group_rank=rank, num_stages=pp * v,
                        stage_index=c * pp + rank)
        for c in range(v)
    ]


def to_torch(schedule: Schedule) -> dict:
    """Our schedule as torch ``_Action``s, through the shared text form."""
    ts = torch_pipelining()
    return {r: [None if a is None else ts._Action.from_str(str(a)) for a in acts]
            for r, acts in schedule.items()}


def lazy_lowering(schedule: Schedule, stage_to_rank: dict[int, int], num_stages: int) -> Schedule:
    """The naive lowering (receive right before the consumer, send right after the producer).

    It deadlocks under blocking sends in the 1F1B steady state; tests use it as a broken input.
    """
    out: Schedule = {r: [] for r in schedule}
    for rank, actions in schedule.items():
        for a in actions:
            if a is None:
                continue
            for x in a.leaves():
                s, m = x.stage, x.microbatch
                if x.kind is ActionKind.F and s > 0 and stage_to_rank[s - 1] != rank:
                    out[rank].append(Action(s, ActionKind.RECV_F, m))
                if x.kind is ActionKind.B and s < num_stages - 1 and stage_to_rank[s + 1] != rank:
                    out[rank].append(Action(s, ActionKind.RECV_B, m))
            out[rank].append(a)
            for x in a.leaves():
                s, m = x.stage, x.microbatch
                if x.kind is ActionKind.F and s < num_stages - 1 and stage_to_rank[s + 1] != rank:
                    out[rank].append(Action(s, ActionKind.SEND_F, m))
                if x.kind is ActionKind.B and s > 0 and stage_to_rank[s - 1] != rank:
                    out[rank].append(Action(s, ActionKind.SEND_B, m))
    return out


def compact(schedule: Schedule) -> Schedule:
    return {r: [a for a in acts if a is not None] for r, acts in schedule.items()}
