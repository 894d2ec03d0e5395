"""Errors of a pipeline step name where they happened (pipeline/errors.py), on real gloo ranks.

- an action that raises leaves ``step`` as a PipelineActionError at that action (rank, program
  step, stage, microbatch, thread), the original chained;
- inside a compound step the innermost sub-action is named, with its side and its thread, also
  when it runs on a second thread;
- the peer of a raising rank times out (PipelineTimeout) naming the receive, the peer and the
  compute action that waited for it;
- the peer of a rank that died fails at once (PipelinePeerFailed) naming the peer.

The two runs whose peer times out (~3 s of waiting each) start together (``Concurrently``, a
module fixture); each test asserts on its own.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterator

import pytest

import torch.distributed as dist

from overlap_runtime.pipeline import (PipelineActionError, PipelinePeerFailed, PipelineSchedule,
                                      PipelineStage, PipelineTimeout)
from overlap_runtime.pipeline.errors import ActionSite, pipeline_error_in, root_cause
from overlap_runtime.schedules import ActionKind, ScheduleSpec
from overlap_runtime.testing import Concurrently, RankFailedError, run_ranks

from tests.support.pipeline_toy import make_schedule, toy_data, toy_loss, toy_model

TIMEOUT_S = 1.5


def _schedule(overlap_b_f: bool) -> PipelineSchedule:
    spec = ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=4, overlap_b_f=overlap_b_f)
    model, rank = toy_model(2), dist.get_rank()
    return PipelineSchedule(spec, [PipelineStage(model[rank], rank, 2)], toy_loss,
                            timeout_s=TIMEOUT_S)


def _describe(exc: BaseException) -> dict[str, Any]:
    pe = pipeline_error_in(exc)
    assert pe is not None and isinstance(pe.site, ActionSite)
    return {"type": type(exc).__name__, "msg": str(exc).splitlines()[0], "site": pe.site,
            "peer": pe.peer, "waited_for": pe.waited_for, "root": type(root_cause(exc)).__name__,
            "cause": type(exc.__cause__).__name__}


def _step_catching(sched: PipelineSchedule) -> dict[str, Any]:
    x, y = toy_data()
    t0 = time.monotonic()
    try:
        sched.step(x, target=y)
    except Exception as exc:  # noqa: BLE001 - described for the test
        out = _describe(exc)
        out["elapsed"] = time.monotonic() - t0
        if dist.get_rank() == 1:
            time.sleep(2 * TIMEOUT_S)  # keep the pairs open: the peer must time out
        return out
    return {"type": None}


def _forward_raises(rank: int, world: int) -> dict[str, Any]:
    sched = _schedule(overlap_b_f=False)
    if rank == 1:
        def boom(action, ctx):  # noqa: ANN001
            if action.microbatch == 2:
                raise KeyError("stage failure on purpose")
            ctx.run_default(action)
        sched.register_custom_function(ActionKind.F, boom)
    out = _step_catching(sched)
    out["program"] = [str(a) for a in sched.program]
    return out


@pytest.fixture(scope="module")
def timing_out() -> Iterator[Concurrently]:
    """The two runs whose rank 0 runs into its timeout, started together."""
    with Concurrently({"forward": lambda: run_ranks(_forward_raises, 2, timeout_s=60),
                       "thread": lambda: run_ranks(_backward_raises_in_a_thread, 2,
                                                   timeout_s=60)}) as started:
        yield started


def test_a_raising_action_is_named_and_its_peer_times_out_naming_it(
        timing_out: Concurrently) -> None:
    r0, r1 = timing_out.result("forward")
    step = r1["program"].index("1F2")
    site = r1["site"]
    assert r1["type"] == "PipelineActionError" and r1["cause"] == "KeyError"
    assert (site.rank, site.group_rank, site.step_index, site.action, site.stage,
            site.microbatch, site.side, site.compound, site.thread) == (
        1, 1, step, "1F2", 1, 2, None, None, "MainThread")
    assert r1["msg"] == (f"rank 1 (pipeline rank 1): stage 1, action 1F2 (thread 'MainThread'), "
                         f"schedule step {step} of {len(r1['program'])} raised KeyError: "
                         f"'stage failure on purpose'")
    # rank 0 waits for what 1F2 would have produced, the gradient of microbatch 2 (in 0B2)
    assert r0["type"] == "PipelineTimeout" and r0["peer"] == 1, r0
    assert r0["waited_for"] == "0RECV_B2" and r0["site"].action in ("0B2", "0RECV_B2"), r0
    assert "waiting for 0RECV_B2 from rank 1" in r0["msg"], r0["msg"]
    assert r0["elapsed"] < TIMEOUT_S + 10


def _threaded_overlap_b_f(action, ctx) -> None:  # noqa: ANN001 - the callback signature
    """Runs the backward sub-action on a thread of its own, the forward here."""
    f = next(a for a in action.sub_actions if a.kind is ActionKind.F)
    b = next(a for a in action.sub_actions if a.kind is not ActionKind.F)
    errors: list[BaseException] = []

    def backward() -> None:
        try:
            ctx.run(b)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    worker = threading.Thread(target=backward, name="bwd-worker", daemon=True)
    worker.start()
    ctx.run(f)
    worker.join(30)
    assert not worker.is_alive(), "backward worker stuck"
    if errors:
        raise errors[0]


def _backward_raises_in_a_thread(rank: int, world: int) -> dict[str, Any]:
    sched = _schedule(overlap_b_f=True)
    sched.register_custom_function(ActionKind.OVERLAP_B_F, _threaded_overlap_b_f)
    if rank == 1:
        def boom(action, ctx):  # noqa: ANN001
            if action.microbatch == 1:
                raise ValueError("backward failure on purpose")
            ctx.run_default(action)
        sched.register_custom_function(ActionKind.B, boom)
    out = _step_catching(sched)
    out["program"] = [str(a) for a in sched.program]
    return out


def test_a_sub_action_failing_on_another_thread_names_side_thread_and_compound(
        timing_out: Concurrently) -> None:
    r0, r1 = timing_out.result("thread")
    compound = "(1B1;1F2)OVERLAP_B_F"
    site = r1["site"]
    assert r1["type"] == "PipelineActionError" and r1["cause"] == "ValueError", r1
    assert (site.action, site.compound, site.side, site.thread, site.step_index) == (
        "1B1", compound, "backward", "bwd-worker", r1["program"].index(compound))
    assert f"action 1B1 in {compound} (backward side, thread 'bwd-worker')" in r1["msg"]
    # rank 0's backward of microbatch 1 runs on its worker thread and waits for rank 1
    s0 = r0["site"]
    assert r0["type"] == "PipelineTimeout" and r0["waited_for"] == "0RECV_B1", r0
    assert (s0.action, s0.compound, s0.side, s0.thread) == (
        "0B1", "(0B1;0F3)OVERLAP_B_F", "backward", "bwd-worker"), s0
    assert ("action 0B1 in (0B1;0F3)OVERLAP_B_F (backward side, thread 'bwd-worker'), "
            "schedule step 8 of 14, waiting for 0RECV_B1 from rank 1") in r0["msg"], r0["msg"]


def _dies_mid_step(rank: int, world: int) -> None:
    sched = _schedule(overlap_b_f=False)
    if rank == 1:
        def die(action, ctx):  # noqa: ANN001
            if action.microbatch == 1:
                os._exit(7)
            ctx.run_default(action)
        sched.register_custom_function(ActionKind.F, die)
    x, y = toy_data()
    sched.step(x, target=y)


def test_the_peer_of_a_dead_rank_fails_at_once_naming_it() -> None:
    t0 = time.monotonic()
    try:
        run_ranks(_dies_mid_step, 2, timeout_s=60, failure_grace_s=30)
    except RankFailedError as err:
        failure = err
    else:
        raise AssertionError("the job did not fail")
    assert time.monotonic() - t0 < 30
    assert failure.rank == 1 and failure.failures[1].died, str(failure)
    assert str(failure).startswith("rank 1 of 2 died with exit code 7 without a result")
    f0 = failure.failures[0]
    assert f0.exc_type == "PipelinePeerFailed" and f0.after_s < TIMEOUT_S, f0
    assert "pipeline peer failed: rank 0 (pipeline rank 0): stage 0" in f0.message, f0.message
    assert " rank 1: " in f0.message.splitlines()[0], f0.message


def test_error_types_are_pipeline_errors() -> None:
    from overlap_runtime.pipeline import PipelineError

    for cls in (PipelineActionError, PipelinePeerFailed, PipelineTimeout):
        assert issubclass(cls, PipelineError)
    assert issubclass(PipelineTimeout, TimeoutError)


def _skipping_callback_rank(rank: int, world: int, mode: str) -> None:

    sched, _, _ = make_schedule("1f1b", world, 1, 4, True, True, timeout_s=20)

    def cb(action, ctx):  # runs at most one of its two sub-actions
        b, f = action.sub_actions
        if mode == "forward_only":
            ctx.run(f)

    sched.register_custom_function(ActionKind.OVERLAP_B_F, cb)
    x, y = toy_data()
    sched.step(x, target=y)


@pytest.mark.parametrize("mode", ["nothing", "forward_only"])
def test_a_callback_that_skips_its_sub_actions_is_named(mode: str) -> None:
    """#28 item 10: once a KeyError: (1, 0) a few steps later; now the step that skipped."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(_skipping_callback_rank, 2, args=(mode,), timeout_s=60)
    text = str(info.value)
    assert "the function registered for OVERLAP_B_F (" in text and "without running" in text, text
    assert "KeyError" not in text


def _microbatch_mismatch_rank(rank: int, world: int) -> None:
    from overlap_runtime.pipeline import PipelineStage, Schedule1F1B

    model = toy_model(2)
    sched = Schedule1F1B(PipelineStage(model[rank], rank, 2), 4 if rank == 0 else 2, toy_loss)
    x, y = toy_data()
    sched.step(x, target=y)


def test_ranks_with_other_microbatch_counts_raise_a_named_error() -> None:
    """#28 item 5: once a size-mismatch crash (gloo SIGABRT with 3 ranks, a shape error with 2)."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(_microbatch_mismatch_rank, 2, timeout_s=60)
    text = str(info.value)
    assert ("raised ValueError: PipelineSchedule: ranks disagree on the number of microbatches: "
            "rank 0 has 4, rank 1 has 2 (pp group of 2)") in text, text
