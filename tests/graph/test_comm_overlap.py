"""``graph.comm_overlap``: the one all-to-all overlap definition and its two readers.

Per rank: hidden = |union(a2a) n union(work)|, share = sum hidden / sum |union(a2a)|. The
simulated reader (``simulated_a2a_overlap``) and the trace reader
(``trainer.a2a_overlap.trace_a2a_overlap``) must give the same figure for the same timeline;
the MoE pair graphs (tests/moe/test_moe_local.py) and the trainer's metric
(tests/trainer/test_metrics.py) check the readers on their own inputs.
"""

from __future__ import annotations

import pytest

from overlap_runtime.graph import CommInfo, Task
from overlap_runtime.graph.comm_overlap import a2a_overlap, simulated_a2a_overlap
from overlap_runtime.graph.simulate import SimulationResult
from overlap_runtime.pipeline.exec_trace import TraceEvent
from overlap_runtime.trainer.a2a_overlap import trace_a2a_overlap


def test_per_rank_union_of_all_to_alls_against_the_rank_s_work() -> None:
    a2a = [(0, 0.0, 4.0, True), (0, 2.0, 6.0, False),  # rank 0: in flight 0..6 (union: 6)
           (1, 0.0, 2.0, True), (1, 5.0, 5.0, True)]   # rank 1: 0..2; an empty one not counted
    work = [(0, 3.0, 10.0), (1, 1.0, 2.0), (0, -1.0, 1.0)]  # rank 1 works 1..2, not for rank 0
    m = a2a_overlap(a2a, work)
    assert (m.in_flight, m.hidden, m.count) == (6.0 + 2.0, (1.0 + 3.0) + 1.0, 3)
    assert m.share == pytest.approx(5.0 / 8.0)
    paired = a2a_overlap(a2a, work, paired_only=True)  # rank 0: 0..4, covered 0..1 and 3..4
    assert (paired.in_flight, paired.hidden, paired.count) == (4.0 + 2.0, 2.0 + 1.0, 2)
    assert a2a_overlap([], work).share == 0.0
    assert a2a_overlap([], work).to_dict(1.0) == {"share": 0.0, "a2a_s": 0.0, "hidden_s": 0.0,
                                                  "count": 0.0}


def _result(rows: list[tuple[Task, float, float]]) -> SimulationResult:
    return SimulationResult([t for t, _, _ in rows], [s for _, s, _ in rows],
                            [e for _, _, e in rows], max(e for _, _, e in rows), {}, {}, [])


def test_the_simulated_and_the_traced_reading_agree_on_one_timeline() -> None:
    # rank 0, an OVERLAP_B_F step: the forward thread computes 0..10 and 30..100 around its
    # dispatch (10..30); the backward thread waits in a hook until 20, then computes; an
    # unpaired all-to-all later (150..160) with nothing to do
    ep = CommInfo("collective", "ep")
    sim = _result([
        (Task("f0", 0, "fwd", "F"), 0.0, 10.0),
        (Task("d", 0, "comm:ep", "dispatch", comm=ep, meta={"action_lane": "fwd"}), 10.0, 30.0),
        (Task("f1", 0, "fwd", "F"), 30.0, 100.0),
        (Task("b0", 0, "bwd", "B"), 20.0, 100.0),
        (Task("d2", 0, "comm:ep", "dispatch", comm=ep, meta={"action_lane": "compute"}), 150.0,
         160.0),
        (Task("pp", 0, "comm:pp", "send", comm=CommInfo("send", "k", 1)), 100.0, 120.0),
    ])
    trace = [
        TraceEvent(0, "main", "(0B0;0F1)OVERLAP_B_F", "compound", 0, 100),
        TraceEvent(0, "main", "0F1", "compute", 0, 100),
        TraceEvent(0, "main", "S0.L0.dispatch fwd", "a2a", 10, 30),
        TraceEvent(0, "worker", "0B0", "compute", 0, 100),
        TraceEvent(0, "worker", "S0.L0.D bwd", "hook", 0, 20),
        TraceEvent(0, "main", "1F2", "compute", 140, 170),
        TraceEvent(0, "main", "S0.L1.dispatch fwd", "a2a", 150, 160),
    ]
    for paired_only, share in ((True, 10 / 20), (False, 10 / 30)):
        s = simulated_a2a_overlap(sim, paired_only=paired_only)
        t = trace_a2a_overlap(trace, paired_only=paired_only)
        assert s.share == pytest.approx(share) and t.share == pytest.approx(share)
        assert (s.in_flight, s.hidden, s.count) == (t.in_flight, t.hidden, t.count)
