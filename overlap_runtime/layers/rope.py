"""Rotary position embedding with a partial rotary dimension (Qwen3.5 rotates 1/4 of a head).

Only the first ``rotary_dim`` channels of each head are rotated, in the rotate-half form (the
pairs are channel ``i`` and ``i + rotary_dim / 2``, frequency ``theta ** (-2i / rotary_dim)``);
the remaining channels pass through. Angles are computed in fp32 (float64 for a float64 input, so
a float64 reference check is exact to float64 rounding). :func:`apply_rotary` is the full-width
form (every channel, angles always fp32) of the minimal ``ReferenceAttention``.

RoPE is a function of each token's *absolute* position, so under context parallelism a rank must
be handed the position ids of the tokens it holds, split by the same rule as the tokens (see
``models.parallelize``).
"""

from __future__ import annotations

from typing import Any

import torch


def rotary_dim_for(head_dim: int, partial_rotary_factor: float) -> int:
    """Rotated channels per head: ``int(head_dim * factor)``; must be even and >= 2.

    Raises:
        ValueError: naming head_dim and partial_rotary_factor when the result is odd or < 2.
    """
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} must be in (0, 1]")
    dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"head_dim={head_dim} * partial_rotary_factor={partial_rotary_factor} gives "
            f"{dim} rotary channels; it must be even and >= 2"
        )
    return dim


def apply_partial_rotary(
    x: torch.Tensor, position_ids: torch.Tensor, rotary_dim: int, base: float
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of every head at the given positions.

    Args:
        x: ``[B, S, H, D]`` any float dtype, even ``rotary_dim <= D``.
        position_ids: ``[S]`` or ``[B, S]`` integer absolute positions of the S tokens.
        rotary_dim: number of rotated channels.
        base: RoPE theta.

    Returns:
        ``[B, S, H, D]`` in x's dtype.
    """
    if rotary_dim % 2 or not 2 <= rotary_dim <= x.shape[-1]:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in [2, head_dim="
                         f"{x.shape[-1]}]")
    compute = torch.promote_types(x.dtype, torch.float32)
    half = rotary_dim // 2
    inv_freq = base ** (-torch.arange(0, half, device=x.device, dtype=compute) * 2 / rotary_dim)
    pos = position_ids.to(device=x.device, dtype=compute)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    angle = (pos.unsqueeze(-1) * inv_freq).unsqueeze(2)            # [B|1, S, 1, rot/2]
    return PartialRotaryFunction.apply(x, angle.cos(), angle.sin())


class PartialRotaryFunction(torch.autograd.Function):
    """``apply(x [B, S, H, D], cos, sin [B|1, S, 1, R/2])``: the first ``R`` channels of x
    rotated (rotate-half form), the others passed through; x's dtype.

    The rotated channels are computed in cos's dtype (fp32, or float64) and rounded once; the
    pass-through channels are copied as they are. Only the rotated quarter is ever widened, and
    no concatenation or slice gradient runs over the whole head: one output, and in backward
    one gradient, each written once (with plain ops autograd widened all of x, concatenated in
    fp32, and summed a zero-filled full-size gradient per slice). Results equal those plain ops
    bit for bit: the same products and sums, rounded once. Saves cos and sin only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        rot = 2 * cos.shape[-1]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, rot, inverse=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        # the rotation's transpose: the rotation by minus the angle
        return _rotate(grad, cos, sin, 2 * cos.shape[-1], inverse=True), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, inverse: bool
            ) -> torch.Tensor:
    """x with its first ``rot`` channels rotated by the angle (``inverse``: by minus it),
    computed in cos's dtype and rounded once; the rest copied."""
    half = rot // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out[..., rot:] = x[..., rot:]
    xr = x[..., :rot].to(cos.dtype)
    x1, x2 = xr[..., :half], xr[..., half:]
    if inverse:
        out[..., :half] = x1 * cos + x2 * sin
        out[..., half:rot] = x2 * cos - x1 * sin
    else:
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rot] = x2 * cos + x1 * sin
    return out


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of every channel at the given absolute positions.

    Args:
        x: ``[B, S, H, D]`` (D even); position_ids: ``[S]`` or ``[B, S]`` integer positions.

    Returns:
        x's shape and dtype; the angles are computed in float32.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"apply_rotary: head dim {d} must be even")
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    pos = position_ids.to(device=x.device, dtype=torch.float32)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    ang = pos.unsqueeze(-1) * inv_freq                                  # [B|1, S, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(2)            # [B|1, S, 1, D]
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(2)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
