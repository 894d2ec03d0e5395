"""Peak resident memory per rank while importing a Hugging Face checkpoint, against the size
of the rank's share.

    python -m benchmarks.hf_import_memory --dir /tmp/hf_synthetic --gib 4.5 \
        --layouts pp2_ep2 dp_shard4 pp4

Writes (once; kept when the directory already holds it) a synthetic Qwen3.5-MoE checkpoint of
about ``--gib`` GiB of fp32 safetensors in 1 GiB shards, as ``transformers`` lays it out
(``model.safetensors.index.json``, per-expert tensors), then for each layout spawns its CPU
ranks, each of which builds its part on the meta device, makes it parallel, materialises it and
loads its share (``trainer.build.build_parallel_model`` with ``model.init_from``). Each rank
resets its resident high-water mark (``/proc/self/clear_refs``) just before the build and reads
it (``VmHWM``) after the load; the table gives, per rank, the share it holds (its parameters'
bytes), the resident set before the build, the peak during build + load, and
``(peak - before) / share``: the bound the docs state is ``share + the largest single region
read + ~100 MiB``, so the ratio stays near 1 and never near the whole checkpoint. Linux only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

LAYOUTS = {"pp2_ep2": dict(pp=2, ep=2, dp_shard=2), "dp_shard4": dict(dp_shard=4),
           "pp4": dict(pp=4, dp_shard=1), "pp2_dp_shard2": dict(pp=2, dp_shard=2)}


def hf_config(gib: float) -> dict[str, Any]:
    """A Qwen3.5-MoE text config whose fp32 weights take about ``gib`` GiB."""
    hidden, inter, experts = 1024, 1024, 32
    per_layer = 4 * (experts * 3 * hidden * inter + 3 * hidden * inter + 4 * hidden * hidden)
    layers = max(4, int(round(gib * 2 ** 30 / per_layer / 4)) * 4)
    return {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
            "vocab_size": 32768, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
            "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": inter, "num_experts": experts,
            "num_experts_per_tok": 4, "router_aux_loss_coef": 0.0, "dtype": "float32"}


def write_checkpoint(directory: Path, gib: float) -> int:
    """The synthetic checkpoint (module docstring); returns its bytes."""
    from safetensors.torch import save_file

    from overlap_runtime.models import Qwen3_5Config
    from overlap_runtime.models.hf import config_from_hf
    from overlap_runtime.models.hf.load import _whole_model_names
    from overlap_runtime.models.hf.state_dict import hf_source

    directory.mkdir(parents=True, exist_ok=True)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    hf = hf_config(gib)
    cfg = Qwen3_5Config(**config_from_hf(hf))
    items: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in _whole_model_names(cfg):
        src = hf_source(name, "model.", cfg.num_experts)
        if src.stacked:
            items += [(k, (shape[2], shape[1])) for k in src.keys]
        else:
            items.append((src.keys[0], shape))
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, n, total = {}, {}, 0, 0, 0
    for i, (key, shape) in enumerate(items):
        shard[key] = torch.randn(shape, generator=gen) * 0.02
        size += shard[key].numel() * 4
        if size >= 2 ** 30 or i == len(items) - 1:
            n += 1
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            total += size
            shard, size = {}, 0
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf))
    return total


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rank_worker(rank: int, world: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    from overlap_runtime.trainer import config_from_dict
    from overlap_runtime.trainer.build import build_parallel_model
    from overlap_runtime.trainer.parallel_dims import ParallelDims

    config = config_from_dict(config_dict)
    dims = ParallelDims.of(config.train.accelerator.layout())
    dims.build_meshes("cpu")
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    pm = build_parallel_model(config, dims, torch.device("cpu"), dims.coordinates(rank)["pp"])
    seconds = time.perf_counter() - t0
    share = 0
    for p in pm.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        share += local.numel() * local.element_size()
    out = {"rank": rank, "share": share, "before": before, "peak": _status("VmHWM"),
           "seconds": seconds}
    pm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/hf_synthetic")
    ap.add_argument("--gib", type=float, default=4.5)
    ap.add_argument("--layouts", nargs="+", default=["pp2_ep2", "dp_shard4", "pp4"],
                    choices=sorted(LAYOUTS))
    args = ap.parse_args()
    from overlap_runtime.launch import spawn

    total = write_checkpoint(Path(args.dir), args.gib)
    gib = 2 ** 30
    print(f"checkpoint: {args.dir}, {total / gib:.2f} GiB fp32 "
          f"({len(list(Path(args.dir).glob('*.safetensors')))} files)")
    print("| layout | rank | share GiB | RSS before GiB | peak GiB | (peak - before) / share | "
          "build + load s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.layouts:
        acc = {"device": "cpu", "cp": 1, "world_size": 4, **LAYOUTS[name]}
        cfg = {"model": {"init_from": args.dir}, "data": {"seq_len": 64, "batch_size": 4},
               "train": {"accelerator": acc, "validate_step_graph": False,
                         "pipeline": {"schedule": "1f1b", "microbatches": 4}}}
        results = spawn(rank_worker, 4, args=(cfg,), timeout_s=1800)
        for r in sorted(results, key=lambda r: r["rank"]):
            ratio = (r["peak"] - r["before"]) / r["share"]
            print(f"| {name} | {r['rank']} | {r['share'] / gib:.2f} | {r['before'] / gib:.2f} | "
                  f"{r['peak'] / gib:.2f} | {ratio:.2f} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
