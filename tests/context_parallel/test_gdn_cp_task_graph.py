"""The p2p GDN chain as a task graph: validation and the simulator against the analytic chain."""

from __future__ import annotations

import pytest

from overlap_runtime.context_parallel.gdn.task_graph import (
    GDN_P2P_NODE_KINDS,
    gdn_p2p_cost_model,
    gdn_p2p_task_graph,
    simulate_gdn_p2p,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 8, 16, 64])
def test_equal_costs_give_the_analytic_chain(cp: int) -> None:
    c, lat = 1.0, 0.25
    costs = gdn_p2p_cost_model({k: c for k in GDN_P2P_NODE_KINDS}, comm_latency=lat)
    graph = gdn_p2p_task_graph(cp)
    matching = graph.validate()
    assert len(matching.pairs) == 2 * (cp - 1)  # one H and one dH message per neighbour pair
    res = simulate_gdn_p2p(cp, costs)
    assert res.makespan == pytest.approx((2 * cp + 1) * c + 2 * (cp - 1) * lat)
    path = res.critical_path
    # the chain: forward applies in rank order, then backward applies in reverse rank order
    applies = [t for t in path if t.endswith("F.apply") or t.endswith("B.apply")]
    expected = [f"{r}F.apply" for r in range(1, cp - 1)] + [
        f"{r}B.apply" for r in range(cp - 2, 0, -1)
    ]
    assert applies == expected
    assert path[0] == "0F.prepare"
    assert path[-1] == ("0B.summary" if cp > 1 else "0B.output")


def test_local_backward_runs_before_dh_arrives() -> None:
    """Rank r's local backward overlaps the backward chain: it ends before dH_out arrives, and
    only apply + send stand between receiving dH_out and sending dH_in."""
    cp = 8
    costs = gdn_p2p_cost_model(
        {"gdn_prepare": 4.0, "gdn_summary": 2.0, "gdn_apply": 0.1, "gdn_output": 5.0,
         "gdn_output_bwd": 10.0, "gdn_apply_bwd": 0.1, "gdn_summary_bwd": 3.0},
        comm_latency=0.05,
    )
    res = simulate_gdn_p2p(cp, costs)
    at = {e.id: e for e in res.entries}
    for r in range(1, cp - 1):
        assert at[f"{r}B.output"].end <= at[f"{r}B.recv_dH"].end
        assert at[f"{r}B.send_dH"].start == pytest.approx(at[f"{r}B.recv_dH"].end + 0.1)
    # forward: the output of rank r never delays the state it forwards
    for r in range(1, cp - 1):
        assert at[f"{r}F.send_H"].start == pytest.approx(at[f"{r}F.recv_H"].end + 0.1)


def test_cost_model_needs_every_kind() -> None:
    with pytest.raises(ValueError, match=r"no cost for node kinds \['gdn_apply_bwd'\]"):
        gdn_p2p_cost_model({k: 1.0 for k in GDN_P2P_NODE_KINDS if k != "gdn_apply_bwd"})
    with pytest.raises(ValueError, match=r"cp_size=0"):
        gdn_p2p_task_graph(0)


FUSED_COSTS = {"layer_fwd": 3.0, "gdn_fwd_pre": 2.0, "gdn_fwd_chain": 0.125, "gdn_fwd_post": 1.5,
               "gdn_bwd_pre": 1.0, "gdn_bwd_chain": 0.25, "gdn_bwd_post": 4.0, "layer_bwd": 6.0}


@pytest.mark.parametrize("cp", [1, 2, 3, 8, 32])
def test_fused_chain_makespan_is_one_device_plus_a_hop_per_rank(cp: int) -> None:
    from overlap_runtime.context_parallel.gdn.task_graph import gdn_p2p_fused_task_graph

    lat = 0.0625
    costs = gdn_p2p_cost_model(FUSED_COSTS, comm_latency=lat)
    graph = gdn_p2p_fused_task_graph(cp)
    assert len(graph.validate().pairs) == 2 * (cp - 1)
    res = simulate_gdn_p2p(cp, costs, fused=True)
    one_device = sum(FUSED_COSTS.values())
    hop = FUSED_COSTS["gdn_fwd_chain"] + FUSED_COSTS["gdn_bwd_chain"] + 2 * lat
    assert res.makespan == pytest.approx(one_device + (cp - 1) * hop)
    path = res.critical_path
    # forward chains in rank order, then backward chains in reverse rank order
    chains = [t for t in path if t.endswith(".chain")]
    assert chains == [f"{r}F.chain" for r in range(cp)] + [f"{r}B.chain"
                                                          for r in range(cp - 1, -1, -1)]


def test_fused_cost_model_names_missing_kinds() -> None:
    partial = {k: v for k, v in FUSED_COSTS.items() if k != "gdn_bwd_chain"}
    with pytest.raises(ValueError, match=r"no cost for node kinds \['gdn_bwd_chain'\]"):
        gdn_p2p_cost_model(partial)
