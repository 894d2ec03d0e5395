"""The 4D trainer against one device: pp x ep x cp x dp_shard layouts, fp32, gloo ranks (#19).

Each layout trains the Qwen3.5-style hybrid (3 GDN layers + 1 attention layer; MoE where EP is
on) for 5 optimizer steps and is compared step by step with one process training the same
model on the same data: the loss and the grad norm must agree within 1e-5 relative (observed:
~1e-7, fp32 reduction order). Several layouts of one world size train in turn in one spawn.

Routing: the MoE layouts route every token to every expert (``num_experts_per_tok ==
num_experts``), so dispatch/combine move every token over the EP all-to-alls but no top-k
choice can flip. With top-2 of 4 a token whose two best router logits differ by less than the
fp32 rounding of a different reduction order picks another expert; from then on the runs
follow different (equally valid) trajectories, and a 5-step comparison measures chaos, not the
parallel code. The top-2 layout is therefore compared over its first optimizer step only (same
weights, same batch), where any bug in dispatch, combine, gradients or the norm shows.

Every layout also records its first step and checks it against the step graph
(``train.check_conformance``, ``stepgraph.conformance``): a run that drifts from the graph fails.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from _trainer_util import train_worker

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import TrainResult, compare_runs, config_from_dict, train_single

REL_TOL = 1e-5
STEPS = 5

MOE = {"mlp": "moe", "num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32}
CP_MODES = {"linear_attention_cp_mode": "p2p", "full_attention_cp_mode": "ring"}


def layout(world: int, model: dict[str, Any] | None = None,
           pipeline: dict[str, Any] | None = None, steps: int = STEPS, **acc: Any
           ) -> dict[str, Any]:
    """A tiny fp32 configuration: hidden 32, 4 layers, 4 sequences of 64 tokens per dp rank."""
    accelerator = {"device": "cpu", "cp": 1, "world_size": world, "comm_timeout_s": 60.0, **acc}
    return {
        "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
                  **(model or {})},
        "data": {"seq_len": 64, "batch_size": 4},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "train": {"steps": steps, "seed": 0, "precision": "fp32", "accelerator": accelerator,
                  "pipeline": pipeline or {}, "check_conformance": True},
    }


def pp2(schedule: str, **pipeline: Any) -> dict[str, Any]:
    return {"schedule": schedule, "microbatches": 4, **pipeline}


TWO_RANKS = {
    "pp2_gpipe": layout(2, pp=2, pipeline=pp2("gpipe")),
    "pp2_1f1b": layout(2, pp=2, pipeline=pp2("1f1b")),
    "pp2_interleaved_1f1b": layout(2, pp=2, pipeline=pp2("interleaved_1f1b", virtual_stages=2)),
    "pp2_zero_bubble": layout(2, pp=2, pipeline=pp2("zero_bubble")),
    "pp2_dualpipev": layout(2, pp=2, pipeline=pp2("dualpipev", virtual_stages=2)),
    "ep2_cp2": layout(2, model=MOE, ep=2, cp=2, **CP_MODES),
}
FOUR_RANKS = {
    "pp2_ep2_overlap_b_f": layout(4, model=MOE, pp=2, ep=2,
                                  pipeline=pp2("interleaved_1f1b", virtual_stages=2,
                                               overlap_b_f=True)),
    # expert W tasks deferred to the rank's queue and run in the EP all-to-all windows (dp_shard
    # 2: the tasks accumulate into FSDP's gathered parameters before the reduce-scatter); where
    # they ran: tests/moe/test_moe_deferred_w.py::test_trainer_flushes_expert_w_in_the_windows
    "pp2_ep2_zero_bubble_defer_w": layout(4, model=MOE, pp=2, ep=2,
                                          pipeline=pp2("zero_bubble", defer_expert_w=True)),
    "pp2_ep2_dualpipev_defer_w": layout(4, model=MOE, pp=2, ep=2,
                                        pipeline=pp2("dualpipev", virtual_stages=2,
                                                     defer_expert_w=True)),
    "pp2_cp2": layout(4, pp=2, cp=2, **CP_MODES, pipeline=pp2("1f1b", microbatches=2)),
    "dp2_pp2": layout(4, pp=2, dp_shard=2, pipeline=pp2("1f1b", microbatches=2)),
    "pp2_ep2_top2_overlap_b_f": layout(4, model={**MOE, "num_experts_per_tok": 2}, pp=2, ep=2,
                                       steps=1,
                                       pipeline=pp2("interleaved_1f1b", virtual_stages=2,
                                                    overlap_b_f=True)),
}
EIGHT_RANKS = {
    "pp2_ep2_cp2": layout(8, model=MOE, pp=2, ep=2, cp=2, **CP_MODES,
                          pipeline=pp2("interleaved_1f1b", virtual_stages=2)),
}


def _spawn(configs: dict[str, dict[str, Any]], world: int) -> dict[str, TrainResult]:
    out = run_ranks(train_worker, world, timeout_s=400, args=(list(configs.values()),))[0]
    return {name: TrainResult.from_dict(r) for name, r in zip(configs, out)}


@pytest.fixture(scope="module")
def two_rank_runs() -> dict[str, TrainResult]:
    return _spawn(TWO_RANKS, 2)


@pytest.fixture(scope="module")
def four_rank_runs() -> dict[str, TrainResult]:
    return _spawn(FOUR_RANKS, 4)


def _check(run: TrainResult, cfg: dict[str, Any], name: str) -> dict[str, float]:
    config = config_from_dict(cfg)
    base = train_single(config)
    diff = compare_runs(run, base)
    assert len(run.steps) == config.train.steps, name
    assert diff["max_rel_dloss"] <= REL_TOL, (name, diff)
    assert diff["max_rel_dgrad_norm"] <= REL_TOL, (name, diff)
    for m in run.steps:
        assert math.isfinite(m.loss) and math.isfinite(m.grad_norm) and m.lr > 0, (name, m)
    if config.train.steps > 1:  # it trains: the loss falls from ~ln(260) = 5.56
        assert run.steps[-1].loss < run.steps[0].loss, (name, [s.loss for s in run.steps])
    return diff


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_rank_layouts_match_one_device(two_rank_runs: dict[str, TrainResult],
                                           name: str) -> None:
    _check(two_rank_runs[name], TWO_RANKS[name], name)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_layouts_match_one_device(four_rank_runs: dict[str, TrainResult],
                                            name: str) -> None:
    _check(four_rank_runs[name], FOUR_RANKS[name], name)


@pytest.mark.slow
def test_pp2_ep2_cp2_on_eight_ranks_matches_one_device() -> None:
    runs = _spawn(EIGHT_RANKS, 8)
    run = runs["pp2_ep2_cp2"]
    assert run.world_size == 8 and run.cp == 2
    assert run.mode.startswith("pp2(interleaved_1f1b,v2)") and "ep2" in run.mode
    _check(run, EIGHT_RANKS["pp2_ep2_cp2"], "pp2_ep2_cp2")


def test_the_layouts_are_what_they_claim(two_rank_runs: dict[str, TrainResult],
                                         four_rank_runs: dict[str, TrainResult]) -> None:
    modes = {n: r.mode for n, r in {**two_rank_runs, **four_rank_runs}.items()}
    assert modes["pp2_gpipe"].startswith("pp2(gpipe)")
    assert modes["pp2_dualpipev"].startswith("pp2(dualpipev,v2)")
    assert modes["pp2_ep2_overlap_b_f"].startswith("pp2(interleaved_1f1b+overlap_b_f,v2)")
    assert "ep2" in modes["ep2_cp2"] and "cp2:p2p/ring" in modes["ep2_cp2"]
    assert four_rank_runs["dp2_pp2"].dp == 2
    # dp2 reads two rows per step where pp2 x cp2 reads one: the token counts differ
    assert four_rank_runs["dp2_pp2"].steps[0].tokens == 2 * four_rank_runs["pp2_cp2"].steps[0].tokens
