"""Norms of the Qwen3.5-style layers: RMSNorm (pre-norms, final norm, q/k head norms) and the
Gated DeltaNet output norm RMSNormGated.

Activation memory (``benchmarks/activation_memory.py`` measures it): written as plain
tensor ops in fp32, autograd keeps fp32 copies of the input (the cast, the normalised product,
and for the gated norm the fp32 gate and its SiLU): 4-5 fp32 ``[..., D]`` tensors per norm where
a bf16 model needs its bf16 input alone. Eagerly both norms therefore run as autograd Functions
(:class:`RMSNormFunction`) that keep ``x`` (and ``gate``) in their own dtype plus the fp32
``1/rms`` ``[..., 1]`` and recompute the rest in backward, in the same fp32 arithmetic. Under
``torch.compile`` (``layers.compile``, ``train.compile``) the plain ops are traced instead: the
compiler's partitioner already keeps only the inputs, and the fused kernels stay its own.

A pre-norm block reads its input twice (the input norm and the residual add) and the mixer's
sum twice (the next norm and the final add); autograd would sum each pair of gradients in a
separate add. ``RMSNorm.forward_keep_input`` (:class:`RMSNormKeepInputFunction`) passes the
residual through the norm's own node and ``RMSNorm.add_forward``
(:class:`AddRMSNormFunction`) makes the residual add and the norm one node; each sums its
two gradients in fp32 and rounds once (one backward, ``_rms_backward``, for all three
nodes). Their plain-op forms (``*_reference``) are what the compiler traces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, float64 stays float64


def _rstd(xc: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * x / rms(x), 1/rms [..., 1])``, both in the compute dtype (fp32, float64
    stays): the forward of :func:`rms_norm_reference` and of every node below."""
    xc = x.to(_compute_dtype(x.dtype))
    rstd = _rstd(xc, eps)
    return weight.to(xc.dtype) * (xc * rstd), rstd


def _rms_backward(xhat: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                  dy: torch.Tensor, extra: torch.Tensor | None, want_x: bool, want_weight: bool,
                  x_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The RMS norm's gradients from ``dy`` (the compute dtype, any gate already applied):
    ``d_x`` in ``x_dtype``, with ``extra`` (another gradient of x, or None) summed in the
    compute dtype before its one rounding, and ``d_weight`` in weight's dtype."""
    compute = rstd.dtype
    d_weight = None
    if want_weight:
        d_weight = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
    d_x = None
    if want_x:
        d_xhat = dy * weight.to(compute)
        d_x = rstd * (d_xhat - xhat * (d_xhat * xhat).mean(dim=-1, keepdim=True))
        if extra is not None:
            d_x = extra.to(compute) + d_x
        d_x = d_x.to(x_dtype)
    return d_x, d_weight


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * x / rms(x) [* silu(gate)]`` as plain ops in fp32 (float64 stays); x's dtype."""
    out, _ = _rms_forward(x, weight, eps)
    if gate is not None:
        out = out * F.silu(gate.to(out.dtype))
    return out.to(x.dtype)


class RMSNormFunction(torch.autograd.Function):
    """``apply(x, weight, gate, eps)``: :func:`rms_norm_reference` keeping only x, gate (their
    own dtype), weight and ``1/rms`` ``[..., 1]`` (fp32) for backward.

    x, gate ``[..., D]`` (gate may be None), weight ``[D]``; returns ``[..., D]`` in x's dtype.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None,
                eps: float) -> torch.Tensor:
        out, rstd = _rms_forward(x, weight, eps)
        if gate is not None:
            out = out * F.silu(gate.to(out.dtype))
        ctx.save_for_backward(x, weight, gate, rstd)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, gate, rstd = ctx.saved_tensors
        compute = rstd.dtype
        xc, dy = x.to(compute), grad.to(compute)
        xhat = xc * rstd                                         # [..., D]
        d_gate = None
        if gate is not None:
            gc = gate.to(compute)
            sg = torch.sigmoid(gc)
            silu = gc * sg
            if ctx.needs_input_grad[2]:
                d_silu = dy * weight.to(compute) * xhat
                d_gate = (d_silu * sg * (1 + gc * (1 - sg))).to(gate.dtype)
            dy = dy * silu
        d_x, d_weight = _rms_backward(xhat, weight, rstd, dy, None, ctx.needs_input_grad[0],
                                      ctx.needs_input_grad[1], x.dtype)
        return d_x, d_weight, d_gate, None


def add_rms_norm_reference(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + delta`` (their dtype) and :func:`rms_norm_reference` of ``h``."""
    h = residual + delta
    return h, rms_norm_reference(h, weight, eps)


class AddRMSNormFunction(torch.autograd.Function):
    """``apply(residual, delta, weight, eps) -> (h, y)``: :func:`add_rms_norm_reference`
    keeping ``h`` (its dtype), weight and the fp32 ``1/rms`` for backward.

    A pre-norm block's residual add and the next norm in one node: ``h`` feeds both the norm
    and the next residual add, so autograd would sum its two gradients in a separate add; here
    the norm's input gradient and ``h``'s own are summed in fp32 and rounded once, and the
    same tensor is the gradient of ``residual`` and of ``delta``.
    residual, delta ``[..., D]`` one dtype, weight ``[D]``; h, y ``[..., D]`` in that dtype.
    """

    @staticmethod
    def forward(ctx: Any, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + delta
        y, rstd = _rms_forward(h, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        return h, y.to(h.dtype)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor, dy: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        h, weight, rstd = ctx.saved_tensors
        d_h, d_weight = _rms_backward(h.to(rstd.dtype) * rstd, weight, rstd, dy.to(rstd.dtype),
                                      dh, ctx.needs_input_grad[0] or ctx.needs_input_grad[1],
                                      ctx.needs_input_grad[2], h.dtype)
        return (d_h if ctx.needs_input_grad[0] else None,
                d_h if ctx.needs_input_grad[1] else None, d_weight, None)


def rms_norm_keep_input_reference(x: torch.Tensor, weight: torch.Tensor, eps: float
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_reference(x), copy of x)`` as plain ops: under ``torch.compile`` the copy is
    written by the norm's own kernel and its gradient summed into x's in the backward kernel
    (an output that were x itself would be an alias the engine accumulates outside)."""
    return rms_norm_reference(x, weight, eps), x.clone()


class RMSNormKeepInputFunction(torch.autograd.Function):
    """``apply(x, weight, eps) -> (y, r)``: ``y`` the RMS norm of x, ``r`` x itself (a view
    whose gradient comes back through this node). A pre-norm block reads its input twice (the
    norm and the residual add); with ``r`` as the residual, the two gradients are summed in
    fp32 here and rounded once instead of by the engine's separate add.
    x ``[..., D]``, weight ``[D]``; y, r ``[..., D]`` in x's dtype.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        y, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype), x

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dr: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        d_x, d_weight = _rms_backward(x.to(rstd.dtype) * rstd, weight, rstd, dy.to(rstd.dtype),
                                      dr, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                      x.dtype)
        return d_x, d_weight, None


def rms_norm_keep_input(x: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x), r)`` with ``r`` equal to x and its gradient summed into x's inside the
    norm: :class:`RMSNormKeepInputFunction` eagerly, :func:`rms_norm_keep_input_reference`
    under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return rms_norm_keep_input_reference(x, weight, eps)
    return RMSNormKeepInputFunction.apply(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rmsnorm(h))`` with ``h = residual + delta``: :class:`AddRMSNormFunction` eagerly,
    the plain ops under ``torch.compile`` (which fuses both passes and both gradients)."""
    if torch.compiler.is_compiling():
        return add_rms_norm_reference(residual, delta, weight, eps)
    return AddRMSNormFunction.apply(residual, delta, weight, eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
          gate: torch.Tensor | None = None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return rms_norm_reference(x, weight, eps, gate)
    return RMSNormFunction.apply(x, weight, gate, eps)


class RMSNorm(nn.Module):
    """``scale * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32.

    Args:
        dim: size of the normalised (last) dim.
        eps: added to the mean square.
        zero_centered: how the scale is stored. False: ``weight`` is the scale itself (starts
            at 1). True: ``scale = 1 + weight`` with ``weight`` starting at 0, formed in fp32
            (``1 + weight.float()``), as Hugging Face's Qwen3.5 / Qwen3-Next norms store it:
            weight decay then pulls the scale toward 1, and a bf16 weight keeps small offsets
            that ``1 + w`` stored in bf16 would round away.

    ``forward(x [..., dim] any float dtype) -> [..., dim]`` in x's dtype; the statistics are taken
    in fp32 (float64 stays float64) so bf16 activations keep a stable normaliser. Backward keeps
    x and the fp32 ``1/rms`` only (module docstring).
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.add_norm_fn = add_rms_norm
        self.keep_input_fn = rms_norm_keep_input

    def scale(self) -> torch.Tensor:
        """The multiplier ``[dim]``: ``weight``, or ``1 + weight`` in fp32 (float64 stays)."""
        if not self.zero_centered:
            return self.weight
        return 1.0 + self.weight.to(_compute_dtype(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.scale(), self.eps)

    def forward_keep_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x), r)`` with ``r`` equal to x (``[..., dim]``): a pre-norm block's residual,
        whose gradient this norm's node sums with its own (:func:`rms_norm_keep_input`;
        compiled with the module by ``layers.compile``)."""
        return self.keep_input_fn(x, self.scale(), self.eps)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, self(h))`` with ``h = residual + delta`` (``[..., dim]``, one dtype): a
        pre-norm block's residual add fused with this norm (:func:`add_rms_norm`; compiled
        with the module by ``layers.compile``)."""
        return self.add_norm_fn(residual, delta, self.scale(), self.eps)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}"
                + (", zero_centered" if self.zero_centered else ""))


class RMSNormGated(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim, computed in fp32 (or float64).

    x, gate: ``[..., D]`` any float dtype; returns x's dtype. Backward keeps x, gate and the
    fp32 ``1/rms`` only (module docstring).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.weight, self.eps, gate)
