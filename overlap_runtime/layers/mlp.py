"""Feed-forward block of the Qwen3.5-style dense decoder: SwiGLU.

Token-wise (a token's output reads only that token), so it runs unchanged on a context-parallel
sequence shard. The choice between SwiGLU and a mixture of experts is the model's
(``models.mlp.build_mlp``), not this floor's.

Activation memory (``benchmarks/activation_memory.py`` measures it): written as three
modules and two elementwise ops, autograd keeps four ``[.., intermediate]`` tensors per layer -
``gate(x)``, ``up(x)``, ``silu(gate(x))`` and the product (``down``'s input) - the largest share
of the hybrid's saved activations (1.6 GB per layer at 32K tokens, intermediate 6144, bf16).
:class:`SwiGLUDownFunction` keeps only ``gate(x)`` and ``up(x)`` and recomputes the other two in
backward (one elementwise pass over ``[.., intermediate]``, bandwidth-bound and small next to
the three GEMMs); every operation and rounding is the eager one's (``aten.silu_backward``, the
products in the input dtype), so forward and gradients are bit-identical to it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from overlap_runtime.layers.shared_input import shared_input_linear


def swiglu_act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` (``[..., I]``, their dtype)."""
    return F.silu(g) * u


def swiglu_act_backward(d_h: torch.Tensor, g: torch.Tensor, u: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, d_g, d_u)`` for ``h = silu(g) * u`` and the gradient ``d_h`` of h, all ``[..., I]``
    in their dtype: h recomputed for the down projection's weight gradient."""
    act = F.silu(g)
    return act * u, torch.ops.aten.silu_backward(d_h * u, g), d_h * act


class SwiGLUKernels(NamedTuple):
    """The elementwise halves of :class:`SwiGLUDownFunction`: ``act(g, u) -> h`` and
    ``act_backward(d_h, g, u) -> (h, d_g, d_u)`` (the eager functions above, or their
    ``torch.compile`` versions)."""

    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    act_backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                           tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


EAGER_SWIGLU = SwiGLUKernels(swiglu_act, swiglu_act_backward)


class SwiGLUDownFunction(torch.autograd.Function):
    """``F.linear(silu(g) * u, weight)`` saving only ``g``, ``u`` (and ``weight``) for backward.

    ``g``, ``u``: ``[..., I]``; ``weight``: ``[hidden, I]``; all one float dtype. Returns
    ``[..., hidden]`` in that dtype.
    """

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor,
                kernels: SwiGLUKernels = EAGER_SWIGLU) -> torch.Tensor:
        ctx.save_for_backward(g, u, weight)
        ctx.kernels = kernels
        return F.linear(kernels.act(g, u), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        g, u, weight = ctx.saved_tensors
        d_h = grad @ weight                                # [..., I]
        h, d_g, d_u = ctx.kernels.act_backward(d_h, g, u)  # h recomputed as the forward rounds it
        d_weight = None
        if ctx.needs_input_grad[2]:
            d_weight = grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        return (d_g if ctx.needs_input_grad[0] else None,
                d_u if ctx.needs_input_grad[1] else None, d_weight, None)


def _swiglu_down(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor,
                kernels: SwiGLUKernels = EAGER_SWIGLU) -> torch.Tensor:
    """``down(silu(g) * u)`` with the lean saved set of :class:`SwiGLUDownFunction`."""
    return SwiGLUDownFunction.apply(g, u, weight, kernels)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``[..., hidden] -> [..., hidden]`` in x's dtype.

    Args:
        hidden_size: model width.
        intermediate_size: width of the gated hidden layer.

    Backward keeps ``gate(x)`` and ``up(x)`` only (module docstring).
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.kernels = EAGER_SWIGLU  # the elementwise halves; train.compile swaps in compiled ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down_proj.bias is not None:  # never built with one; a swapped-in Linear might
            raise ValueError("SwiGLU.down_proj must have no bias (_swiglu_down takes none)")
        gate, up = shared_input_linear(x, self.gate_proj, self.up_proj)
        return _swiglu_down(gate, up, self.down_proj.weight, self.kernels)
