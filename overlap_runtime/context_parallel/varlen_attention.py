"""Full attention of packed (THD) batches under context parallelism: ring and Ulysses.

Each rank holds ``T / P`` tokens of every row, dealt by a :class:`~.packed.PackedLayout`
(contiguous, zigzag or per-document zigzag). A query attends a key iff both are in the same
document and the key does not come after the query; both facts are known on every rank from the
layout alone (document id and position in the row of every rank's tokens), so the mask of any
(query shard, key shard) pair is built locally and no metadata travels::

    allowed[b, i, j] = doc(q_i) == doc(k_j)  and  pos(k_j) <= pos(q_i)

``ring``: K/V travel ``me -> me+1`` (``P - 1`` hops); at step ``s`` rank ``me`` scores its
queries against the block of ``src = (me - s) % P`` under that mask, skipping a block no pair
of which is allowed (e.g. under ``contiguous``, every block of a later rank; under
``document_zigzag``, the blocks of documents it does not share). Blocks merge by online
softmax in the accumulation dtype (fp32, fp64 for fp64 inputs). ``ulysses``: one all-to-all
(heads -> sequence), the masked attention of the whole row for ``Hq / P`` heads, one all-to-all
back.

Implementation: the masked blocks are plain PyTorch (``math``) and the backward is autograd's
through a differentiable ring hop (:class:`_RingHop`: forward ``me -> me+1``, backward the
gradient ``me -> me-1``) and ``comm.all_to_all_single``; every rank runs the same hops in the
same order in both directions, also when it skips a block (the skipped block's K/V is attached
to the output, so its hop's backward still runs). This is the exact reference path for packed
batches; it keeps every block's scores for the backward (``B * Hq * (T/P)^2`` per step) and has
no flash/cuDNN varlen kernel yet.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.ops import comm
from overlap_runtime.ops.attention import accumulation_dtype, default_scale

from .packed import PackedLayout

_MASKED = -1e30  # finite: a fully masked row gets weight exp(-1e30 - lse) = 0, never NaN


def _packed_attention_mask(layout: PackedLayout, q_rank: int, k_rank: int,
                          device: torch.device | None = None) -> torch.Tensor:
    """``[B, T/P, T/P]`` bool: which of ``k_rank``'s keys each of ``q_rank``'s queries reads."""
    qd, kd = layout.local_document_ids(q_rank), layout.local_document_ids(k_rank)
    qp, kp = layout.row_positions(q_rank), layout.row_positions(k_rank)
    allowed = (qd[:, :, None] == kd[:, None, :]) & (kp[:, None, :] <= qp[:, :, None])
    return allowed.to(device) if device is not None else allowed


def _masked_attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           allowed: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One masked block, differentiable.

    Args:
        q: ``[B, Lq, Hq, D]``; k, v: ``[B, Lk, Hkv, D]`` (``Hq % Hkv == 0``).
        allowed: ``[B, Lq, Lk]`` bool.

    Returns:
        ``(out [B, Lq, Hq, D], lse [B, Hq, Lq])`` in the accumulation dtype; a row with no
        allowed key has ``lse ~ -1e30`` (weight 0 in any merge with a real block).
    """
    acc = accumulation_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    kf, vf = k.to(acc), v.to(acc)
    if group > 1:
        kf, vf = kf.repeat_interleave(group, 2), vf.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kf) * scale
    scores = scores.masked_fill(~allowed[:, None], _MASKED)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Lq]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse


def _merge(blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Online-softmax merge of ``(out [B, L, H, D], lse [B, H, L])`` blocks -> out."""
    if len(blocks) == 1:
        return blocks[0][0]
    lse = torch.stack([b[1] for b in blocks])  # [n, B, H, L]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).permute(0, 1, 3, 2)[..., None]  # [n, B, L, H, 1]
    return sum(w * b[0] for w, b in zip(weights, blocks))


class _RingHop(torch.autograd.Function):
    """``x`` (on rank ``me``) -> the tensor of rank ``me - 1``; backward: the gradient goes back
    ``me -> me - 1`` (it belongs to the tensor rank ``me - 1`` sent)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None,
                timeout_s: float | None, step: int) -> torch.Tensor:
        x = x.contiguous()
        recv = torch.empty_like(x)
        comm.ring_shift(x, recv, group, timeout_s=timeout_s,
                        what=f"packed ring attention K/V hop {step}").wait()
        ctx.group, ctx.timeout_s, ctx.step = group, timeout_s, step
        return recv

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group = ctx.group
        me, world = comm.group_rank(group), comm.group_size(group)
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        what = f"packed ring attention dK/dV hop {ctx.step} (backward)"
        # Same parity rule as comm.ring_shift (even ranks send first), reversed direction.
        ops = [lambda: comm.isend(grad, (me - 1) % world, group, timeout_s=ctx.timeout_s,
                                  what=what),
               lambda: comm.irecv(out, (me + 1) % world, group, timeout_s=ctx.timeout_s,
                                  what=what)]
        handles = [op() for op in (ops if me % 2 == 0 else ops[::-1])]
        for h in handles:
            h.wait()
        return out, None, None, None


def _check_call(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layout: PackedLayout, group: dist.ProcessGroup | None,
                timeout_s: float | None) -> tuple[int, int]:
    world, me = comm.group_size(group), comm.group_rank(group)
    fields = [("the shapes of q, k, v", (tuple(q.shape), tuple(k.shape), tuple(v.shape))),
              ("the dtype", q.dtype),
              ("the packed layout (cu_seqlens, B, T, rule)",
               (layout.cu_seqlens, layout.batch, layout.seq_len, layout.rule))]
    comm.check_ranks_agree(op, fields, group, device=q.device, group_name="cp",
                           timeout_s=timeout_s)
    if layout.cp_size != world:
        raise ValueError(f"{op}: layout is for cp_size={layout.cp_size}, the group has {world}")
    want = (layout.batch, layout.local_len)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4 or tuple(x.shape[:2]) != want:
            raise ValueError(f"{op}: {name} must be [B={want[0]}, T/P={want[1]}, H, D] (this "
                             f"rank's tokens of the packed layout), got {tuple(x.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{op}: Hq={q.shape[2]} is not a multiple of Hkv={k.shape[2]}")
    return me, world


def packed_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          layout: PackedLayout, group: dist.ProcessGroup | None = None,
                          scale: float | None = None, timeout_s: float | None = None
                          ) -> torch.Tensor:
    """Causal-within-document attention of a packed batch, K/V passed round a ring.

    Args:
        q: ``[B, T/P, Hq, D]``, k/v ``[B, T/P, Hkv, D]``: this rank's tokens of ``layout``.
        layout: the documents and the rule that dealt the tokens (identical on every rank).

    Returns:
        ``[B, T/P, Hq, D]`` in q's dtype.
    """
    me, world = _check_call("packed_ring_attention", q, k, v, layout, group, timeout_s)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    kv = torch.stack([k, v])
    blocks, idle = [], []
    for step in range(world):
        if step:
            kv = _RingHop.apply(kv, group, timeout_s, step)
        src = (me - step) % world
        allowed = _packed_attention_mask(layout, me, src, q.device)
        if not bool(allowed.any()):
            idle.append(kv)  # nothing to score; its hop's backward must still run
            continue
        blocks.append(_masked_attention_block(q, kv[0], kv[1], allowed, scale))
    out = _merge(blocks).to(q.dtype)
    return comm.attach(out, *idle) if idle else out


def packed_ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             layout: PackedLayout, group: dist.ProcessGroup | None = None,
                             scale: float | None = None, timeout_s: float | None = None
                             ) -> torch.Tensor:
    """Causal-within-document attention of a packed batch by head scattering (Ulysses).

    ``Hq % P == 0``; kv heads are scattered like q's when ``Hkv % P == 0`` and otherwise
    expanded to ``Hq`` heads first (the q heads a rank receives then find their kv heads).
    Shapes as :func:`packed_ring_attention`.
    """
    op = "packed_ulysses_attention"
    me, world = _check_call(op, q, k, v, layout, group, timeout_s)
    hq, hkv = q.shape[2], k.shape[2]
    if hq % world:
        raise ValueError(f"{op}: Hq={hq} query heads are not a multiple of cp_size={world} "
                         f"(Ulysses scatters heads; use mode='ring')")
    if hkv % world:
        k, v = (x.repeat_interleave(hq // hkv, 2) for x in (k, v))
    scale = default_scale(q.shape[-1]) if scale is None else scale

    def scatter(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, D] -> [P, B, L, H/P, D]
        b, n, h, d = x.shape
        return x.view(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()

    def gather_seq(x: torch.Tensor) -> torch.Tensor:  # [P, B, L, h, D] -> [B, P*L, h, D]
        return x.permute(1, 0, 2, 3, 4).reshape(x.shape[1], -1, *x.shape[3:])

    qs, ks, vs = (gather_seq(comm.all_to_all_single(scatter(x), group=group,
                                                    timeout_s=timeout_s)) for x in (q, k, v))
    # Tokens now come in rank order (rank i's shard i-th); the mask uses their true positions.
    pos = torch.cat([layout.row_positions(r) for r in range(world)], 1)
    doc = torch.cat([layout.local_document_ids(r) for r in range(world)], 1)
    allowed = ((doc[:, :, None] == doc[:, None, :]) & (pos[:, None, :] <= pos[:, :, None]))
    out, _ = _masked_attention_block(qs, ks, vs, allowed.to(q.device), scale)
    b, n = q.shape[:2]
    back = out.to(q.dtype).view(b, world, n, *out.shape[2:]).permute(1, 0, 2, 3, 4).contiguous()
    res = comm.all_to_all_single(back, group=group, timeout_s=timeout_s)  # [P heads, B, L, h, D]
    return res.permute(1, 2, 0, 3, 4).reshape(b, n, hq, q.shape[-1])
