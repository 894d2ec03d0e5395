"""Deferred expert weight gradients and W tasks in the EP all-to-all windows (seed 001 part C).

Single process: the loop backend's split backward against the immediate path (fp32, float64),
tasks really deferred, PipelineStage's one-walk I/W on a MoE layer, the named refusals.
Two gloo ranks: an EP layer whose dispatcher flushes the queue while its token all-to-alls are in
flight (dispatch and combine, forward and backward), gradients equal to the immediate EP run.
Four gloo ranks: the trainer's pp2 x ep2 zero_bubble with ``defer_expert_w`` runs its W tasks
inside the all-to-all windows (the loss itself is compared with one device in
tests/trainer/test_trainer_4d.py). The three multi-rank runs, mostly waiting for their late
peers, start together (``Concurrently``, a module fixture); each test asserts on its own.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from tests.support.moe import FFN, HIDDEN, make_moe, objective, tokens
from overlap_runtime.moe import ExpertParallel, GroupedExperts, MoE
from overlap_runtime.moe.dispatcher import AllToAllTokenDispatcher, OverlapHooks
from overlap_runtime.moe.experts import DeferredWUnsupportedError
from overlap_runtime.pipeline import DeferredLinear, DeferredWQueue, PipelineStage
from overlap_runtime.pipeline.deferred_w import WRun, find_deferred_w_queue
from overlap_runtime.testing import Concurrently, rel_l2, run_ranks

pytestmark = pytest.mark.timeout(300)

COUNTS = [3, 0, 5, 2]  # expert 1 receives no rows


def _experts(dtype: torch.dtype, queue: DeferredWQueue | None = None) -> GroupedExperts:
    torch.manual_seed(0)
    return GroupedExperts(len(COUNTS), HIDDEN, FFN, dtype=dtype, deferred_w_queue=queue)


def _rows(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(COUNTS), HIDDEN, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_deferred_expert_grads_equal_immediate(dtype: torch.dtype, tol: float) -> None:
    tpe = torch.tensor(COUNTS)
    ref = _experts(dtype)
    x_ref = _rows(dtype).requires_grad_(True)
    objective(ref(x_ref, tpe)).backward()

    q = DeferredWQueue()
    runs: list[WRun] = []
    q.listeners.append(runs.append)
    mod = _experts(dtype, q)
    assert find_deferred_w_queue(mod) is q
    x = _rows(dtype).requires_grad_(True)
    y = mod(x, tpe)
    assert rel_l2(y, ref(x_ref.detach(), tpe)) <= tol
    with q.capture(("s", 0)):
        objective(y).backward()
    assert rel_l2(x.grad, x_ref.grad) <= tol  # dX at once
    assert all(p.grad is None for p in mod.parameters())  # dW really deferred
    assert q.pending() == 1 and q.pending_keys() == [("s", 0)]  # one task per call
    assert q.run(("s", 0)) == 1 and runs[0].reason == "action"
    for name in ("w1", "w3", "w2"):
        got, want = getattr(mod, name).grad, getattr(ref, name).grad
        assert got.dtype == dtype
        assert rel_l2(got, want) <= tol, name
    assert torch.count_nonzero(mod.w1.grad[1]) == 0  # the expert without rows: zeros

    # outside a capture: immediate gradients through the same Function, accumulating
    y2 = mod(x.detach(), tpe)
    objective(y2).backward()
    assert q.pending() == 0
    assert rel_l2(mod.w2.grad, 2 * ref.w2.grad) <= tol


def test_moe_stage_defers_only_expert_weights() -> None:
    """PipelineStage finds the experts' queue; I gives router/shared grads, W the experts'."""
    x = tokens(0, n=8)
    ref = make_moe()
    objective(ref(x)).backward()

    q = DeferredWQueue()
    moe = make_moe().defer_weight_gradients(q)
    st = PipelineStage(moe, 0, 1)
    assert st.deferred_w is q
    st.forward(0, (x,), loss_fn=lambda out, _: objective(out), target=None)
    st.backward_input(0, None)
    for n, p in moe.named_parameters():
        if n.startswith("experts."):
            assert p.grad is None, n
        else:
            assert rel_l2(p.grad, dict(ref.named_parameters())[n].grad) <= 1e-6, n
    assert q.pending() == 1
    st.backward_weight(0)
    assert q.pending() == 0
    for n, p in moe.named_parameters():
        assert rel_l2(p.grad, dict(ref.named_parameters())[n].grad) <= 1e-6, n


def test_refusals_are_named() -> None:
    q = DeferredWQueue()
    with pytest.raises(DeferredWUnsupportedError, match="backend='loop' only"):
        GroupedExperts(2, HIDDEN, FFN, backend="grouped_mm", deferred_w_queue=q)
    with pytest.raises(TypeError, match="DeferredWQueue"):
        GroupedExperts(2, HIDDEN, FFN).defer_weight_gradients(object())  # type: ignore[arg-type]
    d = AllToAllTokenDispatcher(4)
    d.hooks = OverlapHooks(coordinator=None, layer=0, is_last_layer=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="OVERLAP_B_F"):
        d.defer_weight_gradients(q)


def _cfg(**pipeline: Any) -> dict[str, Any]:
    return {
        "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
                  "mlp": "moe", "num_experts": 4, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
        "data": {"seq_len": 64, "batch_size": 4},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "train": {"steps": 2, "seed": 0, "precision": "fp32",
                  "accelerator": {"device": "cpu", "cp": 1, "world_size": 4, "pp": 2, "ep": 2,
                                  "comm_timeout_s": 60.0},
                  "pipeline": {"microbatches": 4, "defer_expert_w": True, **pipeline}},
    }


@pytest.mark.parametrize("pipeline,needs", [
    ({"schedule": "1f1b"}, "split-backward schedule"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": 2, "overlap_b_f": True},
     "overlap_b_f: false"),
])
def test_config_rule(pipeline: dict[str, Any], needs: str) -> None:
    from overlap_runtime.trainer import config_from_dict
    from overlap_runtime.config.train import ConfigError

    with pytest.raises(ConfigError, match=f"defer_expert_w=true needs .*{needs}"):
        config_from_dict(_cfg(**pipeline))
    config_from_dict(_cfg(schedule="zero_bubble"))  # the valid one passes


# ----------------------------------------------------------------------------- two EP ranks


def _delay_all_to_alls(seconds: float) -> None:
    """On this rank only, launch every all-to-all late: the peer's windows then open on an
    all-to-all that cannot have completed (a gloo collective reports ``is_completed()`` True as
    soon as it is done, so without a late peer a flush may find its window already closed)."""
    import time

    from overlap_runtime.ops import comm

    launch = comm.all_to_all_single

    def late(*args: Any, **kw: Any) -> Any:
        time.sleep(seconds)
        return launch(*args, **kw)

    comm.all_to_all_single = late  # this spawned process only


def _ep_windows(rank: int, world: int) -> dict[str, Any]:
    """Chunk = DeferredLinear -> MoE (shared expert), EP over both ranks. Microbatches F0, F1,
    I0, I1, F2 (+ a hand-made task before a combine); every W task is logged where it ran."""
    q = DeferredWQueue()
    runs: list[WRun] = []
    q.listeners.append(runs.append)

    def chunk(queue: DeferredWQueue | None) -> torch.nn.Sequential:
        torch.manual_seed(3)
        lin = (DeferredLinear(HIDDEN, HIDDEN, queue=queue) if queue is not None
               else torch.nn.Linear(HIDDEN, HIDDEN))
        moe = ExpertParallel(deferred_w=queue).apply(make_moe(), dist.group.WORLD)
        return torch.nn.Sequential(lin, moe)

    mine, ref = chunk(q), chunk(None)
    if rank == 1:
        _delay_all_to_alls(0.2)  # rank 0's windows are then deterministic
    assert find_deferred_w_queue(mine) is q and mine[1].dispatcher.deferred_w_queue is q
    xs = [tokens(rank, n=6, seed=s) for s in range(3)]
    outs = {m: mine(xs[m]) for m in (0, 1)}
    with q.capture(("s", 0)):
        objective(outs[0]).backward()
    after_i0 = [(r.key, r.during) for r in runs]
    with q.capture(("s", 1)):
        objective(outs[1]).backward()
    out2 = mine(xs[2])
    # combine fwd window: a task pending between dispatch and combine
    moe: MoE = mine[1]
    d = moe.dispatcher
    routing = moe.router(xs[0])
    permuted, tpe, meta = d.dispatch(xs[0], routing)
    y = moe.experts(permuted, tpe)
    with q.capture(("hand", 0)):
        q.push(lambda: None, what="marker")
    d.combine(y, meta)
    with q.capture(("s", 2)):
        objective(out2).backward()
    left = q.pending()
    q.drain()
    for m in range(3):
        objective(ref(xs[m])).backward()
    errs = {n: rel_l2(p.grad, dict(ref.named_parameters())[n].grad)
            for n, p in mine.named_parameters()}
    return {"runs": [(r.key, r.reason, r.during) for r in runs], "after_i0": after_i0,
            "left": left, "errs": errs}


TRAINER_PIPELINES = [{"schedule": "zero_bubble"}, {"schedule": "dualpipev", "virtual_stages": 2}]


@pytest.fixture(scope="module")
def runs() -> Iterator[Concurrently]:
    scenarios = {"ep_windows": lambda: run_ranks(_ep_windows, 2, timeout_s=200)}
    for i, pipeline in enumerate(TRAINER_PIPELINES):
        scenarios[f"trainer{i}"] = (lambda p=pipeline: run_ranks(_train_defer, 4, timeout_s=400,
                                                                 args=(_cfg(**p),)))
    with Concurrently(scenarios, max_workers=3) as started:
        yield started


def test_ep_w_tasks_run_inside_the_all_to_all_windows(runs: Concurrently) -> None:
    for rank, res in enumerate(runs.result("ep_windows")):
        assert max(res["errs"].values()) <= 1e-6, (rank, res["errs"])
        if rank == 1:  # the late rank: its all-to-alls may be complete when it looks
            continue
        runs = res["runs"]
        where = {(key, during) for key, reason, during in runs if reason == "window"}
        # I0: the experts' task ran in the layer's dispatch backward all-to-all (same walk),
        # the linear's (before the MoE, last in the walk) stays pending
        assert res["after_i0"] == [(("s", 0), "L0.dispatch bwd")], runs
        # I1: the linear's task of I0 runs in the first window of I1's walk: the combine bwd
        assert (("s", 0), "L0.combine bwd") in where, runs
        assert (("s", 1), "L0.dispatch bwd") in where, runs
        # F2: the linear's task of I1 runs while F2's dispatch all-to-all is in flight
        assert (("s", 1), "L0.dispatch fwd") in where, runs
        assert (("hand", 0), "L0.combine fwd") in where, runs
        assert all(reason == "window" for _, reason, _ in runs[:-1]), runs
        assert res["left"] == 1  # the linear's task of I2: the drain
        assert runs[-1][1] == "drain"


# ----------------------------------------------------------------------------- the trainer


def _train_defer(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from overlap_runtime.trainer import config_from_dict, train_distributed

    seen: dict[str, Any] = {}

    def on_model(pm: Any) -> None:
        seen["pm"] = pm
        seen["found"] = all(st.deferred_w is pm.deferred_w
                            for st in pm.schedule.stages.values())

        ep_ranks = {m.dispatcher.ep_rank for part in pm.parts.values()
                    for m in part.modules() if isinstance(m, MoE)}
        seen["ep_rank"] = ep_ranks.pop()
        # one expert W task per I (split backward) of a stage per MoE layer of that stage
        layers = {s: sum(isinstance(m, MoE) for m in part.modules())
                  for s, part in pm.parts.items()}
        subs = [x for a in pm.schedule.program
                for x in (a.sub_actions if a.is_compound else (a,))]
        seen["tasks_per_step"] = sum(layers[a.stage] for a in subs if str(a.kind) == "I")
        if seen["ep_rank"] == 1:
            _delay_all_to_alls(0.05)

    res = train_distributed(config_from_dict(cfg), torch.device("cpu"), log=lambda line: None,
                            on_model=on_model)
    pm = seen["pm"]
    return {"w_runs": dict(pm.w_runs), "pending": pm.deferred_w.pending(),
            "found": seen["found"], "ep_rank": seen["ep_rank"],
            "tasks": 2 * seen["tasks_per_step"],
            "losses": [s.loss for s in res.steps]}


@pytest.mark.parametrize("pipeline", TRAINER_PIPELINES)
def test_trainer_flushes_expert_w_in_the_windows(pipeline: dict[str, Any],
                                                 runs: Concurrently) -> None:
    out = runs.result(f"trainer{TRAINER_PIPELINES.index(pipeline)}")
    for rank, r in enumerate(out):
        assert r["found"] and r["pending"] == 0, (rank, r)
        # 2 steps x (MoE layers of the stage of each I action); zero_bubble: 4 I x 2 layers
        # per step; dualpipev splits only some backwards (the others are B: immediate W)
        assert r["tasks"] > 0 and sum(r["w_runs"].values()) == r["tasks"], (rank, r)
        if r["ep_rank"] == 0:  # on the ranks whose EP peer is late: all in the windows
            assert r["w_runs"].get("window", 0) == r["tasks"], (rank, r)
