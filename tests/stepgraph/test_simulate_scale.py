"""``overlap-runtime simulate`` and the prediction at scale: validated like ``train``, the
symmetry reduction (one representative rank per pipeline rank) agrees with simulating every
rank, in-flight activations follow the schedule. Pure Python, no ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlap_runtime.cli import main
from overlap_runtime.stepgraph.costs import h200_profile
from overlap_runtime.stepgraph.scale import _inflight, predict_at_scale
from overlap_runtime.config.train import apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[2]
BIG = str(ROOT / "configs" / "sim_moe_h200.yaml")
TINY = str(ROOT / "configs" / "tiny_4d_pp2_ep2_cp2.yaml")
# the tiny 4D layout with a model large enough that compute and messages both matter
WIDER = ["model.hidden_size=1024", "model.moe_intermediate_size=1024",
         "model.shared_expert_intermediate_size=1024", "data.seq_len=4096",
         "model.linear_key_head_dim=128", "model.linear_value_head_dim=128"]


@pytest.mark.parametrize("extra", [
    [],  # pp2 x dp_shard2 x cp2 x ep2, p2p chain + ring attention
    ["train.accelerator.cp=1", "train.accelerator.dp_shard=4", "train.accelerator.ep=4",
     "train.pipeline.overlap_b_f=true"],  # pp2 x ep4 with OVERLAP_B_F hand-overs
], ids=["pp2_cp2_ep2", "pp2_ep4_overlap_b_f"])
def test_representative_ranks_agree_with_every_rank(extra: list[str]) -> None:
    config = apply_overrides(load_config(TINY), WIDER + extra)
    prof = h200_profile(gpus_per_node=2)  # groups and pipeline peers cross "nodes"
    rep = predict_at_scale(config, prof, representative=True)
    full = predict_at_scale(config, prof, representative=False)
    assert full.represented_ranks == 8 and rep.represented_ranks == 2
    assert full.tasks > 3 * rep.tasks
    assert rep.pipeline_s > 0 and rep.exposed_comm_s > 0
    assert rep.pipeline_s == pytest.approx(full.pipeline_s, rel=1e-9)
    assert rep.bubble == pytest.approx(full.bubble, rel=1e-9)
    assert rep.exposed_comm_s == pytest.approx(full.exposed_comm_s, rel=1e-9)
    for r in full.ranks:  # every rank of a pipeline coordinate has its representative's timeline
        twin = rep.ranks[r.pp_rank]
        assert r.busy_s == pytest.approx(twin.busy_s, rel=1e-9)


def test_one_f_one_b_holds_pp_minus_r_microbatches() -> None:
    config = apply_overrides(load_config(TINY), [
        "train.accelerator.pp=4", "train.accelerator.world_size=16",
        "train.pipeline.schedule=1f1b", "train.pipeline.virtual_stages=1",
        "train.pipeline.microbatches=4", "data.batch_size=8"])
    from overlap_runtime.stepgraph.compose import pipeline_graph

    held = _inflight(pipeline_graph(config))
    assert {r: sum(v.values()) for r, v in held.items()} == {0: 4, 1: 3, 2: 2, 3: 1}


def test_simulate_cli_at_scale(capsys: pytest.CaptureFixture[str]) -> None:
    """pp32 x cp64 x ep64 (2048 ranks) in a few seconds; every figure printed."""
    rc = main(["simulate", BIG, "--set", "train.accelerator.pp=32", "--set",
               "train.accelerator.cp=64", "--set", "train.accelerator.ep=64", "--set",
               "train.pipeline.virtual_stages=1", "--set", "train.pipeline.microbatches=16",
               "--set", "data.batch_size=16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2048 ranks on h200" in out and "32 representative ranks" in out
    for needle in ("step ", "bubble ", "exposed communication", "peak memory", "| 31 |"):
        assert needle in out, out


def test_simulate_cli_validates_like_train(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", BIG, "--set", "train.accelerator.ep=6"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.accelerator.ep=6" in err, err
    rc = main(["simulate", BIG, "--set", "train.pipeline.overlap_b_f=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "overlap_b_f=true with train.accelerator.cp=8" in err, err
    rc = main(["simulate", BIG, "--gpus-per-node", "0"])
    assert rc == 2 and "--gpus-per-node=0" in capsys.readouterr().err
