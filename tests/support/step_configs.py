"""Small training configurations whose compiled step (``stepgraph.compile_step``) the tests
price: one GDN layer on a CP group (the p2p state chain), one or a few MoE layers on EP ranks."""

from __future__ import annotations

from typing import Any

from overlap_runtime.trainer import config_from_dict


def gdn_chain_config(cp: int, *, local_seq: int = 64) -> Any:
    """One GDN layer (``linear_attention_cp_mode: p2p``) on ``cp`` ranks, one sequence of
    ``cp * local_seq`` tokens (weak scaling), pp = 1, a dense MLP."""
    return config_from_dict({
        "model": {"hidden_size": 32, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
                  "intermediate_size": 64, "linear_num_key_heads": 2,
                  "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                  "linear_value_head_dim": 8},
        "data": {"seq_len": cp * local_seq, "batch_size": 1},
        "train": {"accelerator": {"device": "cpu", "world_size": cp, "cp": cp,
                                  "linear_attention_cp_mode": "p2p"}}})


def moe_config(*, ep: int = 2, pp: int = 1, layers: int = 1, overlap_b_f: bool = False,
               microbatches: int = 4, virtual_stages: int = 1) -> Any:
    """``layers`` full-attention MoE layers (4 experts, a shared expert) on pp x ep ranks."""
    pipeline: dict[str, Any] = {"microbatches": microbatches}
    if pp > 1:
        pipeline.update(schedule="interleaved_1f1b" if virtual_stages > 1 else "1f1b",
                        virtual_stages=virtual_stages, overlap_b_f=overlap_b_f)
    return config_from_dict({
        "model": {"hidden_size": 32, "num_hidden_layers": layers,
                  "layer_types": ["full_attention"] * layers, "intermediate_size": 64,
                  "mlp": "moe", "num_experts": 4, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
        "data": {"seq_len": 64, "batch_size": microbatches if pp > 1 else 1},
        "train": {"precision": "fp32", "accelerator": {"device": "cpu", "world_size": pp * ep,
                                                       "pp": pp, "ep": ep, "cp": 1},
                  "pipeline": pipeline}})
