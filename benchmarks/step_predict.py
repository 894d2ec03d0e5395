"""Predicted vs measured training steps on CPU ranks (gloo): pp2, pp4, pp2 x ep2 with
OVERLAP_B_F and pp2 x cp2 (issue #21, item 3).

For each layout the trainer runs a few steps with an execution trace. Node costs come from the
same run (``stepgraph.costs.measured_costs``: per stage and action kind the median busy time,
i.e. the action's span less the waits inside it; per action its all-to-alls; a pipeline
message costs its measured delivery, from its producer's end to the end of the receiver's
wait, or the gloo ping latency when no receiver waited), the step is
simulated on every rank with that rank's own costs (the expert all-to-alls as collectives of
their EP group, so peers wait for each other) and compared with the measured step:
pipeline step time (first action to last) and bubble (``pipeline.measured_bubble``). Each step
is predicted from the costs measured in that step (other jobs move this shared host's step times
by 2-3x from one step to the next), and the errors are the medians over the steps after the
first; the last column simulates one representative rank per pipeline rank with the stage's
median costs instead (what ``overlap-runtime simulate`` does at scale). With more ranks than cores the ranks share the cores
(``stepgraph.shared_cores``): the costs are turned into full-speed work and the simulation runs
each computing rank at ``cores / k``.

    .venv/bin/python -m benchmarks.step_predict --steps 6 [--only pp4] [--cores 2]

The model: hidden 128, 4 layers (3 GDN + 1 attention), seq 256, 8 sequences = 8 microbatches
per step, fp32, one thread per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

MOE = {"mlp": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
       "shared_expert_intermediate_size": 128}


def layout(world: int, pipeline: dict[str, Any], model: dict[str, Any] | None = None,
           steps: int = 6, **acc: Any) -> dict[str, Any]:
    accelerator = {"device": "cpu", "cp": 1, "world_size": world, "comm_timeout_s": 120.0, **acc}
    return {
        "model": {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "linear_key_head_dim": 32, "linear_value_head_dim": 32, **(model or {})},
        "data": {"seq_len": 256, "batch_size": 8},
        "optimizer": {"lr": 1e-3},
        "train": {"steps": steps, "seed": 0, "precision": "fp32", "accelerator": accelerator,
                  "pipeline": pipeline},
    }


def layouts(steps: int) -> dict[str, dict[str, Any]]:
    return {
        "pp2": layout(2, {"schedule": "1f1b", "microbatches": 8}, steps=steps, pp=2),
        "pp4": layout(4, {"schedule": "1f1b", "microbatches": 8}, steps=steps, pp=4),
        "pp2_ep2_overlap_b_f": layout(
            4, {"schedule": "interleaved_1f1b", "microbatches": 8, "virtual_stages": 2,
                "overlap_b_f": True}, model=MOE, steps=steps, pp=2, ep=2),
        "pp2_cp2": layout(4, {"schedule": "1f1b", "microbatches": 8}, steps=steps, pp=2, cp=2,
                          linear_attention_cp_mode="p2p", full_attention_cp_mode="ring"),
    }


def run_layout(cfg: dict[str, Any], cores: int) -> dict[str, Any]:
    """Train ``cfg`` traced, then predict it from its own measured costs."""
    from overlap_runtime.stepgraph.costs import measured_costs
    from overlap_runtime.trainer.measure import merge_ranks, traced_training
    from overlap_runtime.stepgraph.predict import measured_step, predict_step
    from overlap_runtime.testing import run_ranks
    from overlap_runtime.trainer import config_from_dict

    world = cfg["train"]["accelerator"]["world_size"]
    results = run_ranks(traced_training, world, timeout_s=900, args=(cfg,))
    steps = merge_ranks(results)[1:]  # the first step warms up
    config = config_from_dict(cfg)
    latency = results[0]["latency_s"]
    rows = []
    for ev in steps:  # each step from the costs measured in it (the load of this shared host
        m = measured_step(ev)  # moves step times by 2-3x between steps)
        costs = measured_costs([ev], cores=cores)
        message = costs.comm.get("p2p_delivery", latency)
        rows.append((m, predict_step(config, costs, message_s=message, cores=cores),
                     predict_step(config, costs, message_s=message, cores=cores,
                                  per_rank=False)))
    med = statistics.median
    return {"measured_step_s": med(m.step_s for m, _, _ in rows),
            "measured_bubble": med(m.bubble for m, _, _ in rows),
            "predicted_step_s": med(p.step_s for _, p, _ in rows),
            "predicted_bubble": med(p.bubble for _, p, _ in rows),
            "step_err": med(p.step_s / m.step_s - 1 for m, p, _ in rows),
            "bubble_err": med(p.bubble / m.bubble - 1 for m, p, _ in rows),
            "rep_step_err": med(r.step_s / m.step_s - 1 for m, _, r in rows),
            "rep_bubble_err": med(r.bubble / m.bubble - 1 for m, _, r in rows),
            "steps": [round(m.step_s * 1e3) for m, _, _ in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps (the first is dropped)")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores the ranks share (default: this host's)")
    args = ap.parse_args()
    print(f"cores {args.cores}, load average {os.getloadavg()[0]:.1f} before the runs, "
          f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print("| layout | measured step ms (each step) | predicted step ms | step error | measured "
          "bubble | predicted bubble | bubble error | one rank per stage: step / bubble error |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name, cfg in layouts(args.steps).items():
        if args.only and name not in args.only:
            continue
        r = run_layout(cfg, args.cores)
        print(f"| {name} | {r['measured_step_s'] * 1e3:.1f} ({', '.join(map(str, r['steps']))}) "
              f"| {r['predicted_step_s'] * 1e3:.1f} | {r['step_err']:+.1%} | "
              f"{r['measured_bubble']:.3f} | {r['predicted_bubble']:.3f} | "
              f"{r['bubble_err']:+.1%} | {r['rep_step_err']:+.1%} / "
              f"{r['rep_bubble_err']:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
