"""``overlap-runtime export``: a checkpoint of ours (any layout) as a Hugging Face directory.

- An import saved before any step and exported is bitwise the original safetensors, in their
  stored dtype (bf16 in, fp32 master weights, bf16 out).
- A pp2 x ep2 run of an imported MoE model, checkpointed after 2 steps and exported, loads with
  ``transformers.AutoModelForCausalLM.from_pretrained`` and computes our logits (rel-L2 <= 1e-5
  in fp32) from the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from tests.support.hf_tiny import save_hf, train_config, train_worker  # noqa: E402

from overlap_runtime.cli import main as cli_main  # noqa: E402
from overlap_runtime.trainer.hf_export import read_checkpoint_tensors  # noqa: E402
from overlap_runtime.testing import rel_l2, run_ranks  # noqa: E402
from overlap_runtime.trainer import config_from_dict  # noqa: E402
from overlap_runtime.trainer.build import build_model  # noqa: E402
from overlap_runtime.trainer.checkpoint import Checkpointer, latest_checkpoint  # noqa: E402
from overlap_runtime.trainer.data import build_dataset  # noqa: E402


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_of_an_import_is_bitwise_the_original(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "hf"
    save_hf(kind, src, seed=6, dtype=torch.bfloat16)
    cfg = train_config(str(src))
    cfg["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    config = config_from_dict(cfg)
    assert config.model.hf_dtype == "bfloat16"
    model = build_model(config)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = Checkpointer(config.checkpoint, [model], opt, sched,
                        build_dataset(config.data, 1, 0), layout="single",
                        device=torch.device("cpu"), model_config=config.model.identity(),
                        distributed=False)
    ckpt.save(0)
    out = tmp_path / "out"
    assert cli_main(["export", str(latest_checkpoint(config.checkpoint.dir)), "--hf",
                     str(out), "--max-shard-size", "0.0001"]) == 0
    original, exported = _tensors(src), _tensors(out)
    assert set(exported) == set(original)
    for key, value in original.items():
        assert exported[key].dtype == torch.bfloat16, key
        assert torch.equal(exported[key], value), key
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 0.0001 GiB


def test_export_refuses_a_checkpoint_that_fails_verification(tmp_path: Path, capsys) -> None:
    src = tmp_path / "hf"
    save_hf("dense", src, seed=6)
    cfg = train_config(str(src))
    cfg["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    config = config_from_dict(cfg)
    model = build_model(config)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(config.checkpoint, [model], opt,
                 torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                 build_dataset(config.data, 1, 0), layout="single", device=torch.device("cpu"),
                 model_config=config.model.identity(), distributed=False).save(0)
    step = latest_checkpoint(config.checkpoint.dir)
    shard = sorted(step.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(["export", str(step), "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert shard.name in err, err
    assert not (tmp_path / "out" / "config.json").exists()


def test_trained_pp2_ep2_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tmp_path / "hf"
    save_hf("moe", src, seed=7, top_k=2)
    cfg = train_config(str(src), steps=2, world=4, pp=2, ep=2,
                       pipeline={"schedule": "1f1b", "microbatches": 4})
    cfg["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    run_ranks(train_worker, 4, timeout_s=300, args=([cfg],))
    step = latest_checkpoint(tmp_path / "ckpt")
    assert step is not None and step.name == "step-00000002"
    out = tmp_path / "out"
    assert cli_main(["export", str(step), "--hf", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"

    config = config_from_dict(train_config(str(src)))
    ours = build_model(config)  # then the checkpoint's weights, read back by name
    params = dict(ours.named_parameters())
    moved = set()
    with torch.no_grad():
        for name, expert, value in read_checkpoint_tensors(step):
            (params[name][expert] if expert is not None else params[name]).copy_(value)
            moved.add(name)
    assert moved == set(params)
    ids = torch.randint(0, 272, (2, 100), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        err = rel_l2(ours(ids), hf(ids).logits)
    assert err <= 1e-5, err
    # the training moved the weights: the export is not the import
    assert not torch.equal(_tensors(out)["model.embed_tokens.weight"],
                           _tensors(src)["model.embed_tokens.weight"])
