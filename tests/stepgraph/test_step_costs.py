"""Cost models of the step graph: alpha-beta links and collectives by placement, node costs
measured from traces (waits taken out), the shared-core simulation and its inverse, the
coordinator's hand-over edges, the step graph over priced op sources (per rank, one rank per
pipeline coordinate). Pure Python, no ranks."""

from __future__ import annotations

import pytest

from tests.support.step_configs import gdn_chain_config, moe_config

from overlap_runtime.graph import Task, TaskGraph
from overlap_runtime.graph.simulate import simulate
from overlap_runtime.pipeline.exec_trace import TraceEvent
from overlap_runtime.stepgraph.compose import compile_step
from overlap_runtime.stepgraph.costs import Link, h200_profile, measured_costs, split_busy
from overlap_runtime.stepgraph.layer_program import LayerOp
from overlap_runtime.stepgraph.overlap_edges import overlap_edges
from overlap_runtime.stepgraph.pricing import priced_op
from overlap_runtime.stepgraph.shared_cores import simulate_shared_cores, work_of_spans


def test_alpha_beta_and_placement() -> None:
    h = h200_profile()
    assert Link("x", 1e-5, 1e9).time(1e6) == pytest.approx(1e-5 + 1e-3)
    assert h.nodes_spanned(8) == 1 and h.nodes_spanned(16) == 2 and h.nodes_spanned(4, 8) == 4
    assert h.link(8) is h.intra and h.link(2, 8) is h.inter
    n = 64e6
    intra = h.all_to_all(n, 8)
    assert intra == pytest.approx(h.intra.time(n * 7 / 8))
    # 16 ranks over 2 nodes: half of every buffer leaves the node, over the slower link
    assert h.all_to_all(n, 16) == pytest.approx(h.inter.time(n / 2) + h.inter.latency_s)
    assert h.all_to_all(n, 1) == 0.0 and h.all_gather(n, 4) == pytest.approx(3 * h.intra.time(n))
    with pytest.raises(ValueError, match="no throughput for op class 'tensor'"):
        h.compute(1.0, "tensor")


def test_measured_costs_take_the_waits_out_of_the_actions() -> None:
    """Stage 1's F spans 10 ms of which 6 wait for its input: it costs 4; its all-to-all
    inside the B is counted as the action's message, not its compute."""
    ms = 1_000_000
    step = [TraceEvent(1, "main", "1F0", "compute", 0, 10 * ms),
            TraceEvent(1, "main", "wait 1RECV_F0", "comm", 0, 6 * ms),
            TraceEvent(1, "main", "1B0", "compute", 10 * ms, 20 * ms),
            TraceEvent(1, "main", "S1.L0.combine bwd", "a2a", 12 * ms, 15 * ms),
            TraceEvent(0, "main", "0F0", "compute", 0, 5 * ms)]
    assert split_busy(step)[(1, "main", "1F0")] == pytest.approx(4e-3)
    c = measured_costs([step, step])
    assert c.cost(1, "F") == pytest.approx(4e-3) and c.cost(1, "B") == pytest.approx(7e-3)
    assert c.cost(0, "F") == pytest.approx(5e-3)
    assert c.a2a[(1, "B", False)] == (1, pytest.approx(3e-3))
    with pytest.raises(KeyError, match="no measured cost for W of stage 0"):
        c.cost(0, "W")
    assert c.gap_s == 0.0  # every rank's spans cover its step
    # rank 0 idles 2 ms between its two steps that no span covers: the runtime's 1 ms a step
    gap = [TraceEvent(0, "main", "0F0", "compute", 0, 5 * ms),
           TraceEvent(0, "main", "0F1", "compute", 7 * ms, 12 * ms)]
    assert measured_costs([gap]).gap_s == pytest.approx(1e-3)


def _two_ranks(work: float) -> TaskGraph:
    g = TaskGraph("two")
    g.add_tasks([Task("a", 0, "compute", "F", cost=work), Task("b", 1, "compute", "F", cost=work)])
    return g


def test_shared_cores_stretch_and_their_inverse() -> None:
    """Two ranks of 1 s work on one core: both run at half speed, 2 s each; with two cores (or
    the list scheduler) 1 s. From the stretched spans, work_of_spans recovers 1 s each."""
    res = simulate_shared_cores(_two_ranks(1.0), 1)
    assert res.makespan == pytest.approx(2.0) and res.bubble_ratio == pytest.approx(0.0)
    assert simulate_shared_cores(_two_ranks(1.0), 2).makespan == pytest.approx(1.0)
    assert simulate(_two_ranks(1.0)).makespan == pytest.approx(1.0)
    # a representative rank standing for 3 ranks on 2 cores: rate 2/3
    g = TaskGraph("one")
    g.add_task(Task("a", 0, "compute", "F", cost=1.0))
    assert simulate_shared_cores(g, 2, {0: 3}).makespan == pytest.approx(1.5)
    spans = {"a": [(0.0, 2.0)], "b": [(0.0, 2.0)]}
    assert work_of_spans(spans, 1) == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}
    # rank b busy only half the time: a's first second ran at 1/2, its second at full speed
    work = work_of_spans({"a": [(0.0, 2.0)], "b": [(0.0, 1.0)]}, 1)
    assert work["a"] == pytest.approx(1.5) and work["b"] == pytest.approx(0.5)
    # two threads of one rank take turns (one interpreter lock), even with a core to spare
    work = work_of_spans(spans, 2, {"a": (0, "main"), "b": (0, "bwd")})
    assert work == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}


def test_handover_edges_alternate_the_comm_token_backward_first() -> None:
    """fwd: c0 d c1 k c2, bwd: c0' k' c1' d' c2'. Token: k' -> d -> d' -> k; each compute after
    a comm waits for the peer's launch of its next comm (the op before it)."""
    def side(names: list[str]) -> list[tuple[str, LayerOp]]:
        return [(n, priced_op(n, "a2a", 1.0, group="ep", group_size=2) if n in "dk" or
                 n in ("kb", "db") else priced_op(n, "F", 1.0)) for n in names]

    fwd = side(["c0", "d", "c1", "k", "c2"])
    bwd = side(["b0", "kb", "b1", "db", "b2"])
    launch, waits = overlap_edges(fwd, bwd, hook_waits=True)
    assert launch == ["kb", "d", "db", "k"]  # the token hand-overs: consecutive launches
    edges = set(zip(launch, launch[1:])) | set(waits)
    assert {("kb", "d"), ("d", "db"), ("db", "k")} <= edges
    assert ("c0", "b1") in edges  # bwd computes after fwd launched d (fwd's c0 done)
    assert ("b1", "c1") in edges  # fwd computes after bwd launched db
    assert ("c1", "b2") in edges
    assert not any(v == "c2" for _, v in edges)  # the last comm: the peer has departed
    # the conformance graph keeps the launch order only
    assert overlap_edges(fwd, bwd, hook_waits=False) == (launch, [])


def test_a_forward_dispatch_is_one_comm_region_with_its_counts() -> None:
    """Hooks A -> B bracket the counts and the tokens all-to-all: one turn of the token, and
    the experts after it wait for the backward side's next launch."""
    from overlap_runtime.stepgraph.layer_program import layer_program

    config = moe_config(ep=2, layers=2)
    fwd = [(f"f.{o.name}", o) for o in layer_program(config, 0, "F")]
    bwd = [(f"b.{o.name}", o) for o in layer_program(config, 1, "B")]
    launch, waits = overlap_edges(fwd, bwd, hook_waits=True)
    assert launch == ["b.moe.combine.bwd", "f.moe.dispatch_counts", "f.moe.dispatch",
                      "b.moe.dispatch.bwd", "f.moe.combine"]
    assert waits == [("f.moe.router", "b.moe.experts.bwd"),  # fwd launched counts + dispatch
                     ("b.moe.shared_expert.bwd", "f.moe.experts"),  # bwd launched dispatch.bwd
                     ("f.moe.experts", "b.moe.router.bwd")]  # fwd launched its combine
    # a longer backward side: the forward's last region (D_LAST) still hands over without
    # waiting, while the backward drains its two remaining regions alone
    longer = bwd + [(f"b0.{o.name}", o) for o in layer_program(config, 0, "B")]
    launch, waits = overlap_edges(fwd, longer, hook_waits=True)
    assert launch[-3:] == ["f.moe.combine", "b0.moe.combine.bwd", "b0.moe.dispatch.bwd"]
    assert [v for _, v in waits] == ["b.moe.experts.bwd", "f.moe.experts", "b.moe.router.bwd"]
    # a combine that is not the forward's last: its region ends at its wait (hook D), so the
    # shared expert runs inside it and moe.combine_wait is what waits for the peer
    two = fwd + [(f"f1.{o.name}", o) for o in layer_program(config, 1, "F")]
    _, waits = overlap_edges(two, longer, hook_waits=True)
    before = longer[[i for i, _ in longer].index("b0.moe.combine.bwd") - 1][0]
    assert (before, "f.moe.combine_wait") in waits  # after bwd launched its next combine
    assert not any(v == "f.moe.shared_expert" for _, v in waits)


def test_per_rank_op_source_and_ep_rendezvous() -> None:
    """pp2 x 2 inner ranks: an op source is asked once per global rank (its own op costs);
    its all-to-all is a collective of its EP pair, so the fast peer waits for the slow one."""
    seen: list[int] = []

    def ops(t: Task, rank: int) -> list[tuple[None, LayerOp]]:
        seen.append(rank)
        slow = 3.0 if rank == 1 else 1.0  # global rank 1: the slow EP peer of rank 0
        return [(None, priced_op("c", t.kind, slow)),
                (None, priced_op("a2a", "a2a", 0.5, group="ep", group_size=2)),
                (None, priced_op("c2", t.kind, 1.0))]

    g = compile_step(moe_config(pp=2, ep=2, layers=2, microbatches=2), ops=ops,
                     message_cost=lambda t: 0.0, async_p2p=True).graph
    assert sorted(set(seen)) == [0, 1, 2, 3]
    assert g.task((0, "0F0", 1)).comm.key == "ep[0,1]"  # type: ignore[union-attr]
    res = simulate(g)
    start = dict(zip([t.id for t in res.tasks], res.start))
    # rank 0's first all-to-all starts when rank 1 (3 s of compute) reaches it, not at 1 s
    assert start[(0, "0F0", 1)] == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"priced for a group of 4 but its ep group ep\[0,1\]"):
        compile_step(moe_config(pp=2, ep=2, layers=2, microbatches=2), validate=False,
                     ops=lambda t, r: [(None, priced_op("a2a", "a2a", 0.5, group="ep",
                                                        group_size=4))])


def test_representative_builds_one_rank_per_pipeline_coordinate() -> None:
    """``representative``: only inner index 0 of each pp rank, each collective a group of one
    (ep[0]) carrying the full group's cost; a message to a peer is refused (no peer built)."""
    config = moe_config(pp=2, ep=2, layers=2, microbatches=2)

    def ops(t: Task, rank: int) -> list[tuple[None, LayerOp]]:
        return [(None, priced_op("c", t.kind, 1.0)),
                (None, priced_op("a2a", "a2a", 0.5, group="ep", group_size=2))]

    full = compile_step(config, ops=ops, message_cost=lambda t: 0.0)
    rep = compile_step(config, ops=ops, message_cost=lambda t: 0.0, representative=True)
    assert rep.dims_ranks() == [0, 2] and full.dims_ranks() == [0, 1, 2, 3]
    assert rep.graph.ranks == [0, 2] and 2 * len(rep.graph) == len(full.graph)
    a2a = [t for t in rep.graph.tasks() if t.lane == "comm:ep"]
    assert {t.comm.key for t in a2a} == {"ep[0]", "ep[2]"}  # type: ignore[union-attr]
    assert all(t.cost == 0.5 for t in a2a)  # the cost of the whole group's all-to-all
    assert simulate(rep.graph).makespan == pytest.approx(simulate(full.graph).makespan)
    with pytest.raises(ValueError, match=r"a send to a peer has no peer in a representative"):
        compile_step(gdn_chain_config(2), representative=True)
