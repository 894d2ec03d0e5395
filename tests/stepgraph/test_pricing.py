"""The pricing pass over a compiled step (``stepgraph.pricing``) and the one op type
(``LayerOp``, priced or not) that ``compile_step`` expands (``stepgraph.expand``)."""

from __future__ import annotations


import pytest

from tests.support.step_configs import moe_config

from overlap_runtime.graph.tasks import Task
from overlap_runtime.stepgraph.compose import compile_step
from overlap_runtime.stepgraph.layer_program import LayerOp
from overlap_runtime.stepgraph.pricing import by_op_name, predict_priced, price_step, priced_op


def test_every_op_of_an_overlap_b_f_step_is_tagged_with_its_side() -> None:
    step = compile_step(moe_config(pp=2, ep=2, layers=4, virtual_stages=2, overlap_b_f=True))
    priced = price_step(step, by_op_name({}, default=1.0))
    sides = {t.meta["action_lane"] for t in priced.tasks() if t.lane == "comm:ep"}
    assert sides == {"compute", "fwd", "bwd"}  # plain F/B steps and both sides of a pairing
    for t in priced.tasks():
        if t.comm is not None and t.lane == "comm:ep":
            lanes = {priced.task(i).lane for i in step.actions[t.rank][t.meta["action"]]
                     if priced.task(i).comm is None}
            assert lanes == {t.meta["action_lane"]}


def test_a_cost_must_be_finite_and_not_negative() -> None:
    step = compile_step(moe_config(ep=2, layers=1))
    with pytest.raises(ValueError, match=r"r0:0F0\.L-1\.embed.* costs -1.0 s"):
        price_step(step, lambda t: -1.0)
    with pytest.raises(ValueError, match=r"no cost for 'r0:0F0\.L-1\.embed' \(op 'embed'\)"):
        price_step(step, by_op_name({}))


def test_serial_step_sums_each_rank_and_skips_receives() -> None:
    step = compile_step(moe_config(pp=2, ep=2, layers=2))
    pred = predict_priced(step, lambda t: 0.25)  # receives priced too: serial skips them
    per_rank = {r: [t for t in step.graph.tasks() if t.rank == r
                    and not (t.comm is not None and t.comm.op == "recv")] for r in range(4)}
    assert any(t.comm is not None and t.comm.op == "recv" for t in step.graph.tasks())
    assert pred.serial_s == pytest.approx(0.25 * max(len(v) for v in per_rank.values()))
    assert pred.step_s >= pred.serial_s


def test_compile_step_refuses_an_unpriced_op_among_priced_ones() -> None:
    def ops(t: Task, rank: int) -> list[tuple[None, LayerOp]]:
        return [(None, priced_op("c", t.kind, 1.0)),
                (None, LayerOp("moe.router", "compute", flops=8.0))]

    with pytest.raises(ValueError, match=r"ops \['moe.router'\] of .* have no cost"):
        compile_step(moe_config(pp=2, ep=2, layers=2, microbatches=2), ops=ops, representative=True)
