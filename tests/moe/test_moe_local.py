"""Single-process MoE tests: layer math, router loss, misuse errors, the compiled step priced,
metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.moe import HIDDEN, make_chunk, make_moe, objective, tokens
from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.graph.comm_overlap import simulated_a2a_overlap
from overlap_runtime.moe import (GroupedExperts, OverlapExpertParallel, TopKRouter,
                                 make_overlap_b_f_callback)
from overlap_runtime.moe.experts import grouped_mm_supported
from overlap_runtime.moe.parallel import infer_last_layer_flags
from overlap_runtime.schedules import ActionKind
from overlap_runtime.pipeline.exec_trace import TraceEvent
from overlap_runtime.schedules.ir import Action, parse_action, parse_compute_action
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


def _compiled(**kw):  # a compiled step of a small MoE config (tests/support/step_configs.py)
    import sys
    from pathlib import Path

    from tests.support.step_configs import moe_config

    from overlap_runtime.stepgraph.compose import compile_step

    return compile_step(moe_config(**kw))


def test_layer_graph_predicts_the_shared_expert_overlap_exactly() -> None:
    from overlap_runtime.stepgraph.pricing import by_op_name, predict_priced

    # one MoE layer's forward on 2 EP ranks, the backward free
    costs = {"attn.core": 1.0, "moe.experts": 2.0, "moe.shared_expert": 1.5,
             "moe.dispatch": 0.5, "moe.combine": 1.0}
    pred = predict_priced(_compiled(ep=2, layers=1), by_op_name(costs, default=0.0))
    assert pred.serial_s == pytest.approx(1 + 0.5 + 2 + 1 + 1.5)
    assert pred.step_s == pytest.approx(1 + 0.5 + 2 + max(1.0, 1.5))
    # dispatch is exposed; the combine (1.0) is hidden under the shared expert
    assert simulated_a2a_overlap(pred.result).share == pytest.approx(1.0 / 1.5)
    assert simulated_a2a_overlap(pred.result, paired_only=True).share == 0.0  # no OVERLAP_B_F


PAIR_COSTS = {"attn.core": 1.0, "moe.experts": 1.0, "moe.shared_expert": 0.5,
              "moe.dispatch": 1.0, "moe.combine": 1.0, "attn.bwd": 2.0, "moe.experts.bwd": 2.0,
              "moe.shared_expert.bwd": 1.0, "moe.dispatch.bwd": 1.0, "moe.combine.bwd": 1.0}


def test_pair_graph_follows_the_coordinator_order_and_beats_serial() -> None:
    # the launch order itself: tests/schedules/test_overlap_order.py, tests/stepgraph
    from overlap_runtime.stepgraph.pricing import by_op_name, predict_priced

    kw = dict(pp=2, ep=2, layers=4, virtual_stages=2, microbatches=4)
    price = by_op_name(PAIR_COSTS, default=0.0)
    ov = predict_priced(_compiled(overlap_b_f=True, **kw), price)
    se_step = _compiled(overlap_b_f=False, **kw)
    se = predict_priced(se_step, price)
    # serial: each action runs its ops back to back (the backward all-to-alls block their
    # thread), the combine beside the shared expert
    c = PAIR_COSTS
    per_f = c["attn.core"] + c["moe.dispatch"] + c["moe.experts"] + max(c["moe.combine"],
                                                                        c["moe.shared_expert"])
    per_b = sum(c[k] for k in c if k.endswith(".bwd"))
    at = {t.id: (s, e) for t, s, e in zip(se.result.tasks, se.result.start, se.result.end)}
    for rank, acts in se_step.actions.items():
        for action, ids in acts.items():
            parsed = parse_compute_action(action)
            if parsed is None:  # a pipeline message
                continue
            layers = len(se_step.stage_layers[parsed[0]])
            span = max(at[i][1] for i in ids) - min(at[i][0] for i in ids)
            assert span == pytest.approx(layers * (per_f if parsed[1] == "F" else per_b)), action
    assert ov.step_s < se.step_s
    assert simulated_a2a_overlap(ov.result, paired_only=True).share > 0.0
    assert simulated_a2a_overlap(ov.result).share > simulated_a2a_overlap(se.result).share


def test_op_costs_from_a_trace_price_each_action_to_its_measured_span() -> None:
    from overlap_runtime.moe.step_costs import moe_op_seconds, op_costs_from_trace
    from overlap_runtime.stepgraph.pricing import predict_priced, price_step

    ev = lambda name, cat, a, b: TraceEvent(0, "main", name, cat, a, b)  # noqa: E731
    events = [ev("0F0", "compute", 0, 1000), ev("S0.L0.dispatch fwd", "a2a", 100, 200),
              ev("S0.L0.experts", "moe_compute", 200, 400),
              ev("S0.L0.combine fwd", "a2a", 400, 600),  # the shared expert runs inside it
              ev("S0.L0.shared_expert", "moe_compute", 400, 500),
              ev("0B0", "compute", 1000, 3000), ev("S0.L0.combine bwd", "a2a", 1100, 1200),
              ev("S0.L0.dispatch bwd", "a2a", 1500, 1600)]
    costs = op_costs_from_trace(events, {0: 1})
    ns = 1e-9
    assert (costs.dispatch, costs.combine, costs.experts, costs.shared_expert) == pytest.approx(
        (100 * ns, 100 * ns, 200 * ns, 100 * ns))
    # F: 1000 less its all-to-alls (300) less the experts (200); B: 2000 - 200 - 2 x 300
    assert costs.rest == {(0, "F"): pytest.approx(500 * ns), (0, "B"): pytest.approx(1200 * ns)}
    step = _compiled(ep=2, layers=1)
    priced = price_step(step, moe_op_seconds(costs, step))
    for action, span in (("0F0", 1000), ("0B0", 2000)):  # every measured nanosecond priced once
        assert sum(priced.task(i).cost for i in step.actions[0][action]) == pytest.approx(
            span * ns)
    # simulated: the combine (100) hidden behind the shared expert (100)
    assert predict_priced(step, moe_op_seconds(costs, step)).step_s == pytest.approx(2900 * ns)
    with pytest.raises(ValueError, match=r"no F or B action span"):
        op_costs_from_trace(events[1:5] + events[6:], {0: 1})


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
