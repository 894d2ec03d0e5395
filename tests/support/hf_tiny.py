"""Tiny random Qwen3.5 models built by ``transformers`` for the import / export tests.

Every parameter is randomised (not left at its init: zero-centred norms at 0 and the shared
expert gate would hide a mapping error), the model saved with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 272  # >= the byte-level data's 260 tokens
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def hf_model(kind: str, seed: int = 0, top_k: int = 2, dtype: torch.dtype = torch.float32) -> Any:
    """A ``Qwen3_5ForCausalLM`` (``kind="dense"``) or ``Qwen3_5MoeForCausalLM`` (``"moe"``)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "moe":
        cfg = tf.Qwen3_5MoeTextConfig(**COMMON, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, num_experts=4,
                                      num_experts_per_tok=top_k, router_aux_loss_coef=0.0)
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    else:
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**COMMON, intermediate_size=48))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.uniform_(-1.0, 1.0)
            elif "dt_bias" in name or name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.15)
    return model.to(dtype).eval()


def save_hf(kind: str, directory: Path, seed: int = 0, top_k: int = 2,
            dtype: torch.dtype = torch.float32) -> Any:
    """:func:`hf_model` saved to ``directory``; returns the model."""
    model = hf_model(kind, seed, top_k, dtype)
    model.save_pretrained(str(directory))
    return model


def train_config(init_from: str, steps: int = 3, world: int = 1, model: dict | None = None,
                 pipeline: dict | None = None, **acc: Any) -> dict[str, Any]:
    """A trainer configuration importing ``init_from`` (fp32, 4 rows of 64 tokens per dp rank)."""
    accelerator = {"device": "cpu", "cp": 1, "world_size": world, "comm_timeout_s": 60.0, **acc}
    return {
        "model": {"init_from": init_from, **(model or {})},
        "data": {"seq_len": 64, "batch_size": 4},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0,
                      "implementation": "for_loop"},
        "train": {"steps": steps, "seed": 0, "precision": "fp32", "accelerator": accelerator,
                  "pipeline": pipeline or {}},
    }


def train_worker(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list | None:
    """Train each configuration in turn on these ranks; rank 0 returns the results."""
    from overlap_runtime.trainer import config_from_dict, train_distributed

    out = [train_distributed(config_from_dict(c), torch.device("cpu"), log=lambda line: None)
           .to_dict() for c in configs]
    return out if rank == 0 else None
