"""Interop with the installed torch.distributed.pipelining: CSV files, checks and bubbles."""

from __future__ import annotations

import pytest
from tests.support.schedules import dummy_stages, to_torch, torch_pipelining

from overlap_runtime.graph import CostModel
from overlap_runtime.schedules import (
    ScheduleSpec,
    build_schedule,
    compile_schedule,
    compile_spec,
    dump_csv,
    lower,
    parse_action,
    validate_schedule,
)

KNOWN = {"F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
CASES = [("1f1b", 2, 4, 1), ("1f1b", 4, 6, 1), ("interleaved_1f1b", 4, 8, 2),
         ("interleaved_1f1b", 2, 6, 3), ("interleaved_1f1b", 4, 10, 2),
         ("interleaved_1f1b", 4, 3, 2)]


@pytest.mark.parametrize("kind, p, m, v", CASES)
@pytest.mark.parametrize("split", [False, True])
def test_our_csv_loads_into_torch_and_passes_its_checks(  # type: ignore[no-untyped-def]
    tmp_path, kind, p, m, v, split
) -> None:
    ts = torch_pipelining()
    spec = ScheduleSpec(kind=kind, pp_size=p, num_microbatches=m, virtual_stages=v,
                        split_backward=split)
    compute = build_schedule(spec)
    path = tmp_path / "compute.csv"
    dump_csv(compute, path)

    # torch reads the file, validates it (_validate_schedule) and lowers it (_add_send_recv)
    runtime = ts._PipelineScheduleRuntime(dummy_stages(p, v), m)
    runtime._load_csv(str(path), format="compute_only")
    assert runtime.stage_index_to_group_rank == spec.stage_mapping()
    assert {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order.items()} == {
        r: [str(a) for a in acts] for r, acts in compute.items()}
    # torch's simulator does not know its own FSDP steps (UNSHARD/RESHARD/REDUCE_GRAD): drop them
    torch_lowered = {r: [a for a in acts if a.computation_type.value in KNOWN]
                     for r, acts in runtime.pipeline_order_with_comms.items()}
    ts._simulate_comms_compute(torch_lowered, lambda s: runtime.stage_index_to_group_rank[s],
                               p * v)

    # and our lowered (compute + comms) schedule runs in torch's comms simulator without stalling
    lowered = lower(compute, spec.stage_mapping())
    comms_path = tmp_path / "comms.csv"
    dump_csv(lowered, comms_path)
    runtime2 = ts._PipelineScheduleRuntime(dummy_stages(p, v), m)
    runtime2._load_csv(str(comms_path), format="compute_comms")
    simulated = ts._simulate_comms_compute(
        runtime2.pipeline_order_with_comms, lambda s: spec.stage_mapping()[s], p * v)
    assert sum(a is not None for acts in simulated.values() for a in acts) == sum(
        len(acts) for acts in lowered.values())


@pytest.mark.parametrize("p, m, v", [(c[1], c[2], c[3]) for c in CASES if c[0] != "1f1b"])
def test_interleaved_bubble_equals_torchs(p: int, m: int, v: int) -> None:
    """Same spec, same bubble: torch's ScheduleInterleaved1F1B order through our passes."""
    ts = torch_pipelining()
    torch_sched = ts.ScheduleInterleaved1F1B(dummy_stages(p, v), m)
    theirs = {r: [None if a is None else parse_action(str(a)) for a in acts]
              for r, acts in torch_sched.pipeline_order.items()}
    validate_schedule(theirs, num_microbatches=m, num_stages=p * v)
    costs = CostModel(F=1.0, B=1.0)
    torch_result = compile_schedule(lower(theirs)).simulate(costs)
    ours = compile_spec(ScheduleSpec(kind="interleaved_1f1b", pp_size=p, num_microbatches=m,
                                     virtual_stages=v)).simulate(costs)
    assert ours.bubble_ratio == pytest.approx(torch_result.bubble_ratio, abs=1e-12)
    assert ours.makespan == torch_result.makespan

    # torch's own lowering passes our deadlock check under blocking semantics too
    torch_lowered = {
        r: [parse_action(str(a)) for a in acts if a.computation_type.value in KNOWN]
        for r, acts in torch_sched.pipeline_order_with_comms.items()}
    validate_schedule(torch_lowered, num_microbatches=m, num_stages=p * v)


def test_torch_validation_catches_what_ours_catches() -> None:
    """A schedule missing a backward fails torch's _validate_schedule as well as ours."""
    ts = torch_pipelining()
    compute = build_schedule(ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=3))
    compute[1] = [a for a in compute[1] if str(a) != "1B2"]
    with pytest.raises(AssertionError, match="expected 3 total backwards"):
        ts._validate_schedule(to_torch(compute), 2, 2, 3)
    with pytest.raises(ValueError, match="stage 1 microbatch 2 has no backward"):
        validate_schedule(compute, num_microbatches=3)
