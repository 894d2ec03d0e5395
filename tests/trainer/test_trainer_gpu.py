"""The trainer's long-run tooling on a CUDA device (skipped without one; run on the H200):
streamed metrics with MFU and peak memory, a torch.profiler window holding CUDA kernels next to
our range names, and checkpoint / resume of a bf16 run.

    python -m pytest -q tests/trainer/test_trainer_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from overlap_runtime.trainer import config_from_dict, train_single

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _config(steps: int, tmp: Path, checkpoint: dict[str, Any], profile: bool) -> dict[str, Any]:
    return {
        "model": {"hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 2816,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                  "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                  "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "attention_backend": "flash", "gdn_backend": "triton"},
        "data": {"seq_len": 4096, "batch_size": 2},
        "optimizer": {"lr": 3e-4, "warmup_steps": 2},
        "train": {"steps": steps, "seed": 0, "precision": "bf16",
                  "accelerator": {"device": "cuda", "world_size": 1, "cp": 1}},
        "checkpoint": checkpoint,
        "metrics": {"jsonl": str(tmp / "run.jsonl"), "progress": "lines"},
        "profiling": {"enable": profile, "steps": [3, 4], "dir": str(tmp / "prof")},
    }


def test_metrics_profiler_and_resume_on_cuda(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    lines: list[str] = []
    first = train_single(config_from_dict(_config(6, tmp_path, {"dir": ckpt, "interval": 3},
                                                  True)), "cuda:0", lines.append)
    records = [json.loads(x) for x in (tmp_path / "run.single.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    steady = records[2:]
    mfu = [r["mfu"] for r in steady]
    print("MFU per step:", [f"{m:.3f}" for m in mfu], "peak memory",
          steady[-1].get("peak_memory_bytes"))
    assert all(m is not None and 0.0 < m < 1.0 for m in mfu), mfu
    assert all(r.get("peak_memory_bytes") for r in steady)

    traces = sorted((tmp_path / "prof").rglob("*.json"))
    assert traces, list((tmp_path / "prof").rglob("*"))
    events = json.loads(next(p for p in traces if "rank" in p.name).read_text())["traceEvents"]
    cats = {e.get("cat") for e in events}
    names = {str(e.get("name")) for e in events}
    assert "kernel" in cats, sorted(c for c in cats if c)[:20]
    assert any(n.startswith("train.step") for n in names)

    again = train_single(config_from_dict(_config(
        6, tmp_path, {"dir": ckpt, "resume": str(Path(ckpt) / "step-00000003"),
                      "save_final": False}, False)), "cuda:0", lines.append)
    straight = {m.step: m.loss for m in first.steps}
    resumed = {m.step: m.loss for m in again.steps}
    assert sorted(resumed) == [4, 5, 6]
    diffs = {s: abs(resumed[s] - straight[s]) / abs(straight[s]) for s in resumed}
    print("resume vs straight, rel loss diff per step:", diffs)
    assert resumed[4] == straight[4]  # the same weights and batch: the first step is exact
    assert max(diffs.values()) <= 1e-3, diffs
    # the floor: the same straight run again (nondeterministic GPU backward kernels)
    repeat = train_single(config_from_dict(_config(6, tmp_path / "repeat", {}, False)),
                          "cuda:0", lines.append)
    floor = {m.step: abs(m.loss - straight[m.step]) / abs(straight[m.step])
             for m in repeat.steps}
    print("straight vs straight again, rel loss diff per step:", floor)
