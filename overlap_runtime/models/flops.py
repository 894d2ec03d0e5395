"""Model FLOPs of one training step of the Qwen3.5-style decoder (the formula is
``trainer.flops``' module docstring): what the model spec reports, also for a model too large
to build (counted on the meta device)."""

from __future__ import annotations

import torch

from overlap_runtime.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM


def active_parameters(model: Qwen3_5Config) -> int:
    """``N_active`` of the module doc, counted on a meta-device copy of the model."""
    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(model)
    embed = m.embed_tokens.weight
    total = 0.0
    seen: set[int] = set()
    for name, p in m.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed and not model.tie_word_embeddings:
            continue  # a lookup; a tied embedding is counted once, as the LM head
        share = model.num_experts_per_tok / model.num_experts if ".experts." in name else 1.0
        total += p.numel() * share
    return int(round(total))


def train_flops_per_step(model: Qwen3_5Config, seq_len: int, tokens: int) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens in sequences of ``seq_len``."""
    per_token = 6.0 * active_parameters(model)
    for kind in model.layer_types:
        if kind == "full_attention":
            per_token += 6.0 * seq_len * model.num_attention_heads * model.head_dim
        else:
            per_token += (18.0 * model.linear_key_head_dim * model.linear_value_head_dim
                          * model.linear_num_value_heads)
    return per_token * tokens
