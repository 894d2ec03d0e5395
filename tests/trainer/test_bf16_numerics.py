"""bf16 CP training against one device, at the measured noise floor (issue #25).

Short versions of ``benchmarks/bf16_numerics.py`` (configs/cpu_bf16_numerics.yaml at 256
tokens): CP2 on gloo ranks against one process, in bf16, with tolerances taken from the noise
floor measured in the same test (one device with the batch rows in two gradient groups summed in
fp32, ``train_single(grad_microbatches=2)``) times a factor measured in the 100-step study
(docs/training.md, "bf16 numerics").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overlap_runtime.testing import rel_l2, run_ranks
from overlap_runtime.trainer.config import TrainConfig, load_config
from overlap_runtime.trainer.loop import TrainResult, rank_main, train_single
from overlap_runtime.trainer.numerics import (distributed_gradients, floor_config,
                                              initial_weights, single_gradients,
                                              step_differences)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu_bf16_numerics.yaml"
STEPS = 8
# Measured (docs/training.md, "bf16 numerics"): over these 8 steps CP2 p2p's largest differences
# are 0.3x (loss) and 1.7x (grad norm) the floor's; at fixed weights every tensor's CP2 Ulysses
# gradient lies within 1.6x the floor's distance from the bf16 one-device gradient, and within
# 1.05x the one-device bf16 error against fp32. Tolerances: those figures with a margin.
FLOOR_FACTOR = 3.0
GRAD_FACTOR = 2.5
FP32_FACTOR = 1.3
GRAD_ABS = 1e-4  # for a tensor the floor would leave bit-identical
# A tensor whose bf16 one-device gradient is more than 50% off fp32 has no bf16 digits to
# compare (layer 0's A_log: a sum of cancelling per-token terms, 110% off); it is reported in
# docs/training.md ("bf16 numerics", open item) and skipped here, by this explicit rule.
ILL_CONDITIONED = 0.5


def _config(cp: int, gdn: str, attn: str) -> TrainConfig:
    data = load_config(CONFIG).model_dump()
    data["data"]["seq_len"] = 256
    data["train"]["steps"] = STEPS
    data["train"]["accelerator"].update(world_size=cp, cp=cp, linear_attention_cp_mode=gdn,
                                        full_attention_cp_mode=attn)
    return TrainConfig.model_validate(data)


def test_bf16_cp2_p2p_trajectory_within_the_floor() -> None:
    config = _config(2, "p2p", "ring")
    quiet = {"log": lambda line: None}
    base = train_single(config, **quiet)
    floor = step_differences(train_single(config, grad_microbatches=2, **quiet), base)
    out = run_ranks(rank_main, 2, timeout_s=240, args=(config.model_dump(), True))
    cp = step_differences(TrainResult.from_dict(out[0]), base)
    floor_loss = max(d.rel_loss for d in floor)
    floor_gn = max(d.rel_grad_norm for d in floor)
    assert floor_loss > 0 and floor_gn > 0, "the floor's neutral change changed nothing"
    worst_loss = max(d.rel_loss for d in cp)
    worst_gn = max(d.rel_grad_norm for d in cp)
    assert worst_loss <= FLOOR_FACTOR * floor_loss, (
        f"cp2 p2p bf16 loss differs by {worst_loss:.2e} relative, floor {floor_loss:.2e}")
    assert worst_gn <= FLOOR_FACTOR * floor_gn, (
        f"cp2 p2p bf16 grad norm differs by {worst_gn:.2e} relative, floor {floor_gn:.2e}")


def _grads_rank(rank: int, world: int, config: dict, weights: dict, step: int) -> dict | None:
    torch.set_num_threads(1)
    g = distributed_gradients(TrainConfig.model_validate(config), weights, step)
    return g if rank == 0 else None


@pytest.mark.parametrize("gdn,attn", [("p2p", "ring"), ("ulysses", "ulysses")])
def test_bf16_cp2_gradients_per_tensor_within_the_floor(gdn: str, attn: str) -> None:
    """Fixed weights, one batch: every tensor's CP2 bf16 gradient lies as close to the bf16
    one-device gradient as the floor's does (and as close to fp32 as one device is)."""
    config = _config(2, gdn, attn)
    weights, step = initial_weights(config), 3
    ref = single_gradients(config, weights, step, "fp32")
    single = single_gradients(config, weights, step, "bf16")
    floors = [single_gradients(config, weights, step, "bf16", grad_microbatches=2),
              single_gradients(floor_config(config, 32), weights, step, "bf16")]
    cp = run_ranks(_grads_rank, 2, timeout_s=240,
                   args=(config.model_dump(), weights, step))[0]
    bad = []
    for name in ref:
        d_cp = rel_l2(cp[name], single[name])
        d_floor = max(rel_l2(f[name], single[name]) for f in floors)
        e_cp, e_single = rel_l2(cp[name], ref[name]), rel_l2(single[name], ref[name])
        if e_single > ILL_CONDITIONED:
            continue
        if d_cp > GRAD_FACTOR * d_floor + GRAD_ABS or e_cp > FP32_FACTOR * e_single + GRAD_ABS:
            bad.append(f"{name}: vs bf16 one device {d_cp:.2e} (floor {d_floor:.2e}), vs fp32 "
                       f"{e_cp:.2e} (one device {e_single:.2e})")
    assert not bad, f"CP2 {gdn} bf16 gradients off the floor:\n  " + "\n  ".join(bad)
