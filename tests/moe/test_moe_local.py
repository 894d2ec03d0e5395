"""Single-process MoE tests: layer math, router loss, misuse errors, task-graph nodes, metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.moe import HIDDEN, make_chunk, make_moe, objective, tokens
from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.graph import simulate
from overlap_runtime.graph.comm_overlap import simulated_a2a_overlap
from overlap_runtime.moe import (GroupedExperts, MoENodeCosts, OverlapExpertParallel, TopKRouter,
                                 make_overlap_b_f_callback, moe_layer_task_graph,
                                 moe_overlap_pair_task_graph)
from overlap_runtime.moe.experts import grouped_mm_supported
from overlap_runtime.moe.parallel import infer_last_layer_flags
from overlap_runtime.schedules import ActionKind
from overlap_runtime.pipeline.exec_trace import TraceEvent
from overlap_runtime.schedules.ir import Action, parse_action
from overlap_runtime.testing import rel_l2
from overlap_runtime.trainer.a2a_overlap import trace_a2a_overlap


def _dense_reference(moe, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum_k score_k * expert_{i_k}(x) + shared(x); softmax in fp32 (in float64
    for a float64 layer: there everything is float64)."""
    gate = moe.router.gate(x)
    probs = torch.softmax(gate if x.dtype == torch.float64 else gate.float(), -1)
    scores, idx = torch.topk(probs, moe.router.top_k, -1)
    scores = scores / scores.sum(-1, keepdim=True)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(HIDDEN, dtype=x.dtype)
        for s, e in zip(scores[t], idx[t]):
            acc = acc + s * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
        rows.append(acc)
    out = torch.stack(rows)
    return out + moe.shared_expert(x) if moe.shared_expert is not None else out


@pytest.mark.parametrize("shared", [True, False])
def test_local_moe_equals_token_by_token_reference(shared: bool) -> None:
    moe = make_moe(shared=shared)
    x = tokens(0, 10).requires_grad_(True)
    out = moe(x)
    xr = x.detach().clone().requires_grad_(True)
    ref = _dense_reference(moe, xr)
    assert rel_l2(out, ref) <= 1e-6
    objective(out).backward()  # the aux loss is attached to out's graph with gradient 1
    got = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    (objective(ref) + moe.router(xr).aux_loss).backward()
    want = [xr.grad] + [p.grad for p in moe.parameters()]
    assert len(got) == len(want) and all(rel_l2(a, b) <= 1e-6 for a, b in zip(got, want))


def test_float64_layer_routes_and_combines_in_float64() -> None:
    """A float64 layer: router softmax, top-k scores, aux loss and the combine weighting in
    float64 (before: softmax and combine in fp32 inside the float64 layer, ~1e-7 off a float64
    reference), output and every gradient at float64 rounding."""
    moe = make_moe(shared=True).double()
    x = tokens(0, 10).double().requires_grad_(True)
    routing = moe.router(x)
    probs = torch.softmax(x.detach() @ moe.router.gate.weight.detach().T, -1)  # float64
    scores, idx = torch.topk(probs, moe.router.top_k, -1)
    scores = scores / scores.sum(-1, keepdim=True)
    assert routing.top_scores.dtype == torch.float64 and routing.aux_loss.dtype == torch.float64
    assert torch.equal(routing.top_indices, idx)
    assert rel_l2(routing.top_scores, scores) <= 1e-14
    out = moe(x)
    xr = x.detach().clone().requires_grad_(True)
    ref = _dense_reference(moe, xr)
    assert out.dtype == torch.float64 and rel_l2(out, ref) <= 1e-14
    objective(out).backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    (objective(ref) + moe.router(xr).aux_loss).backward()
    want = [xr.grad] + [p.grad for p in moe.parameters()]
    assert all(rel_l2(a, b) <= 1e-12 for a, b in zip(got, want))


def test_router_aux_loss_is_one_coef_for_a_uniform_router() -> None:
    router = TopKRouter(HIDDEN, 4, 2, aux_loss_coef=0.5)
    with torch.no_grad():
        router.gate.weight.zero_()
    probs = torch.full((8, 4), 0.25)
    idx = torch.tensor([[0, 1], [2, 3]] * 4)
    assert router.aux_loss(probs, idx).item() == pytest.approx(0.5)
    skew = torch.tensor([[0, 1]] * 8)
    probs_skew = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8)
    assert router.aux_loss(probs_skew, skew).item() == pytest.approx(0.5 * 4 * 0.5)
    res = router(tokens(0, 5))
    assert res.top_indices.shape == (5, 2) and res.top_scores.dtype == torch.float32
    assert torch.allclose(res.top_scores.sum(-1), torch.ones(5))
    with pytest.raises(ValueError, match="top_k=5"):
        TopKRouter(HIDDEN, 4, 5)


def test_grouped_mm_capability_is_checked_explicitly() -> None:
    ok, why = grouped_mm_supported("cpu", torch.bfloat16, 16, 16)
    assert not ok and "not cuda" in why
    experts = GroupedExperts(2, HIDDEN, 8, backend="grouped_mm")
    with pytest.raises(RuntimeError, match="not supported here"):
        experts(torch.randn(3, HIDDEN), torch.tensor([1, 2]))
    assert GroupedExperts(2, HIDDEN, 8).resolved_backend(torch.randn(1, HIDDEN)) == "loop"
    with pytest.raises(ValueError, match="summing to the 3 rows"):
        GroupedExperts(2, HIDDEN, 8)(torch.randn(3, HIDDEN), torch.tensor([1, 1]))


def test_dispatcher_misuse_is_loud() -> None:
    moe = make_moe(shared=False)
    d = moe.dispatcher
    x = tokens(0).requires_grad_(True)
    p, t, meta = d.dispatch(x, moe.router(x))
    y = moe.experts(p, t)
    h1, part1 = d.combine_start(y, meta)
    h2, part2 = d.combine_start(y, meta)
    with pytest.raises(ValueError, match="not the one combine_start returned"):
        d.combine_wait(h2, part1)
    d.combine_wait(h1, part1)
    with pytest.raises(RuntimeError, match="already waited"):
        d.combine_wait(h1, part1)
    with pytest.raises(ValueError, match="delivered 12 rows"):
        d.combine_start(y[:5], meta)
    with pytest.raises(ValueError, match="another dispatcher"):
        make_moe(shared=False).dispatcher.combine(y, meta)
    with pytest.raises(ValueError, match="routing is for 6 tokens"):
        d.dispatch(tokens(0, 7), moe.router(x))


def test_overlap_expert_parallel_configuration_errors() -> None:
    coord = HookCoordinator(timeout_s=5)
    with pytest.raises(ValueError, match="is for one MoE layer"):
        OverlapExpertParallel(coord, is_last_layer=True).apply(make_chunk(2), None)
    with pytest.raises(TypeError, match="HookCoordinator or CommComputeOverlap"):
        OverlapExpertParallel(object())  # type: ignore[arg-type]
    assert infer_last_layer_flags(make_chunk(2)) == [False, True]
    with pytest.raises(ValueError, match="contains no MoE"):
        OverlapExpertParallel(coord).apply(torch.nn.Linear(2, 2), None)


def test_callback_rejects_actions_that_are_not_one_f_and_one_b() -> None:
    with CommComputeOverlap(HookCoordinator(timeout_s=5)) as ov:
        cb = make_overlap_b_f_callback(ov, "cpu")
        with pytest.raises(ValueError, match="not OVERLAP_B_F"):
            cb(parse_action("0F1"), None)  # type: ignore[arg-type]
        bad = Action.compound(ActionKind.OVERLAP_B_F, parse_action("0F1"), parse_action("0F2"))
        with pytest.raises(ValueError, match="one forward and one backward"):
            cb(bad, None)  # type: ignore[arg-type]


def test_layer_graph_predicts_the_shared_expert_overlap_exactly() -> None:
    costs = MoENodeCosts(attn=1.0, experts=2.0, shared_expert=1.5, dispatch=0.5, combine=1.0)
    serial = simulate(moe_layer_task_graph(2, costs, overlap=False))
    overlapped = simulate(moe_layer_task_graph(2, costs, overlap=True))
    assert serial.makespan == pytest.approx(1 + 0.5 + 2 + 1 + 1.5)
    assert overlapped.makespan == pytest.approx(1 + 0.5 + 2 + max(1.0, 1.5))
    # dispatch is exposed in both; the combine (1.0) is hidden under the shared expert
    assert simulated_a2a_overlap(overlapped).share == pytest.approx(1.0 / 1.5)
    assert simulated_a2a_overlap(serial).share == pytest.approx(0.0)


def test_pair_graph_follows_the_coordinator_order_and_beats_serial() -> None:
    # the launch order itself: tests/schedules/test_overlap_order.py
    costs = MoENodeCosts(attn=1.0, experts=1.0, shared_expert=0.5, dispatch=1.0, combine=1.0)
    g = moe_overlap_pair_task_graph(costs, layers=2, ep_size=2)
    g.validate()
    ov = simulate(g)
    se = simulate(moe_overlap_pair_task_graph(costs, layers=2, ep_size=2, overlap=False))
    c = costs.resolved()
    per_chunk_f = 2 * (c.attn + c.dispatch + c.experts + max(c.combine, c.shared_expert))
    per_chunk_b = 2 * (c.combine_bwd + c.shared_expert_bwd + c.experts_bwd + c.dispatch_bwd
                       + c.attn_bwd)  # backward all-to-alls block their thread
    assert se.makespan == pytest.approx(per_chunk_f + per_chunk_b)
    assert ov.makespan < se.makespan
    assert simulated_a2a_overlap(ov).share > simulated_a2a_overlap(se).share


def _ev(thread: str, name: str, cat: str, a: int, b: int, rank: int = 0) -> TraceEvent:
    return TraceEvent(rank, thread, name, cat, a, b)


def test_measured_overlap_counts_only_the_other_threads_compute() -> None:
    events = [
        _ev("main", "(0B0;0F1)OVERLAP_B_F", "compound", 0, 100),
        _ev("main", "0F1", "compute", 0, 100),
        _ev("main", "S0.L0.dispatch fwd", "a2a", 10, 30),      # 20 ns in flight
        _ev("worker", "0B0", "compute", 0, 100),
        _ev("worker", "S0.L0.D bwd", "hook", 0, 20),           # worker idle until 20
        _ev("worker", "S0.L0.combine bwd", "a2a", 40, 60),     # main computes 40..60
        _ev("main", "S0.L1.dispatch fwd", "a2a", 150, 160),    # outside the compound step
    ]
    m = trace_a2a_overlap(events, paired_only=True).to_dict(1e-9)
    # dispatch: covered 20..30 = 10 of 20; combine bwd: 40..60 fully = 20 of 20
    assert m["count"] == 2 and m["share"] == pytest.approx(30 / 40)
    m_all = trace_a2a_overlap(events).to_dict(1e-9)
    assert m_all["count"] == 3 and m_all["share"] == pytest.approx(30 / 50)
