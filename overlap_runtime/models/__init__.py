"""Model building blocks (Qwen3.5-style layers) and the Qwen3.5-style hybrid decoder."""

from .gated_deltanet import GatedDeltaNet, GDNProjections, RMSNormGated
from .attention import Qwen3_5Attention
from .mlp import SwiGLU, build_mlp
from .norm import RMSNorm
from .qwen3_5 import LayerType, Qwen3_5Config, Qwen3_5DecoderLayer, Qwen3_5ForCausalLM
from .rope import apply_partial_rotary, rotary_dim_for
from .parallelize import (
    FULL_ATTENTION_CP_MODES,
    apply_fsdp,
    build_dp_cp_mesh,
    flat_data_mesh,
    parallelize_qwen3_5_cp,
    parameter_count,
)

__all__ = [
    "FULL_ATTENTION_CP_MODES",
    "GDNProjections",
    "GatedDeltaNet",
    "LayerType",
    "Qwen3_5Attention",
    "Qwen3_5Config",
    "Qwen3_5DecoderLayer",
    "Qwen3_5ForCausalLM",
    "RMSNorm",
    "RMSNormGated",
    "SwiGLU",
    "apply_fsdp",
    "apply_partial_rotary",
    "build_dp_cp_mesh",
    "build_mlp",
    "flat_data_mesh",
    "parallelize_qwen3_5_cp",
    "parameter_count",
    "rotary_dim_for",
]
