"""``compile_elementwise``: torch.compile on the elementwise pieces of a model
(``layers.elementwise``), regional compilation that leaves the GDN / attention cores and every
collective eager. What ``train.compile: true`` applies (before FSDP2 wraps the model)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from overlap_runtime.layers.attention import Qwen3_5Attention
from overlap_runtime.layers.elementwise import (causal_conv_silu_shifted,
                                                causal_conv_silu_shifted_parts, gdn_gates,
                                                sigmoid_gate)
from overlap_runtime.layers.gated_deltanet import GatedDeltaNet
from overlap_runtime.layers.mlp import SwiGLU, SwiGLUKernels, swiglu_act, swiglu_act_backward
from overlap_runtime.layers.norm import (RMSNorm, RMSNormGated, add_rms_norm,
                                         rms_norm_keep_input)


_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, one compiled function per ``fn`` shared by every layer."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def compile_elementwise(model: nn.Module) -> nn.Module:
    """Compile the elementwise pieces of ``model`` in place (module docstring); returns it.

    Every ``RMSNorm`` / ``RMSNormGated`` is compiled (``nn.Module.compile``), and each
    ``RMSNorm``'s fused residual add and residual pass-through (``RMSNorm.add_forward``,
    ``RMSNorm.forward_keep_input``) with it; every
    ``GatedDeltaNet`` calls the compiled ``gdn_gates`` and, with ``conv_backend="torch"``, the
    compiled ``causal_conv_silu_shifted`` (``conv_backend="triton"`` keeps its Triton conv),
    and the compiled ``causal_conv_silu_shifted_parts`` for q, k, v written contiguous
    (``GatedDeltaNet.causal_conv_qkv``); every ``Qwen3_5Attention`` its output gate
    (``sigmoid_gate``); every ``SwiGLU`` runs its elementwise halves
    (``silu(g) * u`` and its backward) compiled, one fused pass each.
    Call it before FSDP2 wraps the model (as torchtitan does); the cores and collectives stay
    eager.
    """
    for module in model.modules():
        if isinstance(module, (RMSNorm, RMSNormGated)):
            module.compile()
            if isinstance(module, RMSNorm):
                module.add_norm_fn = compiled(add_rms_norm)
                module.keep_input_fn = compiled(rms_norm_keep_input)
        elif isinstance(module, GatedDeltaNet):
            if module.conv_backend == "torch":
                module.conv_fn = compiled(causal_conv_silu_shifted)
                module.conv_parts_fn = compiled(causal_conv_silu_shifted_parts)
            module.gates_fn = compiled(gdn_gates)
        elif isinstance(module, Qwen3_5Attention):
            module.gate_fn = compiled(sigmoid_gate)
        elif isinstance(module, SwiGLU):
            module.kernels = SwiGLUKernels(compiled(swiglu_act), compiled(swiglu_act_backward))
    return model
