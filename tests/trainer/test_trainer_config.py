"""TrainConfig: the shipped YAML files load, and every broken rule names its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from overlap_runtime.trainer import ConfigError, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]


def _acc(**fields: Any) -> dict[str, Any]:
    return {"train": {"accelerator": fields}}


_PIPELINE_FIELDS = ("schedule", "microbatches", "virtual_stages", "overlap_b_f", "overlap_p2p",
                    "layers_per_stage")


def _pp(**fields: Any) -> dict[str, Any]:
    """A pp=2 layout (cp=1 unless given) with ``train.pipeline`` fields split out."""
    pipeline = {k: fields.pop(k) for k in list(fields) if k in _PIPELINE_FIELDS}
    acc = {"pp": 2, "cp": 1, **fields}
    return {"train": {"accelerator": acc, "pipeline": pipeline}}


@pytest.mark.parametrize("name,cp,world,mode", [
    ("tiny_cp4_ulysses", 4, 4, "ulysses"),
    ("tiny_cp4_p2p", 4, 4, "p2p"),
    ("tiny_cp2_all_gather", 2, 2, "all_gather"),
    ("gpu_cp2_16k", 2, 2, "ulysses"),
])
def test_shipped_configs_load(name: str, cp: int, world: int, mode: str) -> None:
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    acc = cfg.train.accelerator
    assert (acc.cp, acc.resolved_world_size, acc.linear_attention_cp_mode) == (cp, world, mode)
    assert (acc.tp, acc.pp, acc.ep, acc.ulysses_degree) == (1, 1, 1, None)
    assert cfg.model.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.data.seq_len % cp == 0


@pytest.mark.parametrize("name,layout", [
    ("tiny_4d_pp2_ep2_cp2", (8, 2, 2, 2, 2, "interleaved_1f1b")),
    ("demo_pp2_ep2", (4, 2, 2, 1, 2, "interleaved_1f1b")),
])
def test_shipped_4d_configs_load(name: str, layout: tuple[Any, ...]) -> None:
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    dims = cfg.train.accelerator.layout()
    got = (dims.world_size, dims.pp, dims.dp_shard, dims.cp, dims.ep,
           cfg.train.pipeline.schedule)
    assert got == layout
    assert cfg.model.mlp == "moe"


def test_gpu_config_is_local_16k_bf16() -> None:
    cfg = load_config(REPO / "configs" / "gpu_cp2_16k.yaml")
    assert cfg.data.seq_len // cfg.train.accelerator.cp == 16384
    assert cfg.train.precision == "bf16" and cfg.train.accelerator.device == "cuda"


@pytest.mark.parametrize("data,needle", [
    (_acc(cp=2, tp=2), "train.accelerator.tp=2: linear-attention (GDN) context parallelism needs "
                       "tp == 1"),
    (_acc(cp=1, tp=2), "train.accelerator.tp=2: tensor parallelism is not supported"),
    (_acc(cp=3, world_size=4), "train.accelerator.cp=3 does not divide "
                               "train.accelerator.world_size=4"),
    (_acc(linear_attention_cp_mode="ring"), "train.accelerator.linear_attention_cp_mode: Input "
                                            "should be 'ulysses', 'p2p', 'all_gather' or "
                                            "'prefix_scan'"),
    (_acc(linear_attention_gdn_backend="auto"), "train.accelerator.linear_attention_gdn_backend"),
    (_acc(full_attention_cp_mode="zigzag"), "train.accelerator.full_attention_cp_mode"),
    (_acc(pp=2, cp=1, world_size=2), "train.pipeline.microbatches=4 must divide "
                                     "data.batch_size=1"),
    (_acc(ep=2), "train.accelerator.ep=2 needs model.mlp='moe'"),
    ({"model": {"mlp": "moe", "num_experts": 6}, **_acc(cp=1, world_size=4, ep=4)},
     "train.accelerator.ep=4 must divide model.num_experts=6"),
    (_acc(cp=1, world_size=4, dp_shard=2, ep=4), "train.accelerator.ep=4 must divide "
                                                 "train.accelerator.dp_shard x "
                                                 "train.accelerator.cp = 2 x 1 = 2"),
    (_acc(cp=2, world_size=8, pp=2, dp_shard=4), "= 16 must equal train.accelerator.world_size=8"),
    ({"data": {"batch_size": 4}, **_pp(pp=8)}, "train.accelerator.pp=8 x "
                                               "train.pipeline.virtual_stages=1 = 8 stages exceed "
                                               "model.num_hidden_layers=4"),
    ({"data": {"batch_size": 4}, **_pp(layers_per_stage=[3, 0])},
     "train.pipeline.layers_per_stage=[3, 0] must have pp x virtual_stages = 2 entries, each >= 1"),
    ({"data": {"batch_size": 4}, "model": {"tie_word_embeddings": True}, **_pp()},
     "model.tie_word_embeddings=true with train.accelerator.pp > 1"),
    ({"data": {"batch_size": 4}, **_pp(cp=2, overlap_b_f=True, schedule="interleaved_1f1b",
                                       virtual_stages=2)},
     "train.pipeline.overlap_b_f=true with train.accelerator.cp=2"),
    ({"data": {"batch_size": 4}, **_pp(schedule="dualpipev", virtual_stages=1)},
     "train.pipeline (schedule 'dualpipev', pp=2)"),
    (_acc(cp=2, ulysses_degree=1), "train.accelerator.ulysses_degree=1"),
    ({"data": {"seq_len": 130}, **_acc(cp=4)}, "data.seq_len=130 is not a multiple of "
                                               "train.accelerator.cp=4"),
    ({"model": {"linear_num_value_heads": 6, "linear_num_key_heads": 2},
      **_acc(cp=4, linear_attention_cp_mode="ulysses")},
     "linear_attention_cp_mode='ulysses' with cp=4 needs model.linear_num_value_heads"),
    ({"model": {"num_attention_heads": 6, "num_key_value_heads": 2},
      **_acc(cp=4, full_attention_cp_mode="ulysses")},
     "full_attention_cp_mode='ulysses' with cp=4 needs model.num_attention_heads"),
    ({"train": {"precision": "fp16"}}, "train.precision: Input should be 'fp32' or 'bf16'"),
    ({"model": {"vocab_size": 128}}, "model.vocab_size=128 is smaller than the byte-level"),
    ({"model": {"hidden": 64}}, "model.hidden: Extra inputs are not permitted"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr: Input should be greater than 0"),
    ({"train": {"steps": 0}}, "train.steps: Input should be greater than or equal to 1"),
])
def test_config_errors_name_the_field(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert needle in str(info.value)


def test_several_errors_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_acc(cp=3, world_size=4, pp=2, ep=2))
    msg = str(info.value)
    for needle in ("train.accelerator.pp=2 x train.accelerator.dp_replicate=1 x "
                   "train.accelerator.cp=3 = 6 does not divide train.accelerator.world_size=4",
                   "train.accelerator.ep=2 needs model.mlp='moe'",
                   "train.pipeline.microbatches=4 must divide data.batch_size=1"):
        assert needle in msg


def test_pipeline_and_expert_layouts_validate() -> None:
    cfg = config_from_dict({"data": {"batch_size": 4}, "model": {"mlp": "moe"},
                            **_pp(ep=2, dp_shard=2, world_size=4, schedule="interleaved_1f1b",
                                  virtual_stages=2, overlap_b_f=True)})
    dims = cfg.train.accelerator.layout()
    assert (dims.pp, dims.dp_shard, dims.cp, dims.ep, dims.efsdp) == (2, 2, 1, 2, 1)
    assert cfg.dp == 2 and cfg.train.accelerator.resolved_world_size == 4


def test_ring_full_attention_allows_head_counts_ulysses_cannot_split() -> None:
    cfg = config_from_dict({"model": {"num_attention_heads": 6, "num_key_value_heads": 2},
                            **_acc(cp=4, full_attention_cp_mode="ring",
                                   linear_attention_cp_mode="p2p")})
    assert cfg.dp == 1 and cfg.train.accelerator.full_attention_cp_mode == "ring"


def test_dp_is_world_over_cp_and_overrides_revalidate() -> None:
    cfg = config_from_dict(_acc(cp=2, world_size=8))
    assert cfg.dp == 4
    assert cfg.with_overrides(steps=3).train.steps == 3
    with pytest.raises(ValueError):
        cfg.with_overrides(steps=0)


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  accelerator:\n    cp: 2\n    pp: 8\n")
    with pytest.raises(ConfigError, match=r"wrong.yaml(.|\n)*train.accelerator.pp=8"):
        load_config(wrong)


# -- checked at load, not after the ranks start (#28 item 10) ------------------------------------


def test_corpus_must_be_a_non_empty_regular_text_file(tmp_path: Path) -> None:
    def err(corpus: str) -> str:
        with pytest.raises(ConfigError) as info:
            config_from_dict({"data": {"corpus": corpus}})
        return str(info.value)

    assert "data.corpus: data.corpus='/dev/null' is not a regular file" in err("/dev/null")
    assert f"data.corpus={str(tmp_path)!r} is not a regular file (a directory)" in err(
        str(tmp_path))
    assert "no such file" in err(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert f"data.corpus={str(empty)!r}: the file is empty" in err(str(empty))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n")
    assert "the file is empty" in err(str(blank))
    binary = tmp_path / "bytes.bin"
    binary.write_bytes(b"ab\xff\xfe\x00cd")
    assert "is not UTF-8 text" in err(str(binary))
    text = tmp_path / "ok.txt"
    text.write_text("some prose\n")
    assert config_from_dict({"data": {"corpus": str(text)}}).data.corpus == str(text)


@pytest.mark.parametrize("betas", [(1.0, 0.95), (0.9, 1.5), (-0.1, 0.95), (0.9, float("nan"))])
def test_betas_must_lie_in_0_1(betas: tuple[float, float]) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"optimizer": {"betas": list(betas)}})
    assert f"optimizer.betas: optimizer.betas={betas}" in str(info.value)
    assert "each beta must be in [0, 1)" in str(info.value)


@pytest.mark.parametrize("mode", ["p2p", "all_gather"])
def test_each_cp_rank_must_hold_the_conv_halo(mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"data": {"seq_len": 8}, **_acc(cp=4, linear_attention_cp_mode=mode)})
    msg = str(info.value)
    assert ("data.seq_len=8 / train.accelerator.cp=4 = 2 tokens per CP rank is shorter than "
            "the GDN conv halo model.linear_conv_kernel_dim - 1 = 3") in msg, msg
    # Ulysses gathers the whole sequence before the conv: no halo travels
    config_from_dict({"data": {"seq_len": 8}, **_acc(cp=4, linear_attention_cp_mode="ulysses")})
    config_from_dict({"data": {"seq_len": 12}, **_acc(cp=4, linear_attention_cp_mode=mode)})


def test_triton_gdn_needs_whole_64_token_chunks_per_cp_rank() -> None:
    acc = dict(cp=4, linear_attention_cp_mode="p2p", linear_attention_gdn_backend="triton")
    with pytest.raises(ConfigError) as info:
        config_from_dict({"data": {"seq_len": 384}, **_acc(**acc)})
    msg = str(info.value)
    assert ("data.seq_len=384 / train.accelerator.cp=4 = 96 tokens per CP rank is not a "
            "multiple of the chunk size 64 (train.accelerator.linear_attention_gdn_backend="
            "'triton'): pad data.seq_len to a multiple of 64 * cp = 256") in msg, msg
    assert config_from_dict({"data": {"seq_len": 512}, **_acc(**acc)}).data.seq_len == 512


def test_gdn_kernel_options_must_fit_every_gdn_cp_mode() -> None:
    """``model.gdn_kernel_options`` against the CP modes and backend, at load (the rules
    ``LinearAttentionContextParallel.apply`` checks): the triton p2p chain / prefix scan run
    >= 2 scan segments per rank, and the CP backend must take the options too."""
    acc = dict(cp=2, world_size=2, linear_attention_gdn_backend="triton",
               linear_attention_cp_modes=["ulysses", "prefix_scan", "all_gather"])
    model = {"gdn_backend": "triton", "gdn_kernel_options": {"num_segments": 1}}
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": model, "data": {"seq_len": 128}, **_acc(**acc)})
    msg = str(info.value)
    assert ("model.gdn_kernel_options with GDN CP mode 'prefix_scan' and train.accelerator."
            "linear_attention_gdn_backend='triton': num_segments=1 with mode='prefix_scan'") in msg
    assert "'ulysses'" not in msg and "'all_gather'" not in msg, msg  # they take one segment
    model["gdn_kernel_options"] = {"num_segments": 2}
    config_from_dict({"model": model, "data": {"seq_len": 128}, **_acc(**acc)})
    with pytest.raises(ConfigError) as info:  # eager options, triton CP layers
        config_from_dict({"model": {"gdn_kernel_options": {"block_chunks": 2}},
                          "data": {"seq_len": 128}, **_acc(**acc)})
    assert "block_chunks=2 applies to backend='eager' only" in str(info.value)


def test_set_overrides_are_validated_like_the_yaml() -> None:
    from overlap_runtime.config.train import apply_overrides

    base = config_from_dict(_acc(cp=2, world_size=4))
    cfg = apply_overrides(base, ["optimizer.lr=1e-4", "train.accelerator.cp=4",
                                 "train.pipeline.layers_per_stage=[2, 2]", "data.corpus=null"])
    assert cfg.optimizer.lr == 1e-4 and cfg.train.accelerator.cp == 4
    assert cfg.train.pipeline.layers_per_stage == [2, 2] and cfg.data.corpus is None
    assert base.optimizer.lr != 1e-4  # the original is untouched
    with pytest.raises(ConfigError) as info:
        apply_overrides(base, ["optimizer.lr=-1", "train.accelerator.cpp=2"])
    msg = str(info.value)
    assert "optimizer.lr: Input should be greater than 0" in msg
    assert "train.accelerator.cpp: Extra inputs are not permitted" in msg
    with pytest.raises(ConfigError, match="trainx is not a section of the configuration"):
        apply_overrides(base, ["trainx.steps=2"])
    with pytest.raises(ConfigError, match="expected DOTTED.FIELD=VALUE"):
        apply_overrides(base, ["optimizer.lr"])
    with pytest.raises(ConfigError, match="train.accelerator.cp=3 does not divide"):
        apply_overrides(base, ["train.accelerator.cp=3"])


@pytest.mark.parametrize("impl, fused, foreach", [("fused", True, None), ("foreach", None, True),
                                                  ("for_loop", None, False)])
def test_optimizer_implementation_reaches_adamw(impl: str, fused: Any, foreach: Any) -> None:
    """``optimizer.implementation`` picks AdamW's kernels explicitly (fused by default: the
    per-parameter loop cost 65 ms of a 240 ms step on an H200 with FSDP2's DTensors)."""
    import torch

    from overlap_runtime.trainer.loop import _optimizer

    cfg = config_from_dict({"optimizer": {"implementation": impl}})
    opt, _ = _optimizer([torch.nn.Parameter(torch.ones(3))], cfg)
    assert (opt.defaults.get("fused"), opt.defaults.get("foreach")) == (fused, foreach)
    assert config_from_dict({}).optimizer.implementation == "fused"
    with pytest.raises(ConfigError, match="implementation"):
        config_from_dict({"optimizer": {"implementation": "auto"}})
