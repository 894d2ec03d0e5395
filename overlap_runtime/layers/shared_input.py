"""``shared_input_linear``: several bias-free projections of one input, one input gradient.

A layer that projects one ``x`` through several ``nn.Linear`` (a GDN layer's four input
projections, attention's q / k / v, SwiGLU's gate and up) gets from eager autograd one ``dx``
product per projection plus one elementwise add per extra projection: the engine's gradient
accumulation reads both partial sums and writes their sum (three passes over ``[T, hidden]``).
Here the backward accumulates in the products themselves: ``dx = g_0 W_0``, then
``dx += g_i W_i`` in place (``addmm_`` with beta 1: the GEMM reads and writes ``dx`` once), so an
extra projection costs one read and one write of ``dx`` instead of an add kernel and its launch.
The weight gradients are the plain ``g_i^T x``. The forward is the plain ``x W_i^T`` per weight,
and nothing is saved beyond what the separate linears save (``x`` and the weights, by
reference).

Numerics: each partial product is added to the running sum in the GEMM's fp32 accumulator
before one rounding to ``dx``'s dtype, where the engine rounds every product and every sum
(one rounding fewer per extra projection; in fp32 the two agree to rounding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class SharedInputLinearFunction(torch.autograd.Function):
    """``apply(x, w_0, ..., w_{n-1}) -> (x w_0^T, ..., x w_{n-1}^T)`` (module docstring).

    ``x [..., in]``; ``w_i [out_i, in]``, all of x's dtype and device. Outputs
    ``[..., out_i]``. An output that gets no gradient contributes nothing (no product is
    formed for it; its weight's gradient is None, i.e. zero).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1:]
        x2 = x.reshape(-1, x.shape[-1])
        dx: torch.Tensor | None = None
        d_weights: list[torch.Tensor | None] = []
        for g, w, wants_w in zip(grads, weights, need_w):
            if g is None:
                d_weights.append(None)
                continue
            g2 = g.reshape(-1, g.shape[-1])
            if need_x:
                if dx is None:
                    dx = torch.mm(g2, w)
                else:
                    dx.addmm_(g2, w)
            d_weights.append(torch.mm(g2.t(), x2) if wants_w else None)
        return (None if dx is None else dx.view(x.shape), *d_weights)


def _plain(lin: nn.Module) -> bool:
    """A module whose call is exactly ``F.linear(x, weight)``: ``nn.Linear``'s own forward, no
    bias, no hooks of its own."""
    return (isinstance(lin, nn.Linear) and type(lin).forward is nn.Linear.forward
            and lin.bias is None and not lin._forward_hooks and not lin._forward_pre_hooks
            and not lin._backward_hooks and not lin._backward_pre_hooks)


def shared_input_linear(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``, with one accumulated input gradient when
    every linear is a plain bias-free ``nn.Linear``.

    A module that is anything else (a bias, a subclass with its own forward such as
    ``pipeline.DeferredLinear``, a module hook) changes what its call means, so then every
    module is called as such (the same values; the engine's gradient accumulation).

    Args:
        x: ``[..., in_features]``.
        linears: modules of ``in_features`` inputs.

    Returns:
        One ``[..., out_features_i]`` tensor per module, in x's dtype.
    """
    if not all(_plain(lin) for lin in linears):
        return tuple(lin(x) for lin in linears)
    return SharedInputLinearFunction.apply(x, *(lin.weight for lin in linears))
