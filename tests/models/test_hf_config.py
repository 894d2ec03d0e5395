"""Hugging Face ``config.json`` -> our model config: the published Qwen3.5 family loads, an
unsupported variant is refused naming the field, YAML may not contradict an import, and a tied
embedding imports and matches transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from overlap_runtime.models import Qwen3_5Config
from overlap_runtime.models.hf import HFConfigError, config_from_hf, read_hf_config
from overlap_runtime.config.train import ConfigError, apply_overrides, config_from_dict

PUBLISHED = sorted((Path(__file__).parents[2] / "configs" / "hf").glob("Qwen3.5-*.json"))
# (hidden, layers, experts) of each published model, as its model card states
SIZES = {"0.8B": (1024, 24, 0), "2B": (2048, 24, 0), "4B": (2560, 32, 0), "9B": (4096, 32, 0),
         "27B": (5120, 64, 0), "35B-A3B": (2048, 40, 256), "122B-A10B": (3072, 48, 256),
         "397B-A17B": (4096, 60, 512)}


def test_every_published_config_is_here() -> None:
    assert {p.stem.removeprefix("Qwen3.5-") for p in PUBLISHED} == set(SIZES)


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_published_configs_load(path: Path) -> None:
    c = Qwen3_5Config(**config_from_hf(read_hf_config(path)))
    hidden, layers, experts = SIZES[path.stem.removeprefix("Qwen3.5-")]
    assert (c.hidden_size, c.num_hidden_layers) == (hidden, layers)
    assert c.mlp == ("moe" if experts else "swiglu")
    if experts:
        assert c.num_experts == experts and c.shared_expert_gate
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    assert c.zero_centered_norms and c.init_style == "hf" and c.hf_dtype == "bfloat16"
    assert (c.linear_num_key_heads, c.linear_key_head_dim, c.head_dim) == (16, 128, 256)


def _moe(**text):
    base = json.loads(PUBLISHED[[p.stem for p in PUBLISHED].index("Qwen3.5-35B-A3B")]
                      .read_text())
    base["text_config"].update(text)
    return base


@pytest.mark.parametrize("field,value,words", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("attention_bias", True, "attention_bias=True"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6}, "rope_type='yarn'"),
    ("some_new_field", 1, "some_new_field"),
    ("mamba_ssm_dtype", "bfloat16", "mamba_ssm_dtype"),
])
def test_unsupported_fields_are_refused_by_name(field, value, words) -> None:
    with pytest.raises(HFConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(_moe(**{field: value}))


def test_not_a_qwen3_5_model_is_refused() -> None:
    with pytest.raises(HFConfigError, match="model_type='llama'"):
        config_from_hf({"model_type": "llama"})


def _write(tmp_path: Path, data: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


def test_yaml_may_repeat_but_not_contradict_the_import(tmp_path: Path) -> None:
    d = _write(tmp_path, _moe())
    base = {"train": {"accelerator": {"cp": 1, "world_size": 1}}}
    ok = config_from_dict({**base, "model": {"init_from": d, "hidden_size": 2048,
                                             "gdn_backend": "eager"}})
    assert ok.model.num_experts == 256
    with pytest.raises(ConfigError, match=r"model.hidden_size=1024 .* 2048"):
        config_from_dict({**base, "model": {"init_from": d, "hidden_size": 1024}})
    # --init-from / --set model.init_from on a YAML that never named the architecture
    plain = config_from_dict({**base, "model": {"gdn_chunk_size": 32}})
    imported = apply_overrides(plain, [f"model.init_from={d}"])
    assert imported.model.hidden_size == 2048 and imported.model.gdn_chunk_size == 32
    again = apply_overrides(imported, ["optimizer.lr=1e-4"])  # a dump of an import re-validates
    assert again.model == imported.model


def test_tied_embedding_imports_and_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import transformers as tf
    from tests.support.hf_tiny import COMMON

    torch.manual_seed(9)
    hf = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**COMMON, intermediate_size=48,
                                                    tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(str(tmp_path))
    from overlap_runtime.trainer.build import build_model

    config = config_from_dict({"model": {"init_from": str(tmp_path)},
                               "train": {"accelerator": {"cp": 1, "world_size": 1}}})
    assert config.model.tie_word_embeddings
    ours = build_model(config)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = torch.randint(0, 272, (1, 80))
    with torch.no_grad():
        a, b = ours(ids), hf(ids).logits
    assert ((a - b).norm() / b.norm()) <= 1e-5


def test_simulate_takes_a_published_config(capsys) -> None:
    from overlap_runtime.cli import main

    root = Path(__file__).parents[2]
    rc = main(["simulate", str(root / "configs" / "sim_moe_h200.yaml"), "--model",
               str(root / "configs" / "hf" / "Qwen3.5-35B-A3B.json"),
               "--set", "train.accelerator.pp=4", "--set", "train.pipeline.microbatches=8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("pp4 x") and "step " in out and "peak memory" in out
    # the YAML's own model would not have 40 layers: the architecture is the config.json's
    rc = main(["simulate", str(root / "configs" / "sim_moe_h200.yaml"), "--model",
               str(root / "configs" / "hf" / "Qwen3.5-35B-A3B.json"),
               "--set", "model.num_hidden_layers=8"])
    assert rc == 2
    assert "model.num_hidden_layers=8" in capsys.readouterr().err
