"""Ring attention: local queries against K/V blocks that travel around the CP ring.

Each of the ``P`` ranks holds its shard of q, k, v (``[B, S/P, H, D]``). In step ``s`` rank
``me`` holds the K/V block of rank ``src = (me - s) % P``; while it computes with that block it
already sends it on to ``me + 1`` and receives the next one from ``me - 1`` (point-to-point,
prefetch), so the transfer hides behind the block's attention. Partial results are merged by
online softmax in float32 (``ops.attention.merge_attention_``).

Which block to compute (causal)
-------------------------------
Under zigzag (``sharding.py``: rank ``r`` holds chunks ``r`` and ``2P-1-r``; local halves ``q =
[q_lo | q_hi]``, ``kv = [kv_lo | kv_hi]``), for the block of rank ``src``::

    src == me   diagonal: causal block over the whole local shard (local order is true order)
    src <  me   chunk src < me < 2P-1-me < 2P-1-src: q_lo and q_hi both see kv_lo (chunk src)
                fully and kv_hi (chunk 2P-1-src) not at all  ->  all q  x  kv_lo, no mask
    src >  me   chunk me < src and 2P-1-src < 2P-1-me: q_lo sees nothing of this block, q_hi
                sees both kv chunks fully  ->  q_hi  x  all kv, no mask

Every off-diagonal step is half a block of work and no mask, on every rank: the balance the
layout was made for. Contiguous split: ``src < me`` full block, ``src == me`` causal, ``src >
me`` nothing (the block still travels on). Not causal: every step is a full block.

Backward
--------
A custom autograd Function with a hand-written ring: K/V travel the same way again; for each
block the gradients are recomputed from the saved ``(q, k, v, out, lse)`` and ``dout``
(``attention_block_backward``; no per-block graph is kept). ``dq`` accumulates locally; the
block's ``dk``/``dv`` (float32) travel *with* the block: in step ``s`` rank ``me`` adds its
share to the accumulator it received for block ``src`` and sends it on. After step ``P-1`` the
accumulator of block ``me + 1`` is complete at ``me`` and one last send delivers it home.

Communication per call (``P > 1``), per rank, counted in :class:`CommStats`:
forward ``P-1`` sends and ``P-1`` receives (K/V packed in one tensor); backward ``P-1`` K/V
sends/receives plus ``P`` dK/dV sends/receives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.context_parallel.sharding import LoadBalance, check_load_balance
from overlap_runtime.context_parallel.stats import CommStats, Phase
from overlap_runtime.ops.attention import (
    Backend,
    attention_block_backward,
    attention_block_forward,
    default_scale,
    merge_attention_,
)
from overlap_runtime.ops.comm import (
    AsyncHandle,
    _check_device_backend,
    _p2p,
    _timeout,
    group_rank,
    group_size,
)

__all__ = ["ring_attention", "ring_step_block"]

_ALL = slice(None)


def ring_step_block(src: int, me: int, local_len: int, causal: bool,
                    load_balance: LoadBalance) -> tuple[slice, slice, bool] | None:
    """The block rank ``me`` computes with the K/V of rank ``src``.

    Returns ``(q_rows, kv_rows, causal_block)`` (slices of the local sequence) or None when the
    block is entirely masked. The table is in the module docstring.
    """
    if not causal:
        return _ALL, _ALL, False
    if src == me:
        return _ALL, _ALL, True
    if load_balance == "zigzag":
        half = local_len // 2
        if src < me:
            return _ALL, slice(0, half), False
        return slice(half, local_len), _ALL, False
    if src < me:
        return _ALL, _ALL, False
    return None


class _RingShift:
    """One ring hop in flight: ``send`` goes to ``me + 1``, ``recv`` is filled from ``me - 1``.

    Keeps the send buffer alive until :meth:`wait`. Even ranks post send-then-receive, odd ranks
    receive-then-send: with P == 2 both peers are the same rank, and backends that serialise
    point-to-point per peer pair (NCCL's per-pair stream, or the main stream under eager init)
    would deadlock if both sides sent first. The same posting order on both sides of every pair
    also keeps the K/V and dK/dV messages matched in order (neither carries a tag).
    """

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None,
                 timeout_s: float, stats: CommStats | None, phase: Phase, what: str) -> None:
        me, world = group_rank(group), group_size(group)
        nxt, prv = (me + 1) % world, (me - 1) % world
        self.send, self.recv = send, recv
        ops = [("send", send, nxt), ("recv", recv, prv)]
        if me % 2:
            ops.reverse()
        works = _p2p(ops, group)
        self.handle = AsyncHandle(works, f"ring attention {what} ({phase}, rank {me}: send to "
                                  f"{nxt}, receive from {prv})", timeout_s)
        if stats is not None:
            stats.record(phase, "send", send.numel() * send.element_size())
            stats.record(phase, "recv", recv.numel() * recv.element_size())

    def wait(self) -> torch.Tensor:
        """Complete both transfers (bounded); return the received tensor."""
        self.handle.wait()
        return self.recv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup | None, causal: bool, load_balance: LoadBalance,
                scale: float, timeout_s: float, stats: CommStats | None,
                backend: Backend) -> torch.Tensor:
        me, world = group_rank(group), group_size(group)
        b, s, hq, d = q.shape
        out = torch.zeros(b, s, hq, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))  # one message per hop instead of two
        for step in range(world):
            src = (me - step) % world
            shift = None
            if step + 1 < world:  # prefetch the next block while this one computes
                shift = _RingShift(kv, torch.empty_like(kv), group, timeout_s, stats, "forward",
                                   "K/V")
            plan = ring_step_block(src, me, s, causal, load_balance)
            if plan is not None:
                qr, kr, blk_causal = plan
                blk_out, blk_lse = attention_block_forward(q[:, qr], kv[0][:, kr], kv[1][:, kr],
                                                           blk_causal, scale, backend)
                merge_attention_(out[:, qr], lse[:, :, qr], blk_out, blk_lse)
            if shift is not None:
                kv = shift.wait()
        out_cast = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_cast, lse)
        ctx.group, ctx.causal, ctx.load_balance = group, causal, load_balance
        ctx.scale, ctx.timeout_s, ctx.stats, ctx.backend = scale, timeout_s, stats, backend
        return out_cast

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, stats, scale, backend = ctx.group, ctx.stats, ctx.scale, ctx.backend
        me, world = group_rank(group), group_size(group)
        s = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv_shift: _RingShift | None = None
        for step in range(world):
            src = (me - step) % world
            kv_shift = None
            if step + 1 < world:
                kv_shift = _RingShift(kv, torch.empty_like(kv), group, ctx.timeout_s, stats,
                                      "backward", "K/V")
            # This rank's share of the gradient of block ``src``.
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            plan = ring_step_block(src, me, s, ctx.causal, ctx.load_balance)
            if plan is not None:
                qr, kr, blk_causal = plan
                dq_b, dk_b, dv_b = attention_block_backward(
                    dout[:, qr], q[:, qr], kv[0][:, kr], kv[1][:, kr], out[:, qr],
                    lse[:, :, qr], blk_causal, scale, backend)
                dq[:, qr] += dq_b
                dkv[0][:, kr] += dk_b
                dkv[1][:, kr] += dv_b
            if world > 1:
                if dkv_shift is not None:  # the other ranks' shares of block ``src``
                    dkv += dkv_shift.wait()
                # Pass the accumulator on; after the last step this delivers block me+1's
                # complete dK/dV to its owner (and we receive ours from me-1).
                dkv_shift = _RingShift(dkv, torch.empty_like(dkv), group, ctx.timeout_s, stats,
                                       "backward", "dK/dV")
            if kv_shift is not None:
                kv = kv_shift.wait()
        if dkv_shift is not None:
            dkv = dkv_shift.wait()
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, causal: bool = True,
                   load_balance: LoadBalance = "zigzag", scale: float | None = None,
                   timeout_s: float | None = None, stats: CommStats | None = None,
                   backend: Backend = "math") -> torch.Tensor:
    """Attention over the whole sequence, each rank holding its shard; K/V go round the ring.

    Args:
        q: local queries ``[B, S_local, Hq, D]``; k, v: ``[B, S_local, Hkv, D]``; all one dtype
            (fp32, bf16, fp16: accumulation is float32, the result is cast back). Sharded by
            ``load_balance`` (``sharding.shard_sequence``); every rank the same shapes.
        group: the CP process group (``cp_mesh.get_group()``); None: the default group.
        causal: causal mask over true positions.
        load_balance: ``"zigzag"`` (``S_local`` even) or None (contiguous).
        stats: a per-call :class:`CommStats` to record the point-to-point traffic into.
        backend: local block backend (``ops.attention``).

    Returns:
        ``[B, S_local, Hq, D]`` in q's dtype: this rank's rows of the full attention output.
    """
    check_load_balance(load_balance)
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention: q must be [B, S, Hq, D] and k, v [B, S, Hkv, D] of one "
                         f"shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring_attention: local q length {q.shape[1]} != local kv length "
                         f"{k.shape[1]} (all shards are equal under both split rules)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"ring_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if causal and load_balance == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"ring_attention: local length {q.shape[1]} must be even under zigzag "
                         f"(two chunks per rank; the full length must be a multiple of 2 * cp)")
    if group_size(group) > 1:
        _check_device_backend(q, group, "ring_attention")
    sc = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, bool(causal),
                                load_balance, sc, _timeout(timeout_s), stats, backend)
