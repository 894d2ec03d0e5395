"""Lowering (SEND/RECV insertion, local hand-off) and rejection of broken schedules."""

from __future__ import annotations

import re

import pytest
from tests.support.schedules import lazy_lowering

from overlap_runtime.graph import DeadlockError, UnmatchedCommError
from overlap_runtime.schedules import (
    Action,
    ActionKind,
    LoweringError,
    ScheduleSpec,
    ScheduleValidationError,
    build_schedule,
    compile_schedule,
    compile_spec,
    lower,
    parse_action,
    validate_schedule,
)

K = ActionKind


def sched(rows: dict[int, str]) -> dict:
    return {r: [parse_action(t) for t in row.split()] for r, row in rows.items()}


def test_lower_1f1b_two_ranks_exact() -> None:
    compute = build_schedule(ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=2))
    lowered = lower(compute)
    assert " ".join(map(str, lowered[0])) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1")
    assert " ".join(map(str, lowered[1])) == (
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1")
    validate_schedule(lowered)  # includes the deadlock proof


def test_local_hand_off_has_no_comm() -> None:
    # one rank, two stages: everything is local
    spec = ScheduleSpec(kind="interleaved_1f1b", pp_size=1, num_microbatches=3, virtual_stages=2)
    lowered = compile_spec(spec).lowered
    assert not any(a.is_comm for a in lowered[0])
    # V placement: stages 1 and 2 both on rank 1 hand off locally, 0<->1 and 2<->3 communicate
    v_sched = sched({
        0: "0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1",
        1: "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1",
    })
    mapping = {0: 0, 1: 1, 2: 1, 3: 0}
    lowered = lower(v_sched, mapping)
    comm = {str(a) for acts in lowered.values() for a in acts if a.is_comm}
    assert "1SEND_F0" not in comm and "2RECV_F0" not in comm and "2SEND_B0" not in comm
    assert {"0SEND_F0", "1RECV_F0", "2SEND_F0", "3RECV_F0", "3SEND_B0", "2RECV_B0",
            "1SEND_B0", "0RECV_B0"} <= comm
    validate_schedule(lowered, stage_to_rank=mapping)
    result = compile_schedule(lowered, stage_to_rank=mapping).simulate()
    assert result.makespan > 0


def test_lowering_reports_a_compute_order_that_cannot_progress() -> None:
    bad = sched({0: "0B0 0F0", 1: "1F0 1B0"})
    with pytest.raises(LoweringError) as info:
        lower(bad)
    msg = str(info.value)
    assert "rank 0 step 0: 0B0 waits for 0F0, 1B0 (or 1I0)" in msg
    assert "*0B0*" in msg and "<-- here" in msg


def test_lower_refuses_lowered_input() -> None:
    lowered = lower(build_schedule(ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=1)))
    with pytest.raises(LoweringError, match="lower once"):
        lower(lowered)


def _lowered_1f1b(pp: int = 2, m: int = 3) -> dict:
    return lower(build_schedule(ScheduleSpec(kind="1f1b", pp_size=pp, num_microbatches=m)))


def test_missing_receive_is_rejected() -> None:
    lowered = _lowered_1f1b()
    lowered[1] = [a for a in lowered[1] if str(a) != "1RECV_F2"]
    with pytest.raises(ScheduleValidationError) as info:
        validate_schedule(lowered)
    msg = str(info.value)
    assert "missing receive 1RECV_F2 on rank 1 for 0F2 (found 0)" in msg
    assert "rule: every cross-rank output has one send" in msg
    assert "*0F2*" in msg and "*1F2*" in msg  # producer and consumer marked in the grid
    # the graph-level check names the unmatched send too
    graph = compile_schedule(lowered)
    with pytest.raises(UnmatchedCommError) as ginfo:
        graph.validate()
    assert "send 0SEND_F2 (rank 0, lane comm:pp, step" in str(ginfo.value)
    assert "has no matching receive" in str(ginfo.value)


def test_send_order_that_deadlocks_is_rejected_with_the_cycle() -> None:
    spec = ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=3)
    lazy = lazy_lowering(build_schedule(spec), spec.stage_mapping(), spec.num_stages)
    with pytest.raises(DeadlockError) as info:
        validate_schedule(lazy)
    msg = str(info.value)
    assert msg.startswith("deadlock under blocking communication")
    cycle_line = next(line for line in msg.splitlines() if line.strip().startswith("cycle:"))
    cycle = cycle_line.split(":", 1)[1].strip().split(" -> ")
    assert cycle[0] == cycle[-1]
    assert "0SEND_F1" in cycle and "1SEND_B0" in cycle
    assert set(info.value.cycle) == set(cycle[:-1])
    assert "*0SEND_F1*" in msg and "*1SEND_B0*" in msg
    assert "rendezvous" in msg


def test_swapping_two_comm_steps_creates_a_deadlock() -> None:
    lowered = _lowered_1f1b(pp=2, m=3)
    row = lowered[1]
    # rank 1 ends in "1B1 1RECV_F2 1SEND_B1": sending first makes both ranks send at once
    i = next(k for k, a in enumerate(row) if str(a) == "1RECV_F2")
    j = next(k for k, a in enumerate(row) if str(a) == "1SEND_B1")
    assert j == i + 1
    row[i], row[j] = row[j], row[i]
    with pytest.raises(DeadlockError) as info:
        validate_schedule(lowered)
    assert set(info.value.cycle) >= {"0SEND_F2", "1SEND_B1"}


def test_microbatch_without_backward_is_rejected() -> None:
    compute = build_schedule(ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=3))
    compute[0] = [a for a in compute[0] if str(a) != "0B1"]
    with pytest.raises(ScheduleValidationError) as info:
        validate_schedule(compute, num_microbatches=3)
    msg = str(info.value)
    assert "stage 0 microbatch 1 has no backward (expected 0B1, or 0I1 and 0W1)" in msg
    assert "rule: each stage runs F and B (or I and W) exactly once per microbatch" in msg


def test_other_pipeline_rules() -> None:
    with pytest.raises(ScheduleValidationError, match="forward 0F0 runs 2 times, expected once"):
        validate_schedule(sched({0: "0F0 0F0 0B0"}))
    with pytest.raises(ScheduleValidationError, match="stage 1 runs on rank 0 .* and on rank 1"):
        validate_schedule(sched({0: "0F0 1F0 1B0 0B0", 1: "1F0"}))
    with pytest.raises(ScheduleValidationError, match=re.escape("0B0 runs before 0F0")):
        validate_schedule(sched({0: "0B0 0F0"}))
    with pytest.raises(ScheduleValidationError, match="must pair one backward and one forward"):
        validate_schedule(sched({0: "0F0 (0F1;0B0)OVERLAP_B_F 0B1"}))
    with pytest.raises(ScheduleValidationError, match="matches no output that crosses ranks"):
        lowered = _lowered_1f1b(pp=2, m=1)
        lowered[0].append(Action(0, K.SEND_F, 7))
        validate_schedule(lowered, num_microbatches=1)


def test_grid_of_a_large_schedule_is_cut_around_the_error() -> None:
    lowered = _lowered_1f1b(pp=4, m=40)
    lowered[3] = [a for a in lowered[3] if str(a) != "3RECV_F30"]
    with pytest.raises(ScheduleValidationError) as info:
        validate_schedule(lowered)
    msg = str(info.value)
    assert "earlier steps" in msg and "later steps" in msg
    assert len(msg.splitlines()) < 80
