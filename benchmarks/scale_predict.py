"""Predictions of the step simulator (``overlap-runtime simulate``) on the H200 profile next to
the seed's measured tables (issue #21 item 4), with our measured CP2 figures as the
calibration point:

* seed 000 section 9.4: one complete GDN layer (hidden 2048, 16/32 heads of 128, bf16, no MLP),
  forward + backward, Ulysses vs P2P, CP4 / CP8;
* seed 000 section 9.6: the whole 4- and 8-layer hybrid (3 GDN + 1 attention per 4 layers,
  SwiGLU 6144) with FSDP over the CP ranks, local 16K, Ulysses vs P2P, CP4 / CP8;
* seed 001 OV-B06: the share of expert all-to-all time hidden behind the other thread's
  compute in OVERLAP_B_F steps (measured 90.5% on 2 H200, docs/benchmarks.md "MoE overlap").

    .venv/bin/python -m benchmarks.scale_predict

Pure simulation (no device): a few seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEED_94 = {  # (cp, global K) -> (ulysses ms, p2p ms), Ascend NPUs
    (4, 32): (76.884, 65.807), (4, 64): (160.283, 132.973), (4, 128): (311.687, 281.569),
    (8, 64): (98.427, 67.336), (8, 128): (279.313, 151.257)}
SEED_96 = {  # (cp, layers) -> (ulysses ms, p2p ms), local 16K
    (4, 4): (854.047, 778.644), (4, 8): (1686.321, 1529.381),
    (8, 4): (1151.401, 967.863), (8, 8): (2276.529, 1915.960)}
MEASURED_CP2_LAYER = {"ulysses": 28.32, "p2p": 22.68}  # local 16K, docs/benchmarks.md
MEASURED_CP2_STEP = {"ulysses": 154.6, "p2p": 137.0}  # configs/gpu_cp2_16k.yaml


def _config(overrides: dict[str, Any]) -> Any:
    from overlap_runtime.config.train import apply_overrides, load_config

    root = Path(__file__).resolve().parents[1]
    return apply_overrides(load_config(root / "configs" / "gpu_cp2_16k.yaml"),
                           [f"{k}={v}" for k, v in overrides.items()])


def layer(cp: int, seq: int, mode: str) -> Any:
    """One GDN layer as a 1-layer model with a 1-wide MLP and byte vocabulary."""
    return _config({"model.num_hidden_layers": 1, "model.full_attention_interval": 1000,
                    "model.intermediate_size": 1, "train.accelerator.cp": cp,
                    "train.accelerator.world_size": cp, "data.seq_len": seq,
                    "train.accelerator.linear_attention_cp_mode": mode})


def network(cp: int, layers: int, mode: str) -> Any:
    return _config({"model.num_hidden_layers": layers, "train.accelerator.cp": cp,
                    "train.accelerator.world_size": cp, "data.seq_len": 16384 * cp,
                    "train.accelerator.linear_attention_cp_mode": mode})


def calibrated(prof: Any, config: Any, measured_ms: float, figure: str) -> tuple[Any, float]:
    """``prof`` with every compute throughput divided by the factor that makes ``config``'s
    predicted ``figure`` (``pipeline_s`` or ``step_s``) equal ``measured_ms`` (fixed point:
    communication does not scale)."""
    from dataclasses import replace

    from overlap_runtime.stepgraph.scale import predict_at_scale

    factor = 1.0
    for _ in range(4):
        p = replace(prof, flops={k: v / factor for k, v in prof.flops.items()})
        got = getattr(predict_at_scale(config, p), figure) * 1e3
        factor *= measured_ms / got
    return replace(prof, flops={k: v / factor for k, v in prof.flops.items()}), factor


def main() -> int:
    from overlap_runtime.stepgraph.costs import h200_profile
    from overlap_runtime.graph.comm_overlap import simulated_a2a_overlap
    from overlap_runtime.stepgraph.scale import predict_at_scale

    raw = h200_profile()
    prof, f_layer = calibrated(raw, layer(2, 32768, "p2p"), MEASURED_CP2_LAYER["p2p"],
                               "pipeline_s")
    print(f"calibration: compute x {f_layer:.3f} makes the CP2 p2p layer {MEASURED_CP2_LAYER['p2p']}"
          f" ms (uncalibrated {predict_at_scale(layer(2, 32768, 'p2p'), raw).pipeline_s * 1e3:.2f}"
          f" ms); Ulysses CP2 is then a check, not a fit")
    print("Seed 000 table 9.4, one GDN layer fwd+bwd (ms): predicted (H200) | seed (NPU)")
    print("| topology | global/local | ulysses pred | p2p pred | p2p reduction pred | "
          "seed ulysses | seed p2p | seed reduction |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = [(2, 32)] + sorted(SEED_94)
    for cp, k in rows:
        seq = k * 1024
        u = predict_at_scale(layer(cp, seq, "ulysses"), prof).pipeline_s * 1e3
        p = predict_at_scale(layer(cp, seq, "p2p"), prof).pipeline_s * 1e3
        if (cp, k) in SEED_94:
            su, sp = SEED_94[(cp, k)]
            seed = f"{su:.1f} | {sp:.1f} | {1 - sp / su:.1%}"
        else:
            mu, mp = MEASURED_CP2_LAYER["ulysses"], MEASURED_CP2_LAYER["p2p"]
            seed = f"**{mu:.2f}** | **{mp:.2f}** | **{1 - mp / mu:.1%}** (measured, H200)"
        print(f"| CP{cp} | {k}K/{k // cp}K | {u:.2f} | {p:.2f} | {1 - p / u:.1%} | {seed} |")
    print()
    prof, f_step = calibrated(raw, network(2, 4, "p2p"), MEASURED_CP2_STEP["p2p"], "step_s")
    print(f"calibration: compute x {f_step:.3f} makes the CP2 p2p training step "
          f"{MEASURED_CP2_STEP['p2p']} ms (uncalibrated "
          f"{predict_at_scale(network(2, 4, 'p2p'), raw).step_s * 1e3:.1f} ms)")
    print("Seed 000 table 9.6, whole network, local 16K, FSDP over CP (ms per step)")
    print("| topology | layers | ulysses pred | p2p pred | p2p reduction pred | seed ulysses | "
          "seed p2p | seed reduction |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for cp, layers in [(2, 4)] + sorted(SEED_96):
        u = predict_at_scale(network(cp, layers, "ulysses"), prof).step_s * 1e3
        p = predict_at_scale(network(cp, layers, "p2p"), prof).step_s * 1e3
        if (cp, layers) in SEED_96:
            su, sp = SEED_96[(cp, layers)]
            seed = f"{su:.1f} | {sp:.1f} | {1 - sp / su:.1%}"
        else:
            mu, mp = MEASURED_CP2_STEP["ulysses"], MEASURED_CP2_STEP["p2p"]
            seed = f"**{mu:.1f}** | **{mp:.1f}** | **{1 - mp / mu:.1%}** (measured, H200)"
        print(f"| CP{cp}/FSDP{cp}, global {16 * cp}K | {layers} | {u:.1f} | {p:.1f} | "
              f"{1 - p / u:.1%} | {seed} |")
    print()
    # OV-B06: benchmarks/moe_overlap.py's pairing on EP=2: 8192 tokens per rank, hidden 4096,
    # 16 experts top-4 of FFN 1024, shared expert 2048; here inside pp2 x ep2 interleaved 1F1B
    ov = _config({"model.hidden_size": 4096, "model.num_hidden_layers": 8,
                  "model.full_attention_interval": 1000, "model.mlp": "moe",
                  "model.num_experts": 16, "model.num_experts_per_tok": 4,
                  "model.moe_intermediate_size": 1024,
                  "model.shared_expert_intermediate_size": 2048,
                  "model.linear_num_key_heads": 4, "model.linear_num_value_heads": 8,
                  "train.accelerator.cp": 1, "train.accelerator.pp": 2, "train.accelerator.ep": 2,
                  "train.accelerator.world_size": 4, "data.seq_len": 8192, "data.batch_size": 8,
                  "train.pipeline.schedule": "interleaved_1f1b", "train.pipeline.microbatches": 8,
                  "train.pipeline.virtual_stages": 2, "train.pipeline.overlap_b_f": True})
    pred = predict_at_scale(ov, prof)
    share = simulated_a2a_overlap(pred.result, paired_only=True).share  # type: ignore[arg-type]
    print(f"Seed 001 OV-B06 (>= 60%): predicted share of expert all-to-all hidden in OVERLAP_B_F "
          f"steps, pp2 x ep2, 2 MoE layers per chunk: {share:.1%} (whole step: "
          f"{simulated_a2a_overlap(pred.result).share:.1%}); "  # type: ignore[arg-type]
          f"measured on 2 H200 (one pairing): 90.5%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
