"""The machinery of benchmarks/step_predict.py on real gloo ranks (not its timing): a traced
trainer run gives every step of every rank, node costs per stage and kind come out of it, and
the prediction from them is a step of the same pipeline. One tiny pp2 x ep2 run (4 ranks)."""

from __future__ import annotations

import math

import pytest

from overlap_runtime.stepgraph.costs import measured_costs
from overlap_runtime.trainer.measure import merge_ranks, traced_training
from overlap_runtime.stepgraph.predict import measured_step, predict_step
from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import config_from_dict

CONFIG = {
    "model": {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "mlp": "moe",
              "num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "data": {"seq_len": 32, "batch_size": 4},
    "train": {"steps": 2, "seed": 0, "precision": "fp32",
              "accelerator": {"device": "cpu", "world_size": 4, "pp": 2, "ep": 2,
                              "comm_timeout_s": 60.0},
              "pipeline": {"schedule": "1f1b", "microbatches": 4}},
}


def test_traced_run_to_costs_to_prediction() -> None:
    results = run_ranks(traced_training, 4, timeout_s=120, args=(CONFIG,))
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    steps = merge_ranks(results)
    assert len(steps) == 2
    # events carry the global rank (the runtime names them by pipeline rank: 0, 0, 1, 1)
    assert {e.rank for e in steps[1]} == {0, 1, 2, 3}
    computes = [e for e in steps[1] if e.cat == "compute" and e.name[1] in "FB"]
    assert len(computes) == 4 * 4 * 2  # 4 ranks x 4 microbatches x (F, B)
    costs = measured_costs(steps, cores=2)
    assert sorted((s, k) for s, k in costs.compute) == [(0, "B"), (0, "F"), (1, "B"), (1, "F")]
    assert all(v > 0 for v in costs.compute.values())
    # every F and B of this MoE model runs its dispatch and combine all-to-alls
    assert costs.a2a[(0, "F", False)][0] == costs.a2a[(1, "B", False)][0] == 2
    # per rank: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1 (pp outermost)
    assert {r: sorted({s for s, _ in c.compute}) for r, c in costs.by_rank.items()} == \
        {0: [0], 1: [0], 2: [1], 3: [1]}
    config = config_from_dict(CONFIG)
    measured = measured_step(steps[1])
    assert measured.step_s > 0 and 0 <= measured.bubble < 1
    for cores in (None, 2):
        for per_rank in (True, False):
            pred = predict_step(config, costs, message_s=results[0]["latency_s"], cores=cores,
                                per_rank=per_rank)
            assert math.isfinite(pred.step_s) and 0 <= pred.bubble < 1
        # at least the critical path of one microbatch: F and B of both stages
        path = sum(costs.compute.values())
        assert pred.step_s >= path * (1 - 1e-9)
    # shared cores (4 ranks on 2) stretch the same work
    for per_rank in (True, False):
        assert predict_step(config, costs, message_s=0.0, cores=2, per_rank=per_rank).step_s > \
            predict_step(config, costs, message_s=0.0, per_rank=per_rank).step_s
    with pytest.raises(KeyError, match="no measured cost for W"):
        costs.cost(0, "W")
