"""FSDP2 in the trainer reshards the decoder layers after forward only where the FSDP mesh has
more than one rank: on one rank the "shard" is the whole parameter, and resharding would only
cast and copy every parameter again in backward (real gloo ranks, one step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import config_from_dict


def _config(world: int) -> dict[str, Any]:
    return {
        "model": {"hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
                  "full_attention_interval": 2},
        "data": {"seq_len": 16, "batch_size": 2},
        "train": {"steps": 1, "precision": "bf16",
                  "accelerator": {"device": "cpu", "world_size": world, "cp": 1}},
        "metrics": {"progress": "off"},
    }


def _sharded_after_forward(rank: int, world: int) -> bool:
    """Whether layer 0's parameters are FSDP shards (DTensors) again once the model's forward
    has returned (i.e. before backward)."""
    from torch.distributed.tensor import DTensor

    from overlap_runtime.trainer import train_distributed

    seen: list[bool] = []

    def on_model(pm: Any) -> None:
        model = pm.parts[0]
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            seen.append(isinstance(next(model.layers[0].parameters()), DTensor))
            return out

        model.forward = forward

    train_distributed(config_from_dict(_config(world)), torch.device("cpu"), log=lambda s: None,
                      on_model=on_model)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("world,resharded", [(1, False), (2, True)])
def test_reshard_after_forward_only_on_a_sharded_mesh(world: int, resharded: bool) -> None:
    out = run_ranks(_sharded_after_forward, world, timeout_s=120)
    assert out == [resharded] * world
