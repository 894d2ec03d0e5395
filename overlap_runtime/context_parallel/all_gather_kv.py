"""All-gather K/V attention: every rank gathers the whole K/V and attends with its local queries.

The simplest CP attention (Megatron's ``cp_comm_type="all_gather"``): one all-gather of K and V
(packed in one tensor) before attention, nothing to overlap, ``O(S)`` K/V memory per rank. The
backward of the gather (``comm.all_gather``) hands each rank the sum over ranks of its K/V
slice's gradient; ``comm`` implements that reduce-scatter as one all-to-all plus a local sum
(gloo has no reduce-scatter), so a call issues 1 all-gather forward and 1 all-to-all backward.

Causal offsets
--------------
After the gather the K/V are put in true sequence order. A local query chunk at true positions
``[p, p + L)`` (one chunk for the contiguous split, two under zigzag: ``sharding.shard_positions``)
attends to ``kv[:p]`` with no mask and to ``kv[p:p+L]`` with a square causal mask; the two blocks
are merged by online softmax, and the backward recomputes both from the merged ``(out, lse)``::

    keys:      0 ............ p ....... p+L ............ S
    chunk:     [  full block  ][ causal  ]   (nothing)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.context_parallel.peers import check_attention_call
from overlap_runtime.context_parallel.sharding import (
    LoadBalance,
    check_load_balance,
    reorder_to_sequence,
    shard_positions,
)
from overlap_runtime.ops.comm_stats import CommStats, record_backward
from overlap_runtime.ops import comm
from overlap_runtime.ops.attention import (
    Backend,
    accumulation_dtype,
    attention_block_backward,
    attention_block_forward,
    default_scale,
    merge_attention_,
)


def _query_chunks(local_len: int, cp_size: int, cp_rank: int,
                 load_balance: LoadBalance) -> list[tuple[int, int, int]]:
    """Contiguous runs of this rank's queries: ``(local_start, length, true_position_start)``."""
    pos = shard_positions(local_len * cp_size, cp_size, cp_rank, load_balance)
    n = 2 if load_balance == "zigzag" else 1
    c = local_len // n
    return [(i * c, c, int(pos[i * c])) for i in range(n)]


def _blocks(chunks: list[tuple[int, int, int]], causal: bool, kv_len: int
            ) -> list[tuple[slice, slice, bool]]:
    """``(q_rows, kv_rows, causal_block)`` for every block the local queries need."""
    if not causal:
        return [(slice(None), slice(0, kv_len), False)]
    blocks = []
    for start, length, pos in chunks:
        rows = slice(start, start + length)
        if pos > 0:
            blocks.append((rows, slice(0, pos), False))
        blocks.append((rows, slice(pos, pos + length), True))
    return blocks


class _GatheredKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                blocks: list[tuple[slice, slice, bool]], scale: float,
                backend: Backend) -> torch.Tensor:
        b, s, hq, d = q.shape
        acc = accumulation_dtype(q.dtype)  # float32, float64 for float64 inputs
        out = torch.zeros(b, s, hq, d, dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
        for qr, kr, blk_causal in blocks:
            blk_out, blk_lse = attention_block_forward(q[:, qr], k[:, kr], v[:, kr], blk_causal,
                                                       scale, backend)
            merge_attention_(out[:, qr], lse[:, :, qr], blk_out, blk_lse)
        out_cast = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_cast, lse)
        ctx.blocks, ctx.scale, ctx.backend = blocks, scale, backend
        return out_cast

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for qr, kr, blk_causal in ctx.blocks:
            dq_b, dk_b, dv_b = attention_block_backward(
                dout[:, qr], q[:, qr], k[:, kr], v[:, kr], out[:, qr], lse[:, :, qr], blk_causal,
                ctx.scale, ctx.backend)
            dq[:, qr] += dq_b
            dk[:, kr] += dk_b
            dv[:, kr] += dv_b
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def all_gather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            group: dist.ProcessGroup | None = None, causal: bool = True,
                            load_balance: LoadBalance = "zigzag", scale: float | None = None,
                            timeout_s: float | None = None, stats: CommStats | None = None,
                            backend: Backend = "math") -> torch.Tensor:
    """Attention of local queries against the all-gathered K/V.

    Args:
        q: ``[B, S_local, Hq, D]``; k, v: ``[B, S_local, Hkv, D]``; one dtype, sharded by
            ``load_balance``.
        stats: per-call :class:`CommStats` (``all_gather`` forward, ``all_to_all`` backward).

    Returns:
        ``[B, S_local, Hq, D]`` in q's dtype.

    Raises:
        ValueError: on every rank, before the gather, when the ranks disagree on batch, local
            length, heads, head dim, dtype, ``causal`` or ``load_balance``
            (``peers.check_attention_call``), or on a bad local layout.
    """
    check_attention_call("all_gather_kv_attention", q, k, v, group, causal, load_balance,
                         timeout_s)
    check_load_balance(load_balance)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"all_gather_kv: q must be [B, S, Hq, D] and k, v [B, S, Hkv, D] with the "
                         f"same B and S; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"all_gather_kv: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    world, me = comm.group_size(group), comm.group_rank(group)
    s = q.shape[1]
    if causal and load_balance == "zigzag" and s % 2:
        raise ValueError(f"all_gather_kv: local length {s} must be even under zigzag (two chunks "
                         f"per rank; the full length must be a multiple of 2 * cp)")

    kv = torch.stack((k, v))                                    # [2, B, s, Hkv, D]
    kv_full = comm.all_gather(kv, dim=2, group=group, timeout_s=timeout_s)
    if stats is not None:
        nbytes = kv_full.numel() * kv_full.element_size()
        stats.record("forward", "all_gather", nbytes)
        kv_full = record_backward(kv_full, stats, "all_to_all", nbytes)
    if causal:
        kv_full = reorder_to_sequence(kv_full, world, 2, load_balance)
    blocks = _blocks(_query_chunks(s, world, me, load_balance), causal, kv_full.shape[2])
    sc = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _GatheredKVAttention.apply(q, kv_full[0], kv_full[1], blocks, sc, backend)
