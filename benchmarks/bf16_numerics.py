"""bf16 CP training numerics on CPU ranks: the noise floor and CP at it (issue #25).

Two parts (``trainer.numerics``; docs/training.md, "bf16 numerics"):

* ``grads``: at fixed weights (the seed's, and the bf16 baseline's after ``--trained-steps``)
  and one batch, every parameter's gradient in bf16 on one device, on one device with the
  neutral changes (rows in 2 groups; GDN chunk 32), and under each CP layout, each against an fp32 one-device
  reference (rel-L2 per tensor). Prints the worst tensors and the ratio CP error / one-device
  error; the GDN decay parameters (A_log, dt_bias) also in units of their summed per-token
  magnitude (``gate_scaled_errors``: their sums cancel, so rel-L2 reads the conditioning).
* ``trajectories``: ``train.steps`` steps of one device (the baseline), of the noise floors (one
  device with the batch rows in two groups whose bf16 gradients are summed in fp32, and one
  device with ``model.gdn_chunk_size`` 32) and of each CP layout (spawned gloo ranks);
  per-step relative loss and grad-norm differences against the baseline, a table and a plot.

::

    python -m benchmarks.bf16_numerics configs/cpu_bf16_numerics.yaml \
        [--part all|grads|trajectories] [--steps 100] [--out out/bf16_numerics.json] \
        [--plot docs/bf16_numerics.png] [--seq-len 256 --grad-step 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from overlap_runtime.launch import spawn
from overlap_runtime.config.train import TrainConfig, load_config
from overlap_runtime.trainer.loop import spawn_training, train_single
from overlap_runtime.trainer.numerics import (distributed_gradients, floor_config,
                                              gate_gradient_scales, gate_scaled_errors,
                                              gradient_errors, initial_weights,
                                              single_gradients, step_differences,
                                              trained_weights)

# (cp, GDN mode, attention mode): "p2p" pairs the GDN state chain with ring attention (LSE merge)
LAYOUTS = [(2, "p2p", "ring"), (2, "ulysses", "ulysses"), (4, "p2p", "ring"),
           (4, "ulysses", "ulysses")]


def layout_config(config: TrainConfig, cp: int, gdn: str, attn: str) -> TrainConfig:
    data = config.model_dump()
    data["train"]["accelerator"].update(world_size=cp, cp=cp, linear_attention_cp_mode=gdn,
                                        full_attention_cp_mode=attn)
    return TrainConfig.model_validate(data)


def label(cp: int, gdn: str) -> str:
    return f"cp{cp} {gdn}"


def _grads_rank(rank: int, world: int, config: dict[str, Any], weights: dict, step: int
                ) -> dict[str, torch.Tensor] | None:
    torch.set_num_threads(1)
    out = distributed_gradients(TrainConfig.model_validate(config), weights, step)
    return out if rank == 0 else None


def gradient_study(config: TrainConfig, trained_steps: int, step: int) -> dict[str, Any]:
    """Per-tensor rel-L2 at the seed's and at trained weights, against fp32 one device and
    against bf16 one device (the floor row is the distance of two valid bf16 computations)."""
    result: dict[str, Any] = {}
    for tag, weights in (("init", initial_weights(config)),
                         (f"trained{trained_steps}", trained_weights(config, trained_steps))):
        ref = single_gradients(config, weights, step, "fp32")
        single = single_gradients(config, weights, step, "bf16")
        grads = {"single bf16": single,
                 "floor (rows in 2 groups)": single_gradients(config, weights, step, "bf16",
                                                              grad_microbatches=2),
                 "floor (GDN chunk 32)": single_gradients(floor_config(config, 32), weights,
                                                          step, "bf16")}
        for cp, gdn, attn in LAYOUTS:
            c = layout_config(config, cp, gdn, attn)
            grads[label(cp, gdn)] = spawn(_grads_rank, cp, args=(c.model_dump(), weights, step),
                                          device="cpu", timeout_s=600)[0]
        scales = gate_gradient_scales(config, weights, step)
        rows = {run: {"vs_fp32": gradient_errors(g, ref),
                      "vs_single_bf16": gradient_errors(g, single),
                      "gate_vs_fp32": gate_scaled_errors(g, ref, scales),
                      "gate_vs_single_bf16": gate_scaled_errors(g, single, scales)}
                for run, g in grads.items()}
        result[tag] = rows
        base = rows["single bf16"]["vs_fp32"]
        floor = rows["floor (rows in 2 groups)"]["vs_single_bf16"]
        print(f"\n== gradients at {tag} weights, batch of step {step} (rel-L2 per tensor)")
        print(f"{'run':<22} {'vs fp32: median':>15} {'max':>8} {'max ratio':>9}   "
              f"{'vs bf16 one device: median':>26} {'max':>8}  worst tensor")
        for run, r in rows.items():
            e, d = r["vs_fp32"], r["vs_single_bf16"]
            ratios = {n: e[n] / max(base[n], 1e-12) for n in e}
            worst = max(d, key=lambda n: d[n] / max(floor[n], 1e-12))
            print(f"{run:<22} {statistics.median(e.values()):15.2e} {max(e.values()):8.2e} "
                  f"{max(ratios.values()):9.2f}   {statistics.median(d.values()):26.2e} "
                  f"{max(d.values()):8.2e}  {worst}")
        kappa = {n: float((scales[n] / ref[n].abs().clamp_min(1e-30)).max()) for n in scales}
        gate_base = rows["single bf16"]["gate_vs_fp32"]
        print(f"A_log / dt_bias (cancellation sum|terms| / |sum| up to {max(kappa.values()):.0f}): "
              f"in units of sum|terms|, worst over the {len(scales)} tensors")
        print(f"{'run':<22} {'rel-L2 vs fp32 / one device':>27} {'vs bf16 one device / one-device error':>38}"
              f" {'vs fp32 / one device':>21}")
        for run, r in rows.items():
            rel = max(r["vs_fp32"][n] / max(base[n], 1e-12) for n in scales)
            dist = max(r["gate_vs_single_bf16"][n] / gate_base[n] for n in scales)
            err = max(r["gate_vs_fp32"][n] / gate_base[n] for n in scales)
            print(f"{run:<22} {rel:27.2f} {dist:38.3f} {err:21.3f}")
    return result


def trajectory_study(config: TrainConfig) -> dict[str, Any]:
    """Per-step rel differences against one device: the floor runs and every CP layout."""
    t0 = time.perf_counter()
    base = train_single(config, log=lambda line: None)
    print(f"one device: {config.train.steps} steps in {time.perf_counter() - t0:.0f} s, loss "
          f"{base.steps[0].loss:.3f} -> {base.steps[-1].loss:.3f}")
    runs: dict[str, Any] = {"baseline": base.to_dict(), "diffs": {}}
    floors = {"floor (rows in 2 groups)": lambda: train_single(config, log=lambda line: None,
                                                               grad_microbatches=2),
              "floor (GDN chunk 32)": lambda: train_single(floor_config(config, 32),
                                                           log=lambda line: None)}
    for name, run in floors.items():
        runs["diffs"][name] = [d.__dict__ for d in step_differences(run(), base)]
    for cp, gdn, attn in LAYOUTS:
        t0 = time.perf_counter()
        r = spawn_training(layout_config(config, cp, gdn, attn), quiet=True)
        runs["diffs"][label(cp, gdn)] = [d.__dict__ for d in step_differences(r, base)]
        print(f"{label(cp, gdn)}: {time.perf_counter() - t0:.0f} s")
    print_table(runs["diffs"])
    return runs


def print_table(diffs: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n{'run':<20} {'max rel loss':>13} {'max rel gnorm':>14} {'median rel loss':>16} "
          f"{'median rel gnorm':>17}")
    for run, d in diffs.items():
        loss = [x["rel_loss"] for x in d]
        gn = [x["rel_grad_norm"] for x in d]
        print(f"{run:<20} {max(loss):13.2e} {max(gn):14.2e} {statistics.median(loss):16.2e} "
              f"{statistics.median(gn):17.2e}")


def plot(runs: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    styles = {"floor": dict(color="0.2", lw=2.4), "p2p": dict(ls="-"),
              "ulysses": dict(ls="--")}
    for run, d in runs["diffs"].items():
        kind = "floor" if run.startswith("floor") else run.split()[-1]
        style = dict(styles[kind])
        if kind == "floor":
            style["ls"] = "-" if "rows" in run else ":"
        steps = [x["step"] for x in d]
        # a running max reads better than per-step points that touch zero
        for ax, key in zip(axes, ("rel_loss", "rel_grad_norm")):
            vals, top = [], 0.0
            for x in d:
                top = max(top, x[key])
                vals.append(max(top, 1e-9))
            ax.plot(steps, vals, label=run, **style)
    for ax, what in zip(axes, ("loss", "grad norm")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(f"running max |d {what}| / {what} vs one device")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--part", choices=("all", "grads", "trajectories"), default="all")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--trained-steps", type=int, default=50)
    p.add_argument("--grad-step", type=int, default=200, help="data step of the batch")
    p.add_argument("--seq-len", type=int, default=None, help="data.seq_len (the test: 256)")
    p.add_argument("--out", default="out/bf16_numerics.json")
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config)
    if args.steps:
        config = config.with_overrides(steps=args.steps)
    if args.seq_len:
        data = config.model_dump()
        data["data"]["seq_len"] = args.seq_len
        config = TrainConfig.model_validate(data)
    out: dict[str, Any] = {"config": config.model_dump(mode="json")}
    if args.part in ("all", "grads"):
        out["gradients"] = gradient_study(config, args.trained_steps, args.grad_step)
    if args.part in ("all", "trajectories"):
        out["trajectories"] = trajectory_study(config)
        if args.plot:
            m = config.model
            plot(out["trajectories"], Path(args.plot),
                 f"bf16 on CPU gloo ranks: hidden {m.hidden_size}, {m.num_hidden_layers} layers, "
                 f"seq {config.data.seq_len}, AdamW lr {config.optimizer.lr:g}, "
                 f"{config.train.steps} steps")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
