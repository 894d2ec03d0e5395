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

The eight-rank layout (pp2 interleaved x dp_shard 2 x cp2 x ep2) is examples/train_4d.py, run
on eight ranks with torchrun's environment by tests/test_examples.py with the same checks (5 steps against one device within
1e-5, the first step's conformance, its layout line).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from tests.support.layouts import FOUR_RANKS, TWO_RANKS
from tests.support.trainer import train_worker

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import TrainResult, compare_runs, config_from_dict, train_single

REL_TOL = 1e-5


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
def test_the_layouts_are_what_they_claim(two_rank_runs: dict[str, TrainResult],
                                         four_rank_runs: dict[str, TrainResult]) -> None:
    modes = {n: r.mode for n, r in {**two_rank_runs, **four_rank_runs}.items()}
    assert modes["pp2_gpipe"].startswith("pp2(gpipe)")
    assert modes["pp2_dualpipev"].startswith("pp2(dualpipev,v2)")
    assert modes["pp2_ep2_overlap_b_f"].startswith("pp2(interleaved_1f1b+overlap_b_f,v2)")
    assert "ep2" in modes["ep2_cp2"] and "cp2:p2p/ring" in modes["ep2_cp2"]
    assert four_rank_runs["dp2_pp2"].dp == 2
    assert "cp4:p2p/hierarchical" in modes["cp4_hierarchical"]
    # dp2 reads two rows per step where pp2 x cp2 reads one: the token counts differ
    assert four_rank_runs["dp2_pp2"].steps[0].tokens == 2 * four_rank_runs["pp2_cp2"].steps[0].tokens
