"""Memory-lean autograd for the eager chunked gated delta rule.

Plain autograd through :func:`~overlap_runtime.ops.gdn.chunk.chunk_forward` keeps every chunk's
intermediates (the decayed ``[C, C]`` matrices, the WY factors, one state per chunk and the
residuals) alive until backward. :class:`ChunkGatedDeltaRuleFunction` instead

* forward: runs the chunked form block by block (``block_chunks`` chunks each) without building
  a graph and saves only the inputs (q, k, v, g, beta, initial_state) and the state entering each
  block, one ``[B, HV, K, V]`` tensor per ``block_chunks`` chunks;
* backward: walks the blocks in reverse; for each block it re-runs the chunked forward from the
  saved boundary state with autograd enabled and calls ``torch.autograd.grad`` with the block's
  output gradient and the gradient of the state leaving the block. That yields the block's input
  gradients and the gradient of the state entering it, which feeds the previous block.

Peak memory in forward is one block's intermediates, in backward one block's graph, instead of
the whole sequence's. The price is one
extra forward (the recompute). The backward is first order only (``once_differentiable``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .chunk import chunk_forward
from .reference import compute_dtype

__all__ = ["ChunkGatedDeltaRuleFunction", "chunk_gated_delta_rule_eager"]

DEFAULT_BLOCK_CHUNKS = 4


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """``apply(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, block_chunks)``
    returns ``(o [B, T, HV, V], final_state [B, HV, K, V])``; see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        scale: float,
        use_qk_l2norm: bool,
        chunk_size: int,
        block_chunks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Blocks of block_chunks chunks, in order: the transient intermediates of one block at a
        # time, and the state entering each block is exactly what backward needs.
        seq_len = q.shape[1]
        block_tokens = chunk_size * block_chunks
        h = None if initial_state is None else initial_state.to(compute_dtype(q.dtype))
        outputs, entering = [], []
        for start in range(0, seq_len, block_tokens):
            stop = min(seq_len, start + block_tokens)
            o_block, h_next = chunk_forward(
                q[:, start:stop], k[:, start:stop], v[:, start:stop], g[:, start:stop],
                beta[:, start:stop], scale, h, use_qk_l2norm, chunk_size,
            )
            if h is None:
                h = torch.zeros_like(h_next)
            entering.append(h)
            outputs.append(o_block)
            h = h_next
        o, final_state = torch.cat(outputs, dim=1), h
        boundaries = torch.stack(entering, dim=2)  # [B, HV, num_blocks, K, V]
        ctx.save_for_backward(q, k, v, g, beta, initial_state, boundaries)
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.chunk_size, ctx.block_chunks = chunk_size, block_chunks
        return o, final_state

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, do: torch.Tensor, dh_final: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, initial_state, boundaries = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        needs = ctx.needs_input_grad[:5]
        grads = [torch.zeros_like(x) if need else None for x, need in zip(inputs, needs)]
        seq_len = q.shape[1]
        block_tokens = ctx.chunk_size * ctx.block_chunks
        dh = dh_final.to(boundaries.dtype)
        for block in reversed(range(boundaries.shape[2])):
            start, stop = block * block_tokens, min(seq_len, (block + 1) * block_tokens)
            with torch.enable_grad():
                leaves = [x[:, start:stop].detach().requires_grad_(need)
                          for x, need in zip(inputs, needs)]
                h_start = boundaries[:, :, block].detach().requires_grad_(True)
                # no NaN containment: identical for finite inputs, and gradients after a NaN
                # are not contained anyway (docs/gdn.md)
                o_block, h_end = chunk_forward(
                    *leaves, ctx.scale, h_start, ctx.use_qk_l2norm, ctx.chunk_size,
                    contain_nan=False,
                )
                wanted = [leaf for leaf, need in zip(leaves, needs) if need] + [h_start]
                block_grads = torch.autograd.grad(
                    (o_block, h_end), wanted, (do[:, start:stop], dh), allow_unused=True
                )
            block_grads = iter(block_grads)
            for i, need in enumerate(needs):
                if need:
                    grad = next(block_grads)
                    if grad is not None:
                        grads[i][:, start:stop] = grad
            dh = next(block_grads)
        d_initial = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_initial = dh.to(initial_state.dtype)
        return (*grads, d_initial, None, None, None, None)


def chunk_gated_delta_rule_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    block_chunks: int = DEFAULT_BLOCK_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager chunked gated delta rule with the memory-lean backward (inputs are not validated
    here; use :func:`~overlap_runtime.ops.gdn.backend.chunk_gated_delta_rule`).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] fp32 / float64)``.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, block_chunks
    )
