"""The Qwen3.5-style hybrid decoder (dense or MoE) and how to parallelise it.

Composes ``overlap_runtime.layers`` (GatedDeltaNet, Qwen3_5Attention, RMSNorm, SwiGLU) and
``overlap_runtime.moe.MoE`` into :class:`Qwen3_5ForCausalLM`, and puts it on meshes with
``context_parallel`` (:func:`parallelize_qwen3_5_cp`) and FSDP2 (:func:`apply_fsdp`). A
:class:`ModelSpec` per family (:func:`get_model_spec`) is what the trainer asks; ``models.hf``
imports Hugging Face checkpoints into any layout (``trainer.hf_export`` exports ours back). The layer
classes are imported from ``overlap_runtime.layers``.

May import ``torch``, ``overlap_runtime.config`` (``Qwen3_5Config``, the layer split, the
Hugging Face config translation), ``overlap_runtime.layers``, ``overlap_runtime.ops``,
``overlap_runtime.context_parallel`` and (when ``mlp="moe"``) ``overlap_runtime.moe``.
"""

from .parallelize import (
    FULL_ATTENTION_CP_MODES,
    apply_fsdp,
    build_dp_cp_mesh,
    parallelize_qwen3_5_cp,
    parameter_count,
)
from .spec import ModelSpec, get_model_spec, model_specs, register_model_spec
from .qwen3_5 import (
    GDNKernelOptionsConfig,
    LayerType,
    Qwen3_5Config,
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
)

__all__ = [
    "FULL_ATTENTION_CP_MODES",
    "ModelSpec",
    "get_model_spec",
    "model_specs",
    "register_model_spec",
    "GDNKernelOptionsConfig",
    "LayerType",
    "Qwen3_5Config",
    "Qwen3_5DecoderLayer",
    "Qwen3_5ForCausalLM",
    "apply_fsdp",
    "build_dp_cp_mesh",
    "parallelize_qwen3_5_cp",
    "parameter_count",
]
