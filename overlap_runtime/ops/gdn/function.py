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

Packed sequences (``cu_seqlens``, B == 1): the blocks are cut per sequence, so a block never
straddles a boundary; each sequence's first block starts from its own initial state (zeros
without one), and the backward hands each sequence's entering-state gradient to its row of
``initial_state``. One python iteration per block, never per token.

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

DEFAULT_BLOCK_CHUNKS = 4


Bounds = tuple[tuple[int, int], ...]


def _sequence_bounds(cu_seqlens: torch.Tensor | None) -> Bounds | None:
    """``((start, stop), ...)`` of each packed sequence read from ``cu_seqlens`` (one host read),
    or None without ``cu_seqlens`` (every row of the batch is one whole sequence)."""
    if cu_seqlens is None:
        return None
    offsets = [int(x) for x in cu_seqlens.tolist()]
    return tuple(zip(offsets[:-1], offsets[1:]))


def _block_plan(bounds: Bounds, block_tokens: int) -> list[list[tuple[int, int]]]:
    """The ``(start, stop)`` blocks of each sequence, in order; a block never straddles a
    sequence boundary (an empty sequence has no block)."""
    return [[(s, min(e, s + block_tokens)) for s in range(start, e, block_tokens)]
            for start, e in bounds]


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """``apply(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, block_chunks,
    bounds)`` returns ``(o [B, T, HV, V], final_state)``; see the module docstring.

    ``bounds`` None: each batch row is one sequence, states ``[B, HV, K, V]``. Else (B == 1,
    packed) the ``(start, stop)`` of each of the N sequences (:func:`_sequence_bounds`): the state
    restarts from ``initial_state[n]`` (zeros without one) at each start, states are
    ``[N, HV, K, V]``, and an empty sequence's final state is its initial state.
    """

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
        bounds: Bounds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Blocks of block_chunks chunks, in order, never across a sequence boundary: the
        # transient intermediates of one block at a time, and the state entering each block is
        # exactly what backward needs.
        varlen = bounds is not None
        plan = _block_plan(bounds if varlen else ((0, q.shape[1]),), chunk_size * block_chunks)
        dtype = compute_dtype(q.dtype)
        batch, heads = v.shape[0], v.shape[2]
        outputs, entering, finals = [], [], []
        for n, blocks in enumerate(plan):
            h = None
            if initial_state is not None:
                h = (initial_state[n:n + 1] if varlen else initial_state).to(dtype)
            for start, stop in blocks:
                o_block, h_next = chunk_forward(
                    q[:, start:stop], k[:, start:stop], v[:, start:stop], g[:, start:stop],
                    beta[:, start:stop], scale, h, use_qk_l2norm, chunk_size,
                )
                if h is None:
                    h = torch.zeros_like(h_next)
                entering.append(h)
                outputs.append(o_block)
                h = h_next
            if h is None:  # an empty sequence without an initial state
                h = v.new_zeros(batch, heads, q.shape[-1], v.shape[-1], dtype=dtype)
            finals.append(h)
        o = torch.cat(outputs, dim=1)
        final_state = torch.cat(finals, dim=0) if varlen else finals[0]
        boundaries = torch.stack(entering, dim=2)  # [B, HV, num_blocks, K, V]
        ctx.save_for_backward(q, k, v, g, beta, initial_state, boundaries)
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.chunk_size, ctx.plan, ctx.varlen = chunk_size, plan, varlen
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
        dh_final = dh_final.to(boundaries.dtype)
        d_entering = []  # the gradient of each sequence's initial state, last sequence first
        block = boundaries.shape[2]
        for n in reversed(range(len(ctx.plan))):
            dh = dh_final[n:n + 1] if ctx.varlen else dh_final
            for start, stop in reversed(ctx.plan[n]):
                block -= 1
                with torch.enable_grad():
                    leaves = [x[:, start:stop].detach().requires_grad_(need)
                              for x, need in zip(inputs, needs)]
                    h_start = boundaries[:, :, block].detach().requires_grad_(True)
                    # no NaN containment: identical for finite inputs, and gradients after a
                    # NaN are not contained anyway (docs/gdn.md)
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
            d_entering.append(dh)
        d_initial = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_initial = torch.cat(d_entering[::-1], dim=0).to(initial_state.dtype)
        return (*grads, d_initial, None, None, None, None, None)


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
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager chunked gated delta rule with the memory-lean backward (inputs are not validated
    here; use :func:`~overlap_runtime.ops.gdn.backend.chunk_gated_delta_rule`).

    ``cu_seqlens`` (``[N + 1]`` int offsets, B == 1): N packed sequences, each from its own
    ``initial_state[n]`` (``[N, HV, K, V]``, zeros if None).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [B or N, HV, K, V] fp32 / float64)``.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, block_chunks,
        _sequence_bounds(cu_seqlens),
    )
