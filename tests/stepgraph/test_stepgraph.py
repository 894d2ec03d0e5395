"""The step graph (stepgraph.compose) and its conformance checker, without ranks.

The real runs are checked in tests/trainer/test_trainer_4d.py (``train.check_conformance``:
every multi-rank layout records its first step and checks it). Here the checker meets the
records of an ideal run of the graph, mutated the three ways the issue names: a reordered
all-to-all, a skipped GDN chain message, a send to the wrong peer.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.layouts import EIGHT_RANKS, FOUR_RANKS, TWO_RANKS  # noqa: E402

from overlap_runtime.graph import DeadlockError  # noqa: E402
from overlap_runtime.stepgraph import layer_program  # noqa: E402
from overlap_runtime.stepgraph.compose import StepGraph, compile_step  # noqa: E402
from overlap_runtime.stepgraph.conformance import (ConformanceError,  # noqa: E402
                                                   check_conformance, ideal_records)
from overlap_runtime.trainer import config_from_dict  # noqa: E402

LAYOUTS = {**TWO_RANKS, **FOUR_RANKS, **EIGHT_RANKS}


def _graph(name: str) -> StepGraph:
    return compile_step(config_from_dict(LAYOUTS[name]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_compiles_validates_and_accepts_its_ideal_run(name: str) -> None:
    sg = _graph(name)
    assert sg.matching is not None and len(sg.graph) > 0
    check_conformance(sg, ideal_records(sg))


def _index(rec: list[dict[str, Any]], **want: Any) -> int:
    return next(i for i, e in enumerate(rec) if all(e.get(k) == v for k, v in want.items()))


def test_checker_catches_a_reordered_all_to_all() -> None:
    sg = _graph("pp2_ep2_overlap_b_f")
    rec = ideal_records(sg)
    mine = rec[1]
    i = _index(mine, label="S0.L0.dispatch")
    j = _index(mine, label="S0.L0.combine")  # same action, later
    mine[i], mine[j] = mine[j], mine[i]
    with pytest.raises(ConformanceError, match=r"rank 1, record #\d+, task r1:0F0\.L0\.moe\."
                                               r"dispatch: got label 'S0.L0.combine'"):
        check_conformance(sg, rec)


def test_checker_catches_all_to_alls_in_another_order_on_one_member() -> None:
    # both a2a of one OVERLAP_B_F step keep their own task, but the threads launch them in
    # another order than the coordinator's: the edge order on the rank is broken
    sg = _graph("pp2_ep2_overlap_b_f")
    rec = ideal_records(sg)
    mine = rec[0]
    i = next(i for i, e in enumerate(mine) if e.get("label", "").endswith(".combine")
             and e["task"] and "B" in e["task"] and i > 0)
    j = next(k for k in range(i + 1, len(mine)) if mine[k].get("group") == "ep"
             and mine[k]["task"] != mine[i]["task"])
    mine[i], mine[j] = mine[j], mine[i]
    with pytest.raises(ConformanceError, match=r"rank 0: task .* ran \(record #\d+\) before"):
        check_conformance(sg, rec)


def test_checker_catches_a_skipped_chain_message() -> None:
    sg = _graph("pp2_cp2")  # GDN p2p chain on cp2
    rec = ideal_records(sg)
    send_h = next(o for o in layer_program(sg.config, 0, "F", sg.shape, cp_rank=0)
                  if o.name == "gdn.chain.send_H")
    i = _index(rec[0], op="send", task="0F0", nbytes=send_h.nbytes)
    del rec[0][i]
    with pytest.raises(ConformanceError, match=r"rank 0, record #\d+, task r0:0F0\.L0\.gdn\.chain"
                                               r"\.send_H: got .*bytes"):
        check_conformance(sg, rec)


def test_checker_catches_a_skipped_message_at_the_end_of_a_task() -> None:
    sg = _graph("pp2_cp2")
    rec = ideal_records(sg)
    last = max(i for i, e in enumerate(rec[3]) if e["task"] == "1B0" and e["op"] != "task")
    del rec[3][last]
    with pytest.raises(ConformanceError, match=r"rank 3, task r3:1B0\.L\d\.\S+: never launched"):
        check_conformance(sg, rec)


@pytest.mark.parametrize("name", ["pp2_ep2_cp2", "pp2_ep2_overlap_b_f"])
def test_checker_checks_actions_that_begin_with_a_communication(name: str) -> None:
    """A compute action whose first op is a launch (a backward opening with a CP receive or an
    expert all-to-all) is held to the same rules as any other: its last launch left out, or the
    action started twice, is caught on every rank that has such an action."""
    sg = _graph(name)
    g, rec = sg.graph, ideal_records(sg)
    found = 0
    for rank, acts in sg.actions.items():
        opening = [a for a, ids in acts.items()
                   if g.task(ids[0]).comm is not None and g.task(ids[0]).meta.get("op")]
        if not opening:
            continue
        action = opening[-1]
        found += 1
        short = copy.deepcopy(rec)
        last = max(i for i, e in enumerate(short[rank])
                   if e["task"] == action and e["op"] != "task")
        del short[rank][last]
        with pytest.raises(ConformanceError, match=rf"rank {rank}, task r{rank}:{action}\.\S+: "
                                                   rf"never launched"):
            check_conformance(sg, short)
        twice = copy.deepcopy(rec)
        twice[rank].append({"op": "task", "task": action})
        with pytest.raises(ConformanceError, match=rf"rank {rank}, record #\d+: task {action} "
                                                   rf"ran twice"):
            check_conformance(sg, twice)
    assert found, f"{name}: no action opens with a communication; the test checks nothing"


def test_checker_catches_a_send_to_the_wrong_peer() -> None:
    sg = _graph("pp2_ep2_cp2")  # ring attention and the GDN chain on cp2, 8 ranks
    rec = ideal_records(sg)
    i = _index(rec[0], op="send", task="0F0")
    rec[0][i]["peer"] = 2  # rank 0's CP partner is rank 1
    with pytest.raises(ConformanceError, match=r"rank 0, record #\d+, task r0:0F0\.L0\.gdn\.halo"
                                               r"\.send: got peer rank 2 .* the graph expects send"
                                               r" on comm:cp to/from rank 1"):
        check_conformance(sg, rec)


def test_checker_catches_a_pipeline_send_to_the_wrong_rank_and_a_task_run_twice() -> None:
    sg = _graph("dp2_pp2")
    rec = ideal_records(sg)
    bad = copy.deepcopy(rec)
    i = _index(bad[0], op="send", group="pp")
    bad[0][i]["peer"] = 3  # rank 0 (dp 0) sends to its dp-1 twin's next stage
    with pytest.raises(ConformanceError, match=r"got peer rank 3.*to/from rank 2"):
        check_conformance(sg, bad)
    twice = copy.deepcopy(rec)
    twice[1].append({"op": "task", "task": "0F0"})
    with pytest.raises(ConformanceError, match=r"rank 1, record #\d+: task 0F0 ran twice"):
        check_conformance(sg, twice)


def test_validation_proves_the_ring_hop_is_one_launch() -> None:
    # a ring hop posts its send and receive together; as two blocking tasks in a row on both
    # ranks (send first everywhere) the validator finds the classic deadlock
    sg = compile_step(config_from_dict(LAYOUTS["ep2_cp2"]), validate=False)
    g = sg.graph
    send = next(t for t in g.tasks() if t.rank == 0 and str(t.label).endswith("ring1.send_kv"))
    recv = next(t for t in g.tasks() if t.rank == 0 and str(t.label).endswith("ring1.recv_kv"))
    send1 = next(t for t in g.tasks() if t.rank == 1 and str(t.label).endswith("ring1.send_kv"))
    recv1 = next(t for t in g.tasks() if t.rank == 1 and str(t.label).endswith("ring1.recv_kv"))
    g.add_edges([(send.id, recv.id), (send1.id, recv1.id)], "program")
    with pytest.raises(DeadlockError):
        g.validate()


def test_layer_program_follows_the_runtime() -> None:
    cfg = config_from_dict(LAYOUTS["pp2_ep2_cp2"])
    names = [o.name for o in layer_program(cfg, 0, "F", cp_rank=1) if o.is_comm]
    assert names == ["gdn.agree", "gdn.halo.recv", "gdn.chain.recv_H", "moe.dispatch_counts",
                     "moe.dispatch", "moe.combine"]
    bwd = [o.name for o in layer_program(cfg, 3, "I", cp_rank=0) if o.is_comm]
    assert bwd == ["moe.combine.bwd", "moe.dispatch.bwd", "attn.bwd.ring1.send_kv",
                   "attn.bwd.ring1.recv_kv", "attn.bwd.dkv1.send", "attn.bwd.dkv1.recv"]
    assert not [o for o in layer_program(cfg, 0, "W") if o.is_comm]
    state = [o for o in layer_program(cfg, 0, "F", cp_rank=0) if o.name == "gdn.chain.send_H"][0]
    m = cfg.model  # one fp32 state [rows, HV, K, V]
    assert state.nbytes == 1 * m.linear_num_value_heads * m.linear_key_head_dim \
        * m.linear_value_head_dim * 4


def test_checker_catches_a_missing_rank_a_launch_outside_any_task_and_a_task_never_run(
        ) -> None:
    sg = _graph("pp2_cp2")
    rec = ideal_records(sg)
    gone = {r: v for r, v in rec.items() if r != 2}
    with pytest.raises(ConformanceError, match=r"no record for ranks \[2\]"):
        check_conformance(sg, gone)
    outside = copy.deepcopy(rec)
    i = _index(outside[0], op="send", task="0F0")
    outside[0][i]["task"] = None
    outside[0][i]["group"] = "cp"
    with pytest.raises(ConformanceError, match=r"rank 0, record #\d+: .*launched outside any "
                                               r"task"):
        check_conformance(sg, outside)
    never = copy.deepcopy(rec)
    never[3] = [e for e in never[3] if e.get("task") != "1B0"]
    with pytest.raises(ConformanceError, match=r"rank 3: task 1B0 never ran"):
        check_conformance(sg, never)


def test_the_task_estimate_matches_the_graph_and_bounds_the_trainer() -> None:
    from overlap_runtime.stepgraph.compose import estimate_tasks
    from overlap_runtime.config.train import ConfigError
    from overlap_runtime.trainer.step_check import StepCheck

    for name in ("pp2_ep2_overlap_b_f", "pp2_cp2", "pp2_ep2_cp2"):
        config = config_from_dict(LAYOUTS[name])
        n, built = estimate_tasks(config), len(_graph(name).graph)
        assert abs(n - built) <= 0.1 * built, (name, n, built)
    small = copy.deepcopy(LAYOUTS["pp2_cp2"])
    small["train"]["step_graph_max_tasks"] = 10
    with pytest.raises(ConfigError, match=r"about [\d,]+ tasks, more than "
                                          r"train.step_graph_max_tasks=10"):
        StepCheck(config_from_dict(small), None, None)
