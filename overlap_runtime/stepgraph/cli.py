"""``overlap-runtime simulate CONFIG.yaml [--set dotted.field=value ...]``: predict one training
step of a trainer configuration at any scale, without running it.

Example::

    overlap-runtime simulate configs/sim_moe_h200.yaml --set train.accelerator.pp=32 \\
        --set train.accelerator.ep=64 --set train.accelerator.cp=64

The configuration is loaded and validated exactly like ``overlap-runtime train`` (every broken
rule named, exit 2), but no device is needed: the step is simulated on a machine profile
(``--profile h200``: docs/benchmarks.md's H200 figures, NVLink inside ``--gpus-per-node`` GPUs,
the documented inter-node bandwidth). Prints the step time (pipeline + FSDP + optimizer), the
bubble, the exposed communication and the peak memory per pipeline rank
(:mod:`overlap_runtime.stepgraph.scale`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from overlap_runtime.config.hf import ARCHITECTURE_FIELDS
from overlap_runtime.config.train import apply_overrides, config_from_dict, load_config

from .cli_args import add_arguments
from .costs import h200_profile
from .scale import predict_at_scale

def _profile(args: argparse.Namespace):  # noqa: ANN202

    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node={args.gpus_per_node} must be >= 1")
    if not args.compute_scale > 0:
        raise ValueError(f"--compute-scale={args.compute_scale} must be > 0")
    prof = h200_profile(args.gpus_per_node)
    if args.compute_scale != 1.0:
        prof = replace(prof, flops={k: v / args.compute_scale for k, v in prof.flops.items()})
    return prof


def _with_hf_model(config, path: str):  # noqa: ANN001, ANN202
    """``config`` with the architecture of the Hugging Face config at ``path`` (the YAML's
    architecture fields dropped; its backends and kernel choices kept)."""
    data = config.model_dump(mode="json", exclude_unset=True)
    model = {k: v for k, v in data.get("model", {}).items() if k not in ARCHITECTURE_FIELDS}
    return config_from_dict({**data, "model": {**model, "init_from": path}}, f"--model {path}")


def run(args: argparse.Namespace) -> int:

    try:
        config = load_config(args.config)
        if args.model:
            config = _with_hf_model(config, args.model)
        if args.set:
            config = apply_overrides(config, list(args.set),
                                     f"{args.config} with " + " ".join(f"--set {a}" for a in args.set))
        profile = _profile(args)
    except ValueError as exc:  # ConfigError too: one line, exit 2
        print("error: " + " ".join(ln.strip() for ln in str(exc).splitlines()), file=sys.stderr)
        return 2
    pred = predict_at_scale(config, profile, representative=not args.full)
    gib = 2 ** 30
    print(f"{pred.config_label}: {pred.world} ranks on {profile.name} "
          f"({profile.gpus_per_node} per node); simulated {pred.represented_ranks} "
          f"{'ranks' if args.full else 'representative ranks (one per pipeline rank)'}, "
          f"{pred.tasks} tasks, build {pred.build_s:.2f} s + simulate {pred.simulate_s:.2f} s")
    print(f"step {pred.step_s * 1e3:.1f} ms = pipeline {pred.pipeline_s * 1e3:.1f} + FSDP "
          f"{pred.fsdp_s * 1e3:.1f} + optimizer {pred.optimizer_s * 1e3:.1f}; bubble "
          f"{pred.bubble:.4f} (idle device time, exposed communication included); exposed "
          f"communication {pred.exposed_comm_s * 1e3:.1f} ms (worst rank); peak memory "
          f"{pred.peak_memory_bytes / gib:.2f} GiB (worst rank)")
    print("| pp rank | busy ms | bubble | exposed comm ms | params+optimizer GiB | gathered "
          "GiB | activations GiB | peak GiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    seen = set()
    for r in pred.ranks:
        if r.pp_rank in seen:
            continue
        seen.add(r.pp_rank)
        m = r.memory
        print(f"| {r.pp_rank} | {r.busy_s * 1e3:.1f} | {r.bubble:.4f} | "
              f"{r.exposed_comm_s * 1e3:.1f} | {m['params'] / gib:.2f} | "
              f"{m['gathered'] / gib:.2f} | {m['activations'] / gib:.2f} | "
              f"{m['total'] / gib:.2f} |")
    for note in pred.notes:
        print(f"note: {note}")
    print(f"profile: {profile.source}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": pred.config_label, "profile": profile.name, "world": pred.world,
                       "step_s": pred.step_s, "pipeline_s": pred.pipeline_s,
                       "fsdp_s": pred.fsdp_s, "optimizer_s": pred.optimizer_s,
                       "bubble": pred.bubble, "exposed_comm_s": pred.exposed_comm_s,
                       "peak_memory_bytes": pred.peak_memory_bytes,
                       "ranks": [{"pp_rank": r.pp_rank, "busy_s": r.busy_s, "bubble": r.bubble,
                                  "exposed_comm_s": r.exposed_comm_s, "memory": r.memory}
                                 for r in pred.ranks]}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0
