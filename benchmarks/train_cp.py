"""FSDP2 + CP training of the Qwen3.5-style hybrid: Ulysses vs P2P GDN CP, and loss alignment.

GPU (2 x H200, the issue #11 figures)::

    torchrun --nproc-per-node 2 -m benchmarks.train_cp configs/gpu_cp2_16k.yaml
    # add --align-seq-len 16384 if the single-GPU baseline does not fit at global 32K

CPU smoke test (spawns 2 gloo ranks, tiny model; timings on a shared CPU mean nothing)::

    python -m benchmarks.train_cp --smoke

For each GDN CP mode (``--modes``, default ulysses and p2p; the full-attention layers use the
config's ``full_attention_cp_mode``) the script

1. times ``--warmup + --steps`` training steps of the config (FSDP2 over all ranks + CP) and
   reports the median step time over the last ``--steps`` (max over ranks, device synchronised),
   tokens/s and the peak allocated memory (max over ranks);
2. trains ``--align-steps`` steps (default 50) at ``--align-seq-len`` (default: the config's
   global length) and, after all distributed runs, rank 0 trains the same steps on one device
   (``trainer.train_single``, whole global sequence) and reports the largest loss and grad-norm
   differences per mode. The baseline runs last, so the other ranks have left before it starts.

Output: a table on rank 0, and JSON to ``--json`` (default ``$OUT/train_cp.json`` if OUT is
set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


from overlap_runtime.trainer import (  # noqa: E402
    TrainConfig,
    TrainResult,
    compare_runs,
    config_from_dict,
    load_config,
    train_distributed,
    train_single,
)

SMOKE = {
    "data": {"seq_len": 128},
    "optimizer": {"lr": 3e-3},
    "train": {"steps": 4, "precision": "fp32",
              "accelerator": {"device": "cpu", "cp": 2, "world_size": 2}},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="configs/gpu_cp2_16k.yaml")
    p.add_argument("--modes", nargs="+", choices=["ulysses", "p2p", "all_gather"],
                   default=["ulysses", "p2p"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    p.add_argument("--align-steps", type=int, default=50, help="0: skip the alignment")
    p.add_argument("--align-seq-len", type=int, default=None,
                   help="global length of the alignment runs (default: the config's)")
    p.add_argument("--activation-checkpoint", action="store_true")
    p.add_argument("--corpus", default=None,
                   help="override data.corpus: a UTF-8 text file (the packaged corpus is 29 KB, "
                        "so a long run at 32K tokens a step memorises it)")
    p.add_argument("--gdn-backend", choices=["eager", "triton"], default=None,
                   help="override model.gdn_backend and linear_attention_gdn_backend "
                        "(default: the config's)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model on 2 CPU ranks, few steps (checks that the script runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps, args.align_steps = 1, 2, min(args.align_steps, 5)
    return args


def base_config(args: argparse.Namespace) -> TrainConfig:
    if args.smoke:
        return config_from_dict(SMOKE)
    return load_config(args.config)


def variant(cfg: TrainConfig, args: argparse.Namespace, mode: str, steps: int,
            seq_len: int | None = None) -> TrainConfig:
    """``cfg`` with this run's GDN CP mode, steps, length and the command-line overrides."""
    data = cfg.model_dump()
    if args.corpus is not None:
        data["data"]["corpus"] = args.corpus
    if args.gdn_backend is not None:
        data["model"]["gdn_backend"] = args.gdn_backend
        data["train"]["accelerator"]["linear_attention_gdn_backend"] = args.gdn_backend
    data["train"]["accelerator"]["linear_attention_cp_mode"] = mode
    data["train"]["steps"] = steps
    data["train"]["activation_checkpoint"] = (args.activation_checkpoint
                                              or data["train"]["activation_checkpoint"])
    if seq_len is not None:
        data["data"]["seq_len"] = seq_len
    return config_from_dict(data, "(benchmark variant)")


def run_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """All distributed runs on this rank (the process group is up); rank 0 returns them."""
    cfg = base_config(args)
    acc = cfg.train.accelerator
    if acc.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    else:
        device = torch.device(acc.device)
    quiet = (lambda line: None)
    out: dict[str, Any] = {"timing": {}, "align": {}}
    for mode in args.modes:
        res = train_distributed(variant(cfg, args, mode, args.warmup + args.steps), device, quiet)
        timed = res.steps[args.warmup:]
        med = statistics.median(s.step_time_s for s in timed)
        out["timing"][mode] = {
            "step_time_s": med, "tokens_per_s": timed[0].tokens / med,
            "peak_memory_bytes": res.peak_memory_bytes, "world_size": res.world_size,
            "cp": res.cp, "global_seq": cfg.data.seq_len, "final_loss": res.steps[-1].loss}
        if rank == 0:
            print(f"[{mode}] median step {med * 1e3:.1f} ms", flush=True)
    if args.align_steps > 0:
        for mode in args.modes:
            res = train_distributed(variant(cfg, args, mode, args.align_steps,
                                            args.align_seq_len), device, quiet)
            out["align"][mode] = res.to_dict()
    dist.barrier()
    return out if rank == 0 else None


def baseline_and_report(args: argparse.Namespace, out: dict[str, Any], device: torch.device,
                        world: int) -> None:
    cfg = base_config(args)
    rows = []
    baseline = None
    align_len = args.align_seq_len or cfg.data.seq_len
    if args.align_steps > 0:
        ref_cfg = variant(cfg, args, args.modes[0], args.align_steps, args.align_seq_len)
        try:
            baseline = train_single(ref_cfg, device)
        except torch.cuda.OutOfMemoryError as exc:  # type: ignore[attr-defined]
            print(f"single-device baseline at global {align_len} did not fit ({exc}); rerun with "
                  f"--align-seq-len {align_len // 2}", flush=True)
    for mode in args.modes:
        t = out["timing"][mode]
        row = {"mode": mode, **t}
        if baseline is not None:
            row.update(compare_runs(TrainResult.from_dict(out["align"][mode]), baseline))
        rows.append(row)
    print(f"\nFSDP{world} + CP{cfg.train.accelerator.cp}, {cfg.model.num_hidden_layers} layers, "
          f"hidden {cfg.model.hidden_size}, global {cfg.data.seq_len} tokens "
          f"(local {cfg.data.seq_len // cfg.train.accelerator.cp}), {cfg.train.precision}, "
          f"activation checkpoint {args.activation_checkpoint or cfg.train.activation_checkpoint}")
    print("| GDN CP mode | step ms | tokens/s | peak MiB | align steps @ global | "
          "max dloss abs / rel | max dgrad-norm abs / rel |")
    print("|---|---:|---:|---:|---|---|---|")
    for r in rows:
        peak = r["peak_memory_bytes"]
        peak_s = f"{peak / 2**20:.0f}" if peak is not None else "-"
        if "max_abs_dloss" in r:
            align = (f"{r['steps']} @ {align_len} | {r['max_abs_dloss']:.3e} / "
                     f"{r['max_rel_dloss']:.3e} | {r['max_abs_dgrad_norm']:.3e} / "
                     f"{r['max_rel_dgrad_norm']:.3e}")
        else:
            align = "- | - | -"
        print(f"| {r['mode']} | {r['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{peak_s} | {align} |")
    path = args.json or (os.path.join(os.environ["OUT"], "train_cp.json")
                         if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({
            "rows": rows, "align_seq_len": align_len, "runs": out,
            "baseline": None if baseline is None else baseline.to_dict()}, indent=2))
        print(f"JSON written to {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = base_config(args)
    acc = cfg.train.accelerator
    if "RANK" in os.environ:  # torchrun
        from overlap_runtime.launch import init_from_env

        ctx = init_from_env(acc.device, timeout_s=1800)
        out = run_rank(ctx.rank, ctx.world_size, args)
        if ctx.rank == 0:
            assert out is not None
            baseline_and_report(args, out, ctx.device, ctx.world_size)
            dist.destroy_process_group()
        return
    from overlap_runtime.launch import spawn

    world = acc.resolved_world_size
    out = spawn(run_rank, world, args=(args,), device=acc.device, timeout_s=3600)[0]
    device = torch.device("cuda:0" if acc.device == "cuda" else acc.device)
    baseline_and_report(args, out, device, world)


if __name__ == "__main__":
    main()
