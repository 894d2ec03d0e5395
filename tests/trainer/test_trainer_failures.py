"""Failure behaviour of the 4D trainer on real gloo ranks (issue #19 item 6).

A rank whose stage raises or dies mid-step ends every rank within the configured
``comm_timeout_s``, and every rank's error names its global rank, the training step, the
pipeline stage and action (the sub-action, side and thread inside an ``OVERLAP_B_F``) and, for
a wait, the peer it waited for.

Injection lives here, not in the library: each rank replaces
``overlap_runtime.trainer.loop.build_parallel_model`` by a wrapper that, on the failing rank,
swaps the ``forward`` of one pipeline stage's module for one that counts its calls (one per
microbatch and step) and at training step 2, microbatch ``mb`` raises, registers a gradient hook
that raises (the backward, in the OVERLAP_B_F worker thread), or kills its own process.

Two ways a failing rank leaves, both tested:

* it exits at once (an exception reaching the top of a rank, SIGKILL, ``os._exit``): its sockets
  close and the others' gloo waits fail at once (``PipelinePeerFailed``, ``CommFailedError``);
* its process lingers after the failure (``LINGER``, longer than the timeout): the others end by
  their own timeouts (``PipelineTimeout``, a CP chain's or an EP all-to-all's
  ``CommTimeoutError``), within ``comm_timeout_s`` plus a margin.

``run_ranks(..., failure_grace_s=...)`` lets the other ranks end on their own after the first
failure and collects their errors in ``RankFailedError.failures``.

The five runs start together, three at a time (``Concurrently``, a module fixture): the two whose
failing rank lingers spend ~10 s waiting for the others' timeouts, and the other runs (and each
other's waits) fill that time. Each test asserts on its own run.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch

from overlap_runtime.testing import Concurrently, RankFailedError, RankFailure, run_ranks

HARNESS_TIMEOUT_S = 150.0
GRACE_S = 60.0
MARGIN_S = 5.0

PP_EP = {  # pp2 x ep2 (dp_shard 2), interleaved 1F1B with OVERLAP_B_F
    "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64, "mlp": "moe",
              "num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32},
    "data": {"seq_len": 64, "batch_size": 4},
    "optimizer": {"lr": 3.0e-3},
    "train": {"steps": 3,
              "accelerator": {"device": "cpu", "world_size": 4, "pp": 2, "ep": 2, "cp": 1,
                              "comm_timeout_s": 10},
              "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4,
                           "virtual_stages": 2, "overlap_b_f": True}},
}
PP_CP = {  # pp2 x cp2 (GDN p2p chain, ring attention), 1F1B
    "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64},
    "data": {"seq_len": 64, "batch_size": 4},
    "optimizer": {"lr": 3.0e-3},
    "train": {"steps": 3,
              "accelerator": {"device": "cpu", "world_size": 4, "pp": 2, "cp": 2,
                              "linear_attention_cp_mode": "p2p", "full_attention_cp_mode": "ring",
                              "comm_timeout_s": 8},
              "pipeline": {"schedule": "1f1b", "microbatches": 2}},
}


@dataclass(frozen=True)
class Injection:
    """On global rank ``rank``, stage ``stage``'s module, training step ``step``, microbatch
    ``mb``: ``what`` = ``forward`` (raise), ``backward`` (a gradient hook that raises),
    ``sigkill`` or ``exit`` (the process ends itself); ``linger_s``: how long the failing rank
    keeps its process after raising."""

    rank: int
    stage: int
    step: int
    mb: int
    what: str
    linger_s: float = 0.0


def _inject(pm: Any, inj: Injection, microbatches: int) -> None:
    module = pm.parts[inj.stage]
    original = module.forward
    calls = [0]
    target = (inj.step - 1) * microbatches + inj.mb

    def forward(*args: Any, **kwargs: Any) -> Any:
        i = calls[0]
        calls[0] += 1
        if i == target and inj.what == "forward":
            raise ValueError(f"injected forward failure at unix time {time.time():.3f}")
        if i == target and inj.what == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if i == target and inj.what == "exit":
            os._exit(3)
        out = original(*args, **kwargs)
        if i == target and inj.what == "backward":
            def hook(grad: torch.Tensor) -> None:
                raise ValueError(f"injected backward failure at unix time {time.time():.3f}")
            out.register_hook(hook)
        return out

    module.forward = forward


def _train_with_injection(rank: int, world: int, config: dict[str, Any], inj: Injection) -> None:
    from overlap_runtime.trainer import config_from_dict, train_distributed

    cfg = config_from_dict(config)

    def on_model(pm: Any) -> None:  # the trainer's public hook, right after the build
        if rank == inj.rank:
            _inject(pm, inj, cfg.train.pipeline.microbatches)

    try:
        train_distributed(cfg, torch.device("cpu"), log=lambda s: None, on_model=on_model)
    except Exception as exc:
        exc.add_note(f"[test] rank {rank} ended at unix time {time.time():.3f}")
        if rank == inj.rank and inj.linger_s:
            time.sleep(inj.linger_s)  # keep the sockets open: the others must time out
        raise


def _run(config: dict[str, Any], inj: Injection) -> tuple[RankFailedError, float]:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_train_with_injection, 4, timeout_s=HARNESS_TIMEOUT_S, args=(config, inj),
                  failure_grace_s=GRACE_S)
    return info.value, time.monotonic() - t0


def _unix_time(text: str, what: str) -> float:
    m = re.search(rf"{what} at unix time (\d+\.\d+)", text)
    assert m, f"no '{what} at unix time' in:\n{text}"
    return float(m.group(1))


def _head(f: RankFailure) -> str:
    return f.message.splitlines()[0]


def _assert_names_step_stage_action(f: RankFailure) -> None:
    head = _head(f)
    assert f.exc_type == "TrainStepError", f
    assert head.startswith(f"rank {f.rank}, training step 2, pipeline stage "), head
    # a compute action (3F1, 2B0, 0W1) or the send / receive a rank was in when its peer died
    # (0SEND_F2, 2RECV_B0): which one depends on where the failure found it
    assert re.search(r"action \d+(?:[FBIW]|SEND_[FB]|RECV_[FB])\d+", head) \
        and "schedule step " in head, head


def _names_peer(f: RankFailure, *peers: int) -> bool:
    """The error names one of ``peers``: a pipeline wait's peer, or an EP all-to-all's group."""
    head = _head(f)
    return any(re.search(rf"(from|to) rank {p}: ", head)
               or re.search(rf"\(global ranks \[[\d, ]*\b{p}\b[\d, ]*\]\)", f.message)
               for p in peers)


def _report(err: RankFailedError, wall: float) -> str:
    lines = [f"wall {wall:.1f}s"]
    lines += [f"rank {r} +{f.after_s:.2f}s: {_head(f)}" for r, f in sorted(err.failures.items())]
    return "\n".join(lines)


def _dies(death: str, grace_s: float) -> tuple[RankFailedError, float]:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_train_with_injection, 4, timeout_s=HARNESS_TIMEOUT_S,
                  args=(PP_EP, Injection(rank=2, stage=3, step=2, mb=1, what=death)),
                  failure_grace_s=grace_s)
    return info.value, time.monotonic() - t0


LINGER_EP = PP_EP["train"]["accelerator"]["comm_timeout_s"] + 3
LINGER_CP = PP_CP["train"]["accelerator"]["comm_timeout_s"] + 3
DEATHS = [("sigkill", GRACE_S), ("exit", 0.0)]
# the two lingering runs first: they wait longest
SCENARIOS = {
    "backward": lambda: _run(PP_EP, Injection(rank=2, stage=3, step=2, mb=0, what="backward",
                                              linger_s=LINGER_EP)),
    "cp": lambda: _run(PP_CP, Injection(rank=2, stage=1, step=2, mb=1, what="forward",
                                        linger_s=LINGER_CP)),
    "forward": lambda: _run(PP_EP, Injection(rank=2, stage=3, step=2, mb=1, what="forward")),
    **{f"dies:{d}": (lambda d=d, g=g: _dies(d, g)) for d, g in DEATHS},
}


@pytest.fixture(scope="module")
def runs() -> Iterator[Concurrently]:
    with Concurrently(SCENARIOS, max_workers=3) as started:
        yield started


def test_forward_raising_in_overlap_b_f_ends_every_rank_fast(runs: Concurrently) -> None:
    """pp2 x ep2: rank 2's stage 3 forward raises at step 2, microbatch 1: the forward side of
    ``(3B0;3F1)OVERLAP_B_F``. The rank exits; the others fail at once on the closed pairs."""
    timeout = PP_EP["train"]["accelerator"]["comm_timeout_s"]
    err, wall = runs.result("forward")
    print(_report(err, wall))
    assert err.rank == 2 and sorted(err.failures) == [0, 1, 2, 3] and not err.unfinished
    failing = err.failures[2]
    assert _head(failing).startswith(
        "rank 2, training step 2, pipeline stage 3, action 3F1 in (3B0;3F1)OVERLAP_B_F "
        "(forward side, thread 'MainThread'), schedule step 9 of 35: ValueError: injected "
        "forward failure"), failing.message
    # each names the peer it waited for: its pipeline or EP peer (2, 3 for rank 0; 3, 0 for
    # rank 1, whichever of its peers failed first), the EP all-to-all with rank 2 for rank 3
    for r, peers in ((0, (2, 3)), (1, (3, 0)), (3, (2,))):
        f = err.failures[r]
        _assert_names_step_stage_action(f)
        assert f.after_s < timeout + MARGIN_S, _report(err, wall)
        assert _names_peer(f, *peers), f.message
        assert re.search(r": (PipelinePeerFailed|CommFailedError): ", _head(f)), _head(f)
    assert "all-to-all 'S3.L" in err.failures[3].message
    assert wall < 60, _report(err, wall)


def test_backward_raising_in_the_worker_thread_ends_every_rank_by_their_timeouts(
        runs: Concurrently) -> None:
    """pp2 x ep2: rank 2's backward of stage 3, microbatch 0 at step 2 raises in the worker
    thread of ``(3B0;3F1)OVERLAP_B_F``; the rank keeps its process, so the others end by their
    own timeouts, within ``comm_timeout_s`` + margin of the failure."""
    timeout = PP_EP["train"]["accelerator"]["comm_timeout_s"]
    err, wall = runs.result("backward")
    print(_report(err, wall))
    assert sorted(err.failures) == [0, 1, 2, 3] and not err.unfinished
    failing = err.failures[2]
    assert _head(failing).startswith(
        "rank 2, training step 2, pipeline stage 3, action 3B0 in (3B0;3F1)OVERLAP_B_F "
        "(backward side, thread 'overlap-bwd-1'), schedule step 9 of 35: ValueError: injected "
        "backward failure"), failing.message
    injected = _unix_time(failing.message, "injected backward failure")
    for r in (0, 1, 3):
        f = err.failures[r]
        _assert_names_step_stage_action(f)
        ended = _unix_time(f.traceback, f"rank {r} ended")
        print(f"rank {r} ended {ended - injected:.2f}s after the injected failure")
        assert ended - injected < timeout + MARGIN_S, _report(err, wall)
    # rank 2's pipeline and EP peers time out (it never answers); rank 1 waits for rank 3,
    # which times out or, when rank 3 ended first, reports it gone
    assert "waiting for 2RECV_B0 from rank 2: PipelineTimeout" in _head(err.failures[0])
    assert _names_peer(err.failures[1], 3, 0), err.failures[1].message
    # rank 3 waited in the EP all-to-all with rank 2, named with the group's ranks
    assert "CommTimeoutError: S3.L0.combine (backward)" in _head(err.failures[3])
    assert "all-to-all 'S3.L" in err.failures[3].message
    assert _names_peer(err.failures[3], 2), err.failures[3].message
    assert wall < 3 * timeout + 30, _report(err, wall)


def test_forward_raising_under_cp_names_the_cp_wait_with_its_pipeline_action(
        runs: Concurrently) -> None:
    """pp2 x cp2 (GDN p2p, ring): rank 2 (pp 1, cp 0) raises in stage 1's forward at step 2,
    microbatch 1 and keeps its process; its CP peer rank 3 times out in the GDN chain's receive
    inside the same action, and that CP error carries the pipeline action 1F1."""
    timeout = PP_CP["train"]["accelerator"]["comm_timeout_s"]
    err, wall = runs.result("cp")
    print(_report(err, wall))
    assert sorted(err.failures) == [0, 1, 2, 3] and not err.unfinished
    assert _head(err.failures[2]).startswith(
        "rank 2, training step 2, pipeline stage 1, action 1F1 (thread 'MainThread'), schedule "
        "step 5 of 8: ValueError: injected forward failure"), err.failures[2].message
    injected = _unix_time(err.failures[2].message, "injected forward failure")
    for r in (0, 1, 3):
        f = err.failures[r]
        _assert_names_step_stage_action(f)
        ended = _unix_time(f.traceback, f"rank {r} ended")
        print(f"rank {r} ended {ended - injected:.2f}s after the injected failure")
        assert ended - injected < timeout + MARGIN_S
    assert _head(err.failures[3]).startswith(
        "rank 3, training step 2, pipeline stage 1, action 1F1 (thread 'MainThread'), schedule "
        "step 5 of 8: CommTimeoutError: "), err.failures[3].message
    # the CP wait it timed out in is named: the GDN layer's agreement check or one of its messages
    head = _head(err.failures[3]).lower()
    assert "gdn" in head or "gateddeltanet context parallelism" in head, err.failures[3].message
    assert "waiting for 0RECV_B1 from rank 2: PipelineTimeout" in _head(err.failures[0])
    assert re.search(r"waiting for 0RECV_B1 from rank 3: Pipeline(Timeout|PeerFailed)",
                     _head(err.failures[1]))
    assert wall < 3 * timeout + 30, _report(err, wall)


@pytest.mark.parametrize("death,grace_s", DEATHS)
def test_a_rank_that_dies_mid_step_is_reported_and_nobody_hangs(death: str, grace_s: float,
                                                                runs: Concurrently) -> None:
    """pp2 x ep2: rank 2 kills itself (SIGKILL, or ``os._exit(3)``) in stage 3's forward at step
    2. The harness reports the dead rank; with a grace period the survivors end on their own
    within the timeout, each naming where it was and the peer; without one they are killed."""
    timeout = PP_EP["train"]["accelerator"]["comm_timeout_s"]
    err, wall = runs.result(f"dies:{death}")
    print(_report(err, wall))
    how = "was killed by signal SIGKILL" if death == "sigkill" else "died with exit code 3"
    assert err.rank == 2 and str(err).startswith(f"rank 2 of 4 {how} without a result"), str(err)
    assert err.failures[2].died
    if grace_s:
        assert sorted(err.failures) == [0, 1, 2, 3] and not err.unfinished
        for r in (0, 1, 3):
            f = err.failures[r]
            _assert_names_step_stage_action(f)
            assert f.after_s < timeout + MARGIN_S, _report(err, wall)
        for r, peers in ((0, (2, 3)), (1, (3, 0)), (3, (2,))):
            assert _names_peer(err.failures[r], *peers), err.failures[r].message
    else:  # the others were killed at once (or reported a closed connection just before)
        assert len(err.failures) + len(err.unfinished) == 4
    assert wall < 60, _report(err, wall)
