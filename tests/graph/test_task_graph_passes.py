"""The generic task graph: building, matching, deadlock proof, simulation, traces, grids.

These graphs are hand-built (no pipeline schedule) to show the graph is not pipeline-specific.
"""

from __future__ import annotations

import json

import pytest

from overlap_runtime.graph import (
    CollectiveOrderError,
    CommInfo,
    CostModel,
    DeadlockError,
    Task,
    TaskGraph,
    UnmatchedCommError,
    chrome_trace,
    format_grid,
    format_timeline,
    simulate,
    validate_graph,
    write_chrome_trace,
)


def two_rank_exchange(send_first_on_both: bool) -> TaskGraph:
    """Rank 0 computes a, sends it, receives b; rank 1 computes b, then receives a and sends b
    (or sends first, which deadlocks under blocking sends)."""
    g = TaskGraph("exchange")
    g.add_tasks([
        Task("a", 0, "compute", "F", step=0),
        Task("send_a", 0, "comm", "send", comm=CommInfo("send", "a", peer=1, nbytes=100), step=1),
        Task("recv_b", 0, "comm", "recv", comm=CommInfo("recv", "b", peer=1), step=2),
        Task("use_b", 0, "compute", "F", step=3),
        Task("b", 1, "compute", "F", step=0),
        Task("recv_a", 1, "comm", "recv", comm=CommInfo("recv", "a", peer=0),
             step=2 if send_first_on_both else 1),
        Task("send_b", 1, "comm", "send", comm=CommInfo("send", "b", peer=0, nbytes=100),
             step=1 if send_first_on_both else 2),
        Task("use_a", 1, "compute", "F", step=3),
    ])
    order1 = ["send_b", "recv_a"] if send_first_on_both else ["recv_a", "send_b"]
    g.add_edges([("a", "use_b"), ("send_a", "recv_b"), ("b", "use_a"), (order1[0], order1[1])],
                "program")
    g.add_edges([("a", "send_a"), ("recv_b", "use_b"), ("b", "send_b"), ("recv_a", "use_a")],
                "data")
    g.add_edges([("send_a", "recv_a"), ("send_b", "recv_b")], "match")
    return g


def test_building_rules() -> None:
    g = TaskGraph()
    g.add_task(Task("x", 0, "compute", "F"))
    with pytest.raises(ValueError, match="task id 'x' .* is already in the graph"):
        g.add_task(Task("x", 1, "compute", "F"))
    with pytest.raises(KeyError, match="task 'y' is not in the graph"):
        g.add_edge("x", "y")
    with pytest.raises(ValueError, match="edge kind 'control' is not one of"):
        g.add_edge("x", "x", kind="control")
    g.add_task(Task("y", 0, "compute", "B"))
    g.add_edge("x", "y", "program")
    g.add_edge("x", "y", "data")
    assert g.edge_kinds("x", "y") == ["program", "data"]
    view = g.nx
    assert view.edges["x", "y"]["kinds"] == ("program", "data")
    assert view.nodes["y"]["task"].kind == "B"
    assert g.lanes() == {0: ["compute"]}


def test_valid_exchange_simulates_with_latency_and_bandwidth() -> None:
    g = two_rank_exchange(send_first_on_both=False)
    matching = validate_graph(g)
    assert sorted(matching.pairs) == [("send_a", "recv_a"), ("send_b", "recv_b")]
    costs = CostModel(F=1.0, comm_latency=0.5, comm_bandwidth=100.0)  # a message takes 1.5
    r = simulate(g, costs)
    t = {e.id: (e.start, e.end) for e in r.entries}
    assert t["a"] == (0.0, 1.0) and t["b"] == (0.0, 1.0)
    assert t["send_a"] == (1.0, 2.5)          # rank 1 posted its receive at t=1
    assert t["recv_a"] == (1.0, 2.5)          # a receive spans the transfer it waits for
    assert t["send_b"] == (2.5, 4.0)          # behind recv_a on rank 1's comm lane
    assert t["use_a"] == (2.5, 3.5)
    assert t["use_b"] == (4.0, 5.0)
    assert r.makespan == 5.0
    # rank 0 computes 2 of 5 time units; comm [1, 4] is exposed on rank 0 (idle meanwhile)
    assert r.busy_by_rank == {0: 2.0, 1: 2.0}
    assert r.bubble_ratio == pytest.approx(1 - 4 / 10)
    assert r.exposed_comm_by_rank[0] == pytest.approx(3.0)
    assert r.exposed_comm_by_rank[1] == pytest.approx(3.0 - 1.0)  # use_a hides [2.5, 3.5]
    assert r.critical_path[-1] == "use_b" and r.critical_path[0] in ("a", "b")


def test_blocking_sends_that_meet_head_on_deadlock() -> None:
    g = two_rank_exchange(send_first_on_both=True)
    # rank 0 sends then receives; rank 1 now also sends then receives
    with pytest.raises(DeadlockError) as info:
        validate_graph(g)
    msg = str(info.value)
    assert set(info.value.cycle) == {"send_a", "send_b"}
    assert "cycle: send_" in msg and "rendezvous" in msg
    assert "*send_a*" in msg and "*send_b*" in msg  # the grid built from task steps
    with pytest.raises(DeadlockError):
        simulate(g)


def test_unmatched_send_and_receive() -> None:
    g = TaskGraph()
    g.add_tasks([Task("s", 0, "comm", "send", comm=CommInfo("send", "k1", peer=1), step=0),
                 Task("r", 1, "comm", "recv", comm=CommInfo("recv", "k2", peer=0), step=0)])
    with pytest.raises(UnmatchedCommError) as info:
        validate_graph(g)
    msg = str(info.value)
    assert "send s (rank 0, lane comm, step 0) has no matching receive (key 'k1')" in msg
    assert "receive r (rank 1, lane comm, step 0) has no matching send (key 'k2')" in msg
    g2 = TaskGraph()
    g2.add_tasks([Task("s", 0, "comm", "send", comm=CommInfo("send", "k", peer=2)),
                  Task("r", 1, "comm", "recv", comm=CommInfo("recv", "k"))])
    with pytest.raises(UnmatchedCommError, match="targets rank 2 but its receive"):
        validate_graph(g2)


def moe_like_graph(order_rank1: list[str]) -> TaskGraph:
    """Two ranks each issue two all-to-alls on group 'ep' (dispatch, combine) around an expert
    computation: a stand-in for the MoE nodes a later issue adds."""
    g = TaskGraph("moe")
    for rank, order in ((0, ["dispatch", "combine"]), (1, order_rank1)):
        prev = None
        for step, name in enumerate([order[0], "expert", order[1]]):
            lane = "compute" if name == "expert" else "comm:ep"
            comm = None if name == "expert" else CommInfo("collective", "ep", nbytes=1000)
            tid = f"{name}@{rank}"
            g.add_task(Task(tid, rank, lane, name, comm=comm, step=step, cost=None))
            if prev is not None:
                g.add_edge(prev, tid, "program")
            prev = tid
    return g


def test_collectives_in_the_same_order_simulate() -> None:
    g = moe_like_graph(["dispatch", "combine"])
    matching = validate_graph(g)
    assert sorted(sorted(c) for c in matching.collectives) == [
        ["combine@0", "combine@1"], ["dispatch@0", "dispatch@1"]]
    r = simulate(g, CostModel(comm_latency=1.0, kinds={"expert": 2.0}))
    assert r.makespan == pytest.approx(4.0)
    assert r.exposed_comm == pytest.approx(2.0)


def test_collectives_in_different_orders_are_rejected() -> None:
    g = moe_like_graph(["combine", "dispatch"])
    with pytest.raises(CollectiveOrderError) as info:
        validate_graph(g)
    assert "collective #0 on group 'ep' differs between ranks (rank 0: dispatch, rank 1: combine)" \
        in str(info.value)


def test_two_threads_share_the_device() -> None:
    """Tasks on lanes 'fwd' and 'bwd' of one rank take turns; a comm lane runs beside them."""
    g = TaskGraph()
    g.add_tasks([Task("f", 0, "fwd", "F"), Task("b", 0, "bwd", "B"),
                 Task("c", 0, "comm:ep", "a2a", cost=1.5,
                      comm=CommInfo("collective", "solo"))])
    r = simulate(g, CostModel(F=1.0, B=2.0))
    t = {e.id: (e.start, e.end) for e in r.entries}
    assert sorted([t["f"], t["b"]]) == [(0.0, 1.0), (1.0, 3.0)]
    assert t["c"] == (0.0, 1.5)
    assert r.makespan == 3.0 and r.exposed_comm == 0.0


def test_missing_cost_is_named() -> None:
    g = TaskGraph()
    g.add_task(Task("d", 0, "compute", "dispatch"))
    with pytest.raises(ValueError, match="no cost for task kind 'dispatch'"):
        simulate(g)
    with pytest.raises(ValueError, match="CostModel.F=-1"):
        CostModel(F=-1)


@pytest.mark.parametrize("fields, needle", [
    (dict(F=float("inf")), "CostModel.F=inf must be a finite number >= 0"),
    (dict(B=float("nan")), "CostModel.B=nan must be a finite number >= 0"),
    (dict(comm_latency=float("inf")), "CostModel.comm_latency=inf"),
    (dict(kinds={"expert": float("inf")}), "CostModel.kinds['expert']=inf"),
])
def test_costs_must_be_finite(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        CostModel(**fields)
    assert needle in str(info.value)
    CostModel(comm_bandwidth=float("inf"))  # free bandwidth stays the default


def test_chrome_trace_and_timeline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = two_rank_exchange(send_first_on_both=False)
    matching = validate_graph(g)
    r = simulate(g, CostModel(F=1.0, comm_latency=0.5, comm_bandwidth=100.0))
    trace = chrome_trace(r, pairs=matching.pairs)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 8
    use_b = next(e for e in spans if e["name"] == "use_b")
    assert (use_b["ts"], use_b["dur"], use_b["pid"]) == (4000.0, 1000.0, 0)
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 4
    path = tmp_path / "t.json"
    write_chrome_trace(r, path, pairs=matching.pairs)
    assert json.loads(path.read_text())["otherData"]["makespan"] == 5.0
    text = format_timeline(r, width=10, comm=True)
    lines = text.splitlines()
    assert lines[0] == "rank 0       |FF......FF|"
    assert lines[1] == "rank 0   comm|..sssrrr..|"  # send a, then wait for b


def test_format_grid_marks_and_windows() -> None:
    programs = {0: [f"0F{i}" for i in range(100)], 1: [f"1F{i}" for i in range(100)]}
    text = format_grid(programs, {(1, 50)}, max_rows=10)
    assert "*1F50*" in text and "<-- here" in text
    assert "earlier steps" in text and "later steps" in text
    assert len(text.splitlines()) == 13
