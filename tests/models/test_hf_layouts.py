"""A Hugging Face checkpoint imported into pp2 x ep2, cp2 and dp_shard2 x ep2 trains exactly as
the same import on one device (fp32, gloo ranks, 3 optimizer steps, loss and grad norm within
1e-5 relative).

Each rank builds its part on the meta device and reads only its share of the safetensors
(``models.hf.load``): its pipeline stage's layers, its experts, its FSDP2 rows. The MoE model
routes every token to every expert (top-4 of 4), so no top-k choice can flip on a rounding
difference and the comparison measures the import and the parallel code, not chaos.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.support.hf_tiny import save_hf, train_config, train_worker  # noqa: E402

from overlap_runtime.testing import run_ranks  # noqa: E402
from overlap_runtime.trainer import (TrainResult, compare_runs, config_from_dict,  # noqa: E402
                                     train_single)

REL_TOL = 1e-5


def layouts(d: str) -> dict[str, tuple[int, dict[str, Any]]]:
    pp = {"schedule": "1f1b", "microbatches": 4}
    return {
        "pp2_ep2": (4, train_config(d, world=4, pp=2, ep=2, pipeline=pp)),
        "cp2": (2, train_config(d, world=2, cp=2, linear_attention_cp_mode="p2p",
                                full_attention_cp_mode="ring")),
        "dp_shard2_ep2": (2, train_config(d, world=2, dp_shard=2, ep=2)),
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("hf_moe_top4")
    save_hf("moe", d, seed=5, top_k=4)
    return str(d)


@pytest.mark.parametrize("name", ["pp2_ep2", "cp2", "dp_shard2_ep2"])
def test_import_into_layout_equals_one_device(hf_dir: str, name: str) -> None:
    world, cfg = layouts(hf_dir)[name]
    run = TrainResult.from_dict(run_ranks(train_worker, world, timeout_s=300,
                                          args=([cfg],))[0][0])
    config = config_from_dict(cfg)
    base = train_single(config)
    diff = compare_runs(run, base)
    assert diff["max_rel_dloss"] <= REL_TOL, diff
    assert diff["max_rel_dgrad_norm"] <= REL_TOL, diff
    assert run.steps[-1].loss < run.steps[0].loss


def test_tied_embedding_imports_into_dp_shard2(tmp_path) -> None:
    """The small Qwen3.5 models tie the LM head to the embedding: FSDP2 keeps one parameter."""
    import torch
    import transformers as tf
    from tests.support.hf_tiny import COMMON

    torch.manual_seed(9)
    hf = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**COMMON, intermediate_size=48,
                                                    tie_word_embeddings=True))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(str(tmp_path))
    cfg = train_config(str(tmp_path), world=2, dp_shard=2)
    run = TrainResult.from_dict(run_ranks(train_worker, 2, timeout_s=300, args=([cfg],))[0][0])
    diff = compare_runs(run, train_single(config_from_dict(cfg)))
    assert diff["max_rel_dloss"] <= REL_TOL and diff["max_rel_dgrad_norm"] <= REL_TOL, diff
