"""PipelineSchedule on real gloo ranks against a single-process run of the same model."""

from __future__ import annotations

import re
import time

import pytest
import torch

from overlap_runtime.pipeline import (ExecutionTrace, PipelineActionError, PipelineSchedule,
                                      PipelineStage, Schedule1F1B, ScheduleGPipe,
                                      ScheduleInterleaved1F1B, gather_traces, measured_bubble,
                                      write_execution_trace)
from overlap_runtime.schedules import ActionKind, ScheduleSpec
from overlap_runtime.testing import RankFailedError, rel_l2, run_ranks
from tests.support.pipeline_toy import (BATCH, HIDDEN, make_schedule, toy_data, toy_loss, toy_model,
                                         toy_reference)

TOL = 1e-6


def _run_and_compare(rank: int, world: int, kind: str, virtual: int, m: int, overlap_p2p: bool,
                     overlap_b_f: bool = False) -> dict:
    sched, model, stages = make_schedule(kind, world, virtual, m, overlap_p2p, overlap_b_f)
    x, y = toy_data()
    calls: list[str] = []
    if overlap_b_f:
        def cb(action, ctx):  # noqa: ANN001 - the documented callback signature
            calls.append(str(action))
            ctx.run_default(action)
        sched.register_custom_function(ActionKind.OVERLAP_B_F, cb)
    losses: list[torch.Tensor] = []
    errs: dict[str, float] = {}
    for step in range(2):  # twice: the second step reuses learnt metadata
        for p in model.parameters():
            p.grad = None
        losses.clear()
        out = sched.step(x, target=y, losses=losses)
        ref_model, ref_loss, ref_out = toy_reference(world * virtual)
        for st in stages:
            for (name, p), (_, q) in zip(model[st.stage_index].named_parameters(),
                                         ref_model[st.stage_index].named_parameters()):
                errs[f"stage{st.stage_index}.{name}"] = rel_l2(p.grad, q.grad)
        if out is not None:
            errs["out"] = rel_l2(out, ref_out)
            errs["loss"] = rel_l2(torch.stack(losses).mean(), ref_loss)
            assert len(losses) == m
    paired = sum(1 for a in sched.program if a.kind is ActionKind.OVERLAP_B_F)
    return {"errs": errs, "calls": len(calls), "paired": paired * 2}


CASES = [
    ("gpipe", 2, 1, 4, False), ("gpipe", 4, 1, 8, True),
    ("1f1b", 2, 1, 4, True), ("1f1b", 4, 1, 8, False), ("1f1b", 4, 1, 8, True),
    ("interleaved_1f1b", 2, 2, 4, False), ("interleaved_1f1b", 4, 2, 8, False),
    ("interleaved_1f1b", 4, 2, 8, True),
]


@pytest.mark.parametrize("kind,world,virtual,m,overlap_p2p", CASES)
def test_loss_and_every_gradient_match_single_process(kind, world, virtual, m, overlap_p2p) -> None:
    results = run_ranks(_run_and_compare, world, args=(kind, virtual, m, overlap_p2p))
    worst = max(max(r["errs"].values()) for r in results)
    assert worst <= TOL, results
    assert any("loss" in r["errs"] for r in results)


@pytest.mark.parametrize("kind,world,virtual,m", [("1f1b", 2, 1, 4), ("interleaved_1f1b", 4, 2, 8)])
def test_overlap_b_f_callback_runs_exactly_for_paired_steps(kind, world, virtual, m) -> None:
    results = run_ranks(_run_and_compare, world, args=(kind, virtual, m, True, True))
    for r in results:
        assert max(r["errs"].values()) <= TOL
        assert r["paired"] > 0 and r["calls"] == r["paired"], r  # 2 steps x paired actions


def _raises_mid_step(rank: int, world: int) -> None:
    sched, model, stages = make_schedule("1f1b", world, 1, 4, True, timeout_s=20)
    if rank == 1:
        def boom(action, ctx):  # noqa: ANN001
            if action.microbatch == 2:
                raise RuntimeError("stage failure on purpose")
            ctx.run_default(action)
        sched.register_custom_function(ActionKind.F, boom)
    x, y = toy_data()
    sched.step(x, target=y)


def test_a_rank_that_raises_mid_step_fails_the_job_fast() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="stage failure on purpose") as info:
        run_ranks(_raises_mid_step, 2, timeout_s=60)
    assert info.value.rank == 1 and time.monotonic() - t0 < 30
    assert str(info.value).startswith("rank 1 of 2 raised PipelineActionError: rank 1 (pipeline "
                                      "rank 1): stage 1, action 1F2 (thread 'MainThread')")


def _stalled_peer(rank: int, world: int) -> str:
    sched, model, stages = make_schedule("1f1b", world, 1, 4, False, timeout_s=1.5)
    x, y = toy_data()
    sched.step(x, target=y)  # first step: metadata exchanged, all good
    if rank == 1:
        time.sleep(6)  # never takes part in the second step
        return "stalled"
    sched.step(x, target=y)
    return "no timeout"


def test_a_stalled_peer_becomes_a_pipeline_timeout_naming_rank_step_action_peer() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_stalled_peer, 2, timeout_s=60)
    msg = str(info.value)
    assert info.value.rank == 0
    assert "raised PipelineTimeout: pipeline timeout after 1.5s on rank 0 (pipeline rank 0): " \
           "stage 0, action 0" in msg
    assert re.search(r"schedule step \d+ of 16, waiting for 0(SEND|RECV)_[FB]\d (to|from) rank 1 ",
                     msg), msg
    assert "<-- here" in msg  # the grid with the stalled step marked


def _bad_configs(rank: int, world: int) -> list[str]:
    model = toy_model(4)
    msgs = []
    spec = ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=4)
    cases = [
        # a stage count that does not match the modules
        lambda: PipelineSchedule(spec, [PipelineStage(model[0], 0, 2),
                                        PipelineStage(model[1], 1, 2)], toy_loss),
        lambda: PipelineSchedule(spec, [PipelineStage(model[rank], rank, 4)], toy_loss),
        # group size against pp_size
        lambda: PipelineSchedule(ScheduleSpec(kind="1f1b", pp_size=4, num_microbatches=4),
                                 [PipelineStage(model[rank], rank, 4)], toy_loss),
        # inputs that cannot be split
        lambda: Schedule1F1B(PipelineStage(model[rank], rank, 2), 3, toy_loss).step(
            torch.zeros(8, HIDDEN), target=torch.zeros(8, HIDDEN)),
        lambda: Schedule1F1B(PipelineStage(model[rank], rank, 2), 16, toy_loss).step(
            torch.zeros(8, HIDDEN), target=torch.zeros(8, HIDDEN)),
        lambda: ScheduleGPipe(PipelineStage(model[rank], rank, 2), 2, toy_loss).register_custom_function(
            ActionKind.SEND_F, print),
    ]
    for case in cases:
        try:
            case()
        except (ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
        else:
            msgs.append("NO ERROR")
    return msgs


def test_bad_configurations_raise_clear_errors() -> None:
    msgs = run_ranks(_bad_configs, 2)[0]
    assert "NO ERROR" not in msgs, msgs
    assert "got stages [0, 1]" in msgs[0] and "puts stages [0]" in msgs[0]
    assert "num_stages=4" in msgs[1]
    assert "2 ranks but spec.pp_size is 4" in msgs[2]
    assert "8 cannot be split into 3" in msgs[3]
    assert "8 cannot be split into 16" in msgs[4]
    assert "not SEND_F" in msgs[5]


def _shape_mismatch(rank: int, world: int) -> str:
    model = toy_model(2)
    spec = ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=2)
    stage = PipelineStage(model[rank], rank, 2)
    sched = PipelineSchedule(spec, [stage], toy_loss, timeout_s=3)  # rank 1 ends by this timeout
    x, y = toy_data()
    sched.step(x, target=y)
    # second step with a wider batch: microbatch activations no longer match the agreed shape
    try:
        sched.step(torch.zeros(2 * BATCH, HIDDEN), target=torch.zeros(2 * BATCH, HIDDEN))
    except PipelineActionError as exc:  # raised in 0F0: the original is the cause
        assert isinstance(exc.cause, ValueError) and exc.__cause__ is exc.cause
        assert exc.site.action == "0F0" and exc.site.stage == 0, exc.site
        return f"ValueError: {exc.cause}"
    except (RuntimeError, TimeoutError) as exc:  # the receiver: its peer stopped
        return f"peer failed: {type(exc).__name__}"
    return "NO ERROR"


def test_shape_mismatch_is_an_error_naming_both_shapes_not_a_hang() -> None:
    msgs = run_ranks(_shape_mismatch, 2, timeout_s=60)
    assert msgs[0].startswith("ValueError") and "[8, 8] float32" in msgs[0] \
        and "[4, 8] float32" in msgs[0], msgs
    assert msgs[1].startswith("peer failed"), msgs


def _traced(rank: int, world: int, path: str) -> dict:
    sched, model, stages = make_schedule("1f1b", world, 1, 8, True)
    x, y = toy_data()
    trace = ExecutionTrace()
    sched.step(x, target=y, trace=trace)
    events = gather_traces(trace)
    if rank == 0:
        write_execution_trace(events, path)
    sim = sched.compiled.simulate().bubble_ratio
    return {"n": len(events), "ranks": sorted({e.rank for e in events}),
            "bubble": measured_bubble(events), "sim": sim,
            "computes": sum(1 for e in events if e.cat == "compute")}


def test_execution_trace_merged_across_ranks(tmp_path) -> None:
    import json

    path = tmp_path / "trace.json"
    res = run_ranks(_traced, 2, args=(str(path),))
    assert res[0]["ranks"] == [0, 1]
    assert res[0]["computes"] == 2 * 2 * 8  # F and B of 8 microbatches on 2 stages
    assert 0.0 < res[0]["bubble"] < 1.0 and 0.0 < res[0]["sim"] < 1.0
    data = json.loads(path.read_text())
    names = {e["name"] for e in data["traceEvents"] if e.get("ph") == "X"}
    assert "0F0" in names and "1B7" in names


def test_overlap_p2p_has_one_default_everywhere() -> None:
    """ScheduleSpec and every Schedule* constructor default to overlap_p2p=True, so a schedule
    runs the way its spec was simulated unless asked otherwise."""
    import inspect

    default = ScheduleSpec.model_fields["overlap_p2p"].default
    assert default is True
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B):
        assert issubclass(cls, PipelineSchedule)
        assert inspect.signature(cls).parameters["overlap_p2p"].default is default, cls
