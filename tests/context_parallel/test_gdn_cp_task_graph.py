"""The p2p GDN chain of the compiled step (one GDN layer, ``stepgraph.compile_step``), priced
with node costs (``gdn.step_costs``): validation and the simulator against the analytic chain."""

from __future__ import annotations


import pytest

from tests.support.step_configs import gdn_chain_config

from overlap_runtime.context_parallel.gdn.step_costs import (
    GDN_P2P_NODE_KINDS,
    chain_op_seconds,
)
from overlap_runtime.stepgraph.compose import compile_step
from overlap_runtime.stepgraph.pricing import predict_priced


def _chain_messages(step, name: str) -> list:
    return [p for p in step.matching.pairs if f"chain.{name}" in step.graph.task(p[0]).label]


def _op(rank: int, action: str, name: str, step) -> object:
    return next(t.id for t in step.graph.tasks()
                if t.rank == rank and t.meta.get("action") == action
                and t.meta["op"].name == name)


@pytest.mark.parametrize("cp", [1, 2, 3, 8, 16, 64])
def test_equal_costs_give_the_analytic_chain(cp: int) -> None:
    c, lat = 1.0, 0.25
    step = compile_step(gdn_chain_config(cp))
    # one H and one dH message per neighbour pair
    assert len(_chain_messages(step, "send_H")) == cp - 1
    assert len(_chain_messages(step, "send_dH")) == cp - 1
    pred = predict_priced(step, chain_op_seconds({k: c for k in GDN_P2P_NODE_KINDS}, cp,
                                                 message_s=lat))
    res = pred.result
    assert pred.step_s == pytest.approx((2 * cp + 1) * c + 2 * (cp - 1) * lat)
    # the chain: forward hops in rank order, then backward hops in reverse rank order
    by_id = {t.id: t for t in res.tasks}
    sends = [by_id[i] for i in res.critical_path if ".chain.send" in by_id[i].label]
    assert [(t.rank, t.meta["op"].name) for t in sends] == (
        [(r, "gdn.chain.send_H") for r in range(cp - 1)]
        + [(r, "gdn.chain.send_dH") for r in range(cp - 1, 0, -1)])
    costly = [by_id[i] for i in res.critical_path if by_id[i].cost]
    assert (costly[0].rank, costly[0].meta["op"].name) == (
        0, "gdn.prepare_summary" if cp > 1 else "gdn.core")
    assert (costly[-1].rank, costly[-1].meta["op"].name) == (
        0, "gdn.summary.bwd" if cp > 1 else "gdn.bwd")


def test_local_backward_runs_before_dh_arrives() -> None:
    """Rank r's local backward overlaps the backward chain: it ends before dH_out arrives, and
    only the hop (apply + message) stands between receiving dH_out and sending dH_in."""
    cp = 8
    costs = {"gdn_prepare": 4.0, "gdn_summary": 2.0, "gdn_apply": 0.1, "gdn_output": 5.0,
             "gdn_output_bwd": 10.0, "gdn_apply_bwd": 0.1, "gdn_summary_bwd": 3.0}
    step = compile_step(gdn_chain_config(cp))
    res = predict_priced(step, chain_op_seconds(costs, cp, message_s=0.05)).result
    at = {t.id: (s, e) for t, s, e in zip(res.tasks, res.start, res.end)}
    for r in range(1, cp - 1):
        out_b = at[_op(r, "0B0", "gdn.output.bwd", step)]
        recv = at[_op(r, "0B0", "gdn.chain.recv_dH", step)]
        send = at[_op(r, "0B0", "gdn.chain.send_dH", step)]
        assert out_b[1] <= recv[1]
        assert send[0] == pytest.approx(recv[1])
        assert send[1] - send[0] == pytest.approx(0.05 + (0.1 if r > 1 else 0.0))
    # forward: the output of rank r never delays the state it forwards
    for r in range(1, cp - 1):
        recv = at[_op(r, "0F0", "gdn.chain.recv_H", step)]
        send = at[_op(r, "0F0", "gdn.chain.send_H", step)]
        assert send[0] == pytest.approx(recv[1])
        assert at[_op(r, "0F0", "gdn.prepare_summary", step)][1] <= recv[1]


def test_cost_model_needs_every_kind() -> None:
    with pytest.raises(ValueError, match=r"no cost for node kinds \['gdn_apply_bwd'\]"):
        chain_op_seconds({k: 1.0 for k in GDN_P2P_NODE_KINDS if k != "gdn_apply_bwd"}, 2)
    with pytest.raises(ValueError, match=r"cp_size=0"):
        chain_op_seconds({k: 1.0 for k in GDN_P2P_NODE_KINDS}, 0)


FUSED_COSTS = {"layer_fwd": 3.0, "gdn_fwd_pre": 2.0, "gdn_fwd_chain": 0.125, "gdn_fwd_post": 1.5,
               "gdn_bwd_pre": 1.0, "gdn_bwd_chain": 0.25, "gdn_bwd_post": 4.0, "layer_bwd": 6.0}


@pytest.mark.parametrize("cp", [1, 2, 3, 8, 32])
def test_fused_chain_makespan_is_one_device_plus_a_hop_per_rank(cp: int) -> None:
    lat = 0.0625
    step = compile_step(gdn_chain_config(cp))
    pred = predict_priced(step, chain_op_seconds(FUSED_COSTS, cp, message_s=lat))
    one_device = sum(FUSED_COSTS.values())
    hop = FUSED_COSTS["gdn_fwd_chain"] + FUSED_COSTS["gdn_bwd_chain"] + 2 * lat
    assert pred.step_s == pytest.approx(one_device + (cp - 1) * hop)
    if cp == 1:  # nothing to overlap: the step is the sum of its ops
        assert pred.serial_s == pytest.approx(one_device)


def test_fused_cost_model_names_missing_kinds() -> None:
    partial = {k: v for k, v in FUSED_COSTS.items() if k != "gdn_bwd_chain"}
    with pytest.raises(ValueError, match=r"no cost for node kinds \['gdn_bwd_chain'\]"):
        chain_op_seconds(partial, 2)


def test_costs_of_another_mode_are_refused() -> None:
    data = gdn_chain_config(4).model_dump()
    data["train"]["accelerator"]["linear_attention_cp_mode"] = "all_gather"
    step = compile_step(type(gdn_chain_config(4)).model_validate(data))
    with pytest.raises(ValueError, match=r"op .gdn\.summary. .*not of the p2p chain"):
        predict_priced(step, chain_op_seconds(FUSED_COSTS, 4))
