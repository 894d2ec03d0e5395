"""Helpers of the trainer tests: tiny configurations and a rank worker that trains several."""

from __future__ import annotations

from typing import Any

import torch

from overlap_runtime.trainer import config_from_dict, train_distributed


def tiny_config(steps: int = 20, seq_len: int = 128, activation_checkpoint: bool = False,
                model: dict[str, Any] | None = None, **accelerator: Any) -> dict[str, Any]:
    """A tiny fp32 configuration (hidden 32, 3 GDN + 1 attention layer) as a plain dict."""
    acc = {"device": "cpu", "cp": 2, "world_size": None}
    acc.update(accelerator)
    return {
        "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
                  **(model or {})},
        "data": {"seq_len": seq_len, "batch_size": 1},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "train": {"steps": steps, "seed": 0, "activation_checkpoint": activation_checkpoint,
                  "precision": "fp32", "accelerator": acc},
    }


def train_worker(rank: int, world_size: int,
                 configs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Train each configuration in turn on these ranks; rank 0 returns the results."""
    results = []
    for cfg in configs:
        config = config_from_dict(cfg)
        if config.train.accelerator.resolved_world_size != world_size:
            raise ValueError(f"config wants {config.train.accelerator.resolved_world_size} "
                             f"ranks, the worker has {world_size}")
        results.append(train_distributed(config, torch.device("cpu"), log=lambda line: None)
                       .to_dict())
    return results if rank == 0 else None
