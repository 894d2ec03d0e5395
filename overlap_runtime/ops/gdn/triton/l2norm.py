"""l2 normalisation of q and k over the head dim, and its backward fused with the sum over the
value heads that share a key head.

``l2norm_fwd_kernel``, grid ``(cdiv(rows, BR),)``: ``y = x / sqrt(sum x^2 + 1e-6)`` (the
reference's epsilon, inside the root), y in x's dtype, ``rstd`` fp32 per row. The kernels that
read the raw q, k with their 1/norms instead (the fused forward's prep, the backward) normalise
their tiles with the same operations (common.normalised): ``x * rstd`` and its cast, y's bits.
``l2norm_bwd_kernel``, same grid: ``dy = base + sum over the G value heads of the key head``
(``base``: a gradient already summed per key head, optional), then
``dx = rstd (dy - y (y . dy))`` with ``y = x rstd`` recomputed in fp32 (or ``dx = dy`` without
the norm); dx in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, R, D: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_d = tl.arange(0, D)
    b_x = tl.load(x + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
    b_x = b_x.to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + EPS)
    tl.store(y + o_r[:, None] * D + o_d[None, :], (b_x * b_r[:, None]).to(y.dtype.element_ty),
             mask=m_r[:, None])
    tl.store(rstd + o_r, b_r, mask=m_r)


@triton.jit
def l2norm_bwd_kernel(x, rstd, dyg, base, dx, R, D: tl.constexpr, G: tl.constexpr,
                      BR: tl.constexpr, NORM: tl.constexpr, BASE: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_d = tl.arange(0, D)
    if BASE:
        b_dy = tl.load(base + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
    else:
        b_dy = tl.zeros([BR, D], dtype=tl.float32)
    for i in range(G):
        b_dy += tl.load(dyg + (o_r[:, None] * G + i) * D + o_d[None, :], mask=m_r[:, None],
                        other=0.0)
    if NORM:
        b_r = tl.load(rstd + o_r, mask=m_r, other=0.0)
        b_y = tl.load(x + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None],
                      other=0.0).to(tl.float32) * b_r[:, None]
        b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None])
    else:
        b_dx = b_dy
    tl.store(dx + o_r[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty),
             mask=m_r[:, None])


def _rows(dim: int) -> int:
    return max(1, min(64, 4096 // dim))


def l2norm_forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, T, H, D]`` -> ``(y [B, T, H, D] in x's dtype, rstd [B, T, H] fp32)``."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    block = _rows(dim)
    l2norm_fwd_kernel[(triton.cdiv(rows, block),)](x, y, rstd, rows, D=dim, BR=block,
                                                   EPS=L2NORM_EPS)
    return y, rstd


def l2norm_group_backward(x: torch.Tensor, rstd: torch.Tensor | None, dy_value_heads: torch.Tensor,
                          base: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient of the (normalised, grouped) input.

    Args:
        x: ``[B, T, H, D]`` the raw input (before the norm).
        rstd: ``[B, T, H]`` fp32 from :func:`l2norm_forward`, or None when no norm was applied.
        dy_value_heads: ``[B, T, HV, D]`` fp32 gradient per value head (HV = G H).
        base: ``[B, T, H, D]`` fp32 gradient already summed per key head, added to the group's
            sum (None: nothing).

    Returns:
        ``dx [B, T, H, D]`` in x's dtype.
    """
    dim = x.shape[-1]
    rows = x.numel() // dim
    group = dy_value_heads.shape[2] // x.shape[2]
    dx = torch.empty_like(x)
    block = _rows(dim)
    l2norm_bwd_kernel[(triton.cdiv(rows, block),)](
        x, rstd if rstd is not None else x, dy_value_heads, base if base is not None else x, dx,
        rows, D=dim, G=group, BR=block, NORM=rstd is not None, BASE=base is not None,
    )
    return dx
