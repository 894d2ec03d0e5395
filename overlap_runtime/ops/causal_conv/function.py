"""The causal depthwise conv + SiLU as an autograd Function over the Triton kernels.

:func:`causal_conv_silu_triton` is ``layers.elementwise.causal_conv_silu`` (same arguments,
same result to fp32 rounding) for ``conv_backend="triton"``. Forward: one pass over x, y in x's
dtype. Backward: dx (the SiLU derivative recomputed from x, nothing but the inputs saved),
dweight (fp32 per-program partial sums over ``B * T``, one deterministic reduction, cast to the
weight's dtype) and d_left (the halo's gradient, in left's dtype). Every sum accumulates in fp32
and is rounded once. Launch sizes: forward ``BLOCK_T x BLOCK_C`` tiles; backward
``BACKWARD_BLOCK_T x BACKWARD_BLOCK_C`` tiles, ``BACKWARD_ROWS`` rows at most per program.

This module imports no triton; the kernels are imported at the first launch.
"""

from __future__ import annotations

from typing import Any

import torch

from .capability import check_causal_conv_inputs

BLOCK_T = 32
BLOCK_C = 128
FORWARD_WARPS = 4
# The backward: overlapping tiles of BACKWARD_BLOCK_T rows x BACKWARD_BLOCK_C channels, each
# owning its rows after the halo ((K-1) * dilation rows, whose ds it recomputes), dx formed from
# ds shifted on chip (tl.gather): no scratch memory, no block barrier. [256, 16] with 4 warps
# is the fastest of a sweep on the H200 at 32K tokens x 2048 and 8192 channels, 2.1x the
# earlier [32, 64] tiles that went through a global fp32 scratch
# (benchmarks/causal_conv.py --bwd-tiles; docs/benchmarks.md). A program walks tiles until
# BACKWARD_ROWS rows (fewer partial sums of dweight to reduce; at 256 rows a tile is a program).
BACKWARD_ROWS = 256
BACKWARD_BLOCK_T = 256
BACKWARD_BLOCK_C = 16
BACKWARD_WARPS = 4


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _blocks(channels: int) -> int:
    return min(BLOCK_C, max(16, _next_pow2(channels)))


def _positions(doc_positions: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels' ``[B, T]`` int32 contiguous copy of ``doc_positions`` (None stays None)."""
    if doc_positions is None:
        return None
    return doc_positions.to(torch.int32).contiguous()


def causal_conv_silu_forward(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                             dilation: int, doc_positions: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """``SiLU(causal depthwise conv)`` without autograd: x ``[B, T, C]``, weight ``[C, K]``,
    left ``[B, (K-1)*dilation, C]`` or None, doc_positions ``[B, T]`` int or None (packed
    documents: the taps reaching before a token's document start are dropped) -> y
    ``[B, T, C]`` in x's dtype. Checks the inputs."""
    from .triton.kernels import causal_conv_silu_fwd_kernel

    check_causal_conv_inputs(x, weight, left, dilation, doc_positions)
    pos = _positions(doc_positions)
    batch, seq_len, channels = x.shape
    kernel = weight.shape[1]
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous
    bc = _blocks(channels)
    grid = (-(-seq_len // BLOCK_T), -(-channels // bc), batch)
    causal_conv_silu_fwd_kernel[grid](
        x, x if left is None else left, weight, x if pos is None else pos, y, seq_len, channels,
        x.stride(0), x.stride(1), (kernel - 1) * dilation, dilation, K=kernel,
        HAS_LEFT=left is not None, HAS_POS=pos is not None, BT=BLOCK_T, BC=bc,
        num_warps=FORWARD_WARPS)
    return y


def causal_conv_silu_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
    dilation: int, need_x: bool = True, need_weight: bool = True, need_left: bool = True,
    doc_positions: torch.Tensor | None = None, dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`causal_conv_silu_forward` without autograd.

    Args:
        grad_y: ``[B, T, C]`` gradient of y (any strides; made contiguous).
        x, weight, left, dilation: the forward's inputs.
        need_x, need_weight, need_left: which gradients to compute.
        doc_positions: the forward's ``[B, T]`` positions in the documents, or None.
        dx_out: ``[B, T, C]`` in x's dtype with channels contiguous (a channel slice of a
            wider tensor) that receives dx in place, or None (a new contiguous tensor).

    Returns:
        ``(dx [B, T, C] in x's dtype, dweight [C, K] in weight's dtype, d_left
        [B, (K-1)*dilation, C] in left's dtype)``, each None when not asked for (d_left also
        when left is None).
    """
    from .triton.kernels import causal_conv_silu_bwd_left_kernel

    check_causal_conv_inputs(x, weight, left, dilation, doc_positions)
    pos = _positions(doc_positions)
    if tuple(grad_y.shape) != tuple(x.shape):
        raise ValueError(f"causal_conv_silu backward: grad_y shape {tuple(grad_y.shape)} differs "
                         f"from x shape {tuple(x.shape)}")
    batch, seq_len, channels = x.shape
    kernel = weight.shape[1]
    halo = (kernel - 1) * dilation
    weight = weight.contiguous()
    dy = grad_y.to(x.dtype).contiguous()
    need_left = need_left and left is not None and halo > 0
    dx = None
    if need_x:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if dx_out is None else dx_out
        if (dx.shape, dx.dtype, dx.device) != (x.shape, x.dtype, x.device) or dx.stride(2) != 1:
            raise ValueError(f"causal_conv_silu backward: dx_out must be {tuple(x.shape)} "
                             f"{x.dtype} on {x.device} with channels contiguous, got "
                             f"{tuple(dx.shape)} {dx.dtype} on {dx.device} strides "
                             f"{dx.stride()}")
    dweight = d_left = None
    partial = None
    if need_x or need_weight:
        partial = _backward_main(x, weight, left, pos, dy, dx, halo, dilation, need_x,
                                 need_weight)
    if partial is not None:
        dweight = partial.sum(0).t().to(weight.dtype)  # [C, K], one fp32 reduction
    if need_left:
        assert left is not None
        d_left = torch.empty_like(left)
        bc = min(BACKWARD_BLOCK_C, max(16, _next_pow2(channels)))
        causal_conv_silu_bwd_left_kernel[(-(-channels // bc), batch)](
            x, left, weight, x if pos is None else pos, dy, d_left, seq_len, channels,
            x.stride(0), x.stride(1), halo, dilation,
            K=kernel, HAS_POS=pos is not None, BH=_next_pow2(halo), BC=bc, num_warps=4)
    elif left is not None and halo == 0 and left.requires_grad:
        d_left = torch.zeros_like(left)
    return dx, dweight, d_left


def _backward_main(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                   pos: torch.Tensor | None, dy: torch.Tensor, dx: torch.Tensor | None,
                   halo: int, dilation: int, need_x: bool, need_weight: bool
                   ) -> torch.Tensor | None:
    """Launch the backward kernel (writes dx when given); returns the fp32 partial weight
    gradients ``[B * programs, K, C]`` when ``need_weight``, else None."""
    from .triton.kernels import causal_conv_silu_bwd_kernel

    batch, seq_len, channels = x.shape
    kernel = weight.shape[1]
    # a tile's own rows are BT - halo (at least half of it); a wide halo widens the tile in
    # rows and narrows it in channels (same elements per tile)
    bt = max(BACKWARD_BLOCK_T, _next_pow2(2 * halo))
    bc = min(BACKWARD_BLOCK_C, max(16, _next_pow2(channels)))
    bc = max(16, min(bc, BACKWARD_BLOCK_T * BACKWARD_BLOCK_C // bt))
    own = bt - halo
    tiles = max(1, min(BACKWARD_ROWS // own, -(-seq_len // own)))
    programs_t = -(-seq_len // (own * tiles))
    partial = None
    if need_weight:
        partial = torch.empty(batch * programs_t, kernel, channels, dtype=torch.float32,
                              device=x.device)
    dx_strides = (0, 0) if dx is None else (dx.stride(0), dx.stride(1))
    causal_conv_silu_bwd_kernel[(programs_t, -(-channels // bc), batch)](
        x, x if left is None else left, weight, x if pos is None else pos, dy,
        x if dx is None else dx, x if partial is None else partial, seq_len, channels,
        x.stride(0), x.stride(1), *dx_strides, halo, dilation, own, tiles, BT=bt, BC=bc,
        K=kernel, KP=_next_pow2(kernel), HAS_LEFT=left is not None, HAS_POS=pos is not None,
        NEED_DX=need_x, NEED_DW=need_weight, num_warps=BACKWARD_WARPS)
    return partial


class CausalConvSiluFunction(torch.autograd.Function):
    """Autograd of :func:`causal_conv_silu_forward`: saves x, weight, left and doc_positions
    (the inputs) and recomputes the pre-activation in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                dilation: int, doc_positions: torch.Tensor | None = None) -> torch.Tensor:
        y = causal_conv_silu_forward(x, weight, left, dilation, doc_positions)
        ctx.save_for_backward(x, weight, left, doc_positions)
        ctx.dilation = dilation
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, left, doc_positions = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dweight, d_left = causal_conv_silu_backward(
            grad_y, x, weight, left, ctx.dilation, need_x=need[0], need_weight=need[1],
            need_left=need[2], doc_positions=doc_positions)
        return dx, dweight, d_left, None, None


class CausalConvSiluPartsFunction(torch.autograd.Function):
    """Autograd of the conv on each channel group of x (:func:`causal_conv_silu_triton_parts`):
    one contiguous output per group; in backward each group's kernel writes its dx into its
    channel slice of one ``[B, T, C]`` gradient (no concatenation of the groups' dx)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                dilation: int, doc_positions: torch.Tensor | None, sizes: tuple[int, ...]
                ) -> tuple[torch.Tensor, ...]:
        doc_positions = _positions(doc_positions)  # once for every group, both passes
        ctx.save_for_backward(x, weight, left, doc_positions)
        ctx.dilation, ctx.sizes = dilation, sizes
        return tuple(causal_conv_silu_forward(xi, wi, li, dilation, doc_positions)
                     for xi, wi, li in _groups(x, weight, left, sizes))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, weight, left, doc_positions = ctx.saved_tensors
        need_x, need_w, need_left = ctx.needs_input_grad[:3]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        dxs = (None,) * len(ctx.sizes) if dx is None else dx.split(ctx.sizes, -1)
        dws, dlefts = [], []
        for (xi, wi, li), dy, dxi in zip(_groups(x, weight, left, ctx.sizes), grads, dxs):
            if dy is None:  # an output unused by the loss: its gradient is zero
                dy = torch.zeros(xi.shape, dtype=xi.dtype, device=xi.device)
            _, dwi, dli = causal_conv_silu_backward(
                dy, xi, wi, li, ctx.dilation, need_x=need_x, need_weight=need_w,
                need_left=need_left, doc_positions=doc_positions, dx_out=dxi)
            dws.append(dwi)
            if li is not None:  # no halo rows (K = 1): a zero gradient
                dlefts.append(torch.zeros_like(li) if dli is None else dli)
        dweight = torch.cat(dws, 0) if need_w else None  # [C, K]: small
        d_left = torch.cat(dlefts, -1) if need_left and left is not None else None
        return dx, dweight, d_left, None, None, None


def _groups(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
            sizes: tuple[int, ...]
            ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``(x, weight, left)`` of each channel group: views of x and weight, left's rows copied
    contiguous (the kernels read it so; ``(K-1) * dilation`` rows) or None repeated."""
    lefts = ((None,) * len(sizes) if left is None
             else tuple(part.contiguous() for part in left.split(sizes, -1)))
    return list(zip(x.split(sizes, -1), weight.split(sizes, 0), lefts))


def causal_conv_silu_triton_parts(x: torch.Tensor, weight: torch.Tensor,
                                  sizes: tuple[int, ...], left: torch.Tensor | None = None,
                                  dilation: int = 1, doc_positions: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, ...]:
    """:func:`causal_conv_silu_triton` on each channel group of x: the GDN layer's q, k, v as
    separate contiguous ``[B, T, size]`` tensors in x's dtype
    (``layers.elementwise.causal_conv_silu_parts``' contract, for ``conv_backend="triton"``).

    Each group's kernels read their channel slice of x in place; in backward each writes its
    dx into its slice of one ``[B, T, C]`` gradient, so neither the forward nor the backward
    copies a group (a split then a concatenation of the groups' dx would write ``B*T*C``
    elements more).

    Args:
        x: ``[B, T, C]``, ``C = sum(sizes)``, channels contiguous; weight ``[C, K]``; left
            ``[B, (K-1)*dilation, C]`` or None; dilation, doc_positions: as
            :func:`causal_conv_silu_triton`.
        sizes: channels of each group (positive, summing to C).
    """
    if sum(sizes) != x.shape[-1] or any(s <= 0 for s in sizes):
        raise ValueError(f"causal_conv_silu_triton_parts: sizes {tuple(sizes)} must be "
                         f"positive and sum to x's {x.shape[-1]} channels")
    check_causal_conv_inputs(x, weight, left, dilation, doc_positions)
    return CausalConvSiluPartsFunction.apply(x, weight, left, dilation, doc_positions,
                                             tuple(sizes))


def causal_conv_silu_triton(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                            dilation: int = 1, doc_positions: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """``SiLU(causal depthwise conv)`` of x with the Triton kernels (``conv_backend="triton"``).

    Args:
        x: ``[B, T, C]`` with C innermost (``x.stride(2) == 1``; a channel slice of a wider
            tensor is read in place), bf16 / fp16 / fp32.
        weight: ``[C, K]`` one filter per channel, ``K <= 8``, bf16 / fp16 / fp32.
        left: ``[B, (K - 1) * dilation, C]`` in x's dtype, the positions just before x (a CP
            halo), or None for causal zero padding.
        dilation: the conv's dilation (>= 1).
        doc_positions: ``[B, T]`` int32/int64 position of each token in its packed document
            (``layers.segments.document_positions``), or None: tap ``i`` (reaching
            ``(K-1-i) * dilation`` back) is dropped where that exceeds the position, so the
            conv restarts at every document start as with zero padding (``left`` reaches
            only a document continuing from before x).

    Returns:
        ``[B, T, C]`` contiguous in x's dtype, accumulated in fp32 and rounded once. Differentiable in x,
        weight and left. Raises ``ValueError`` / ``NotImplementedError`` naming the value and
        the rule for inputs the kernels do not run (``capability.py``).
    """
    check_causal_conv_inputs(x, weight, left, dilation, doc_positions)
    return CausalConvSiluFunction.apply(x, weight, left, dilation, doc_positions)
