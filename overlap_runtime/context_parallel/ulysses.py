"""Ulysses attention: trade the sequence split for a head split, attend locally, trade back.

Each of the ``P`` ranks holds ``[B, S/P, H, D]`` of q, k, v. One all-to-all sends head group
``j`` of the local tokens to rank ``j``; afterwards rank ``j`` holds *all* tokens of heads
``[j*H/P, (j+1)*H/P)`` and runs ordinary attention on them. A second all-to-all sends the output
back to the sequence split. q, k and v travel in one all-to-all (their head groups are packed
side by side), so a call issues 2 all-to-alls forward and 2 backward (the reverses, from
``comm.all_to_all_single``'s autograd)::

    rank r: [B, S/P, Hq, D] ---a2a--> [B, S, Hq/P, D] --attention--> [B, S, Hq/P, D] ---a2a--> [B, S/P, Hq, D]

Sequence order: the gathered sequence is the rank-ordered concatenation of shards. Under zigzag
that is not the true order, so for a causal mask the gathered tokens are permuted to true order
before attention and back after (non-causal attention needs no reorder). The permutation moves
whole chunks: true chunk ``t < P`` is the first half of rank ``t``'s shard, chunk ``2P-1-j`` the
second half of rank ``j``'s, so it is a ``torch.cat`` of ``2P`` views, no index tensor.

Local work between the two all-to-alls (:class:`_UlyssesLocal`, one autograd node): the received
buffer ``[P, B, s, Hq/P + 2 Hkv/P, D]`` is read once into contiguous q, k, v in true order (one
``cat`` of chunk views each: head split and reorder in the same copy, and the layout the kernel
takes without another copy); the kernel's output, in its own dtype (no float32 round trip), is
written once into the next all-to-all's send buffer in shard order. The backward mirrors it:
one copy of the output gradient into true order, the kernel's backward, one copy of dq, dk, dv
into the received buffer's layout. Device copies per call besides the kernels and the
all-to-alls: forward pack q/k/v, unpack, out -> send buffer, final ``[B, s, Hq, D]`` layout;
backward the same four, reversed.

Heads (grouped-query attention)
-------------------------------
* ``Hq % P == 0`` is required (each rank takes whole query heads); otherwise an error names
  ``Hq`` and ``P`` and suggests ring attention.
* ``Hkv >= P``: ``Hkv % P == 0`` is required; kv head groups are scattered like q's. With
  ``g = Hq / Hkv`` the q heads rank ``j`` receives read exactly the kv heads it receives.
* ``Hkv < P``: each kv head is replicated ``P / Hkv`` times before the all-to-all (``P % Hkv ==
  0`` required), so every rank gets the one kv head its q heads read. The replicas' gradients
  are summed by autograd. Costs ``P / Hkv`` times the kv traffic of the un-replicated layout,
  which is still at most the q traffic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.context_parallel.peers import check_attention_call
from overlap_runtime.context_parallel.sharding import LoadBalance, check_load_balance
from overlap_runtime.ops.comm_stats import CommStats, record_backward
from overlap_runtime.ops import comm
from overlap_runtime.ops.attention import (
    Backend,
    attention_block_backward,
    attention_block_forward,
    default_scale,
)


def ulysses_kv_heads(q_heads: int, kv_heads: int, cp_size: int) -> int:
    """Number of kv heads after replication (``kv_heads`` or ``cp_size``); raises on bad counts.

    The rules are in the module docstring; the error names the head counts and ``cp_size``.
    """
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"ulysses: query heads {q_heads} must be a multiple of key/value heads "
                         f"{kv_heads}")
    if q_heads % cp_size:
        raise ValueError(f"ulysses: query heads {q_heads} are not divisible by cp size {cp_size} "
                         f"(each rank takes q_heads / cp heads); use ring attention or a cp size "
                         f"that divides {q_heads}")
    if kv_heads >= cp_size:
        if kv_heads % cp_size:
            raise ValueError(f"ulysses: key/value heads {kv_heads} are not divisible by cp size "
                             f"{cp_size} (needed when kv_heads >= cp; with kv_heads < cp they are "
                             f"replicated instead)")
        return kv_heads
    if cp_size % kv_heads:
        raise ValueError(f"ulysses: key/value heads {kv_heads} < cp size {cp_size} are replicated "
                         f"to {cp_size}, which needs cp % kv_heads == 0")
    return cp_size


def _pack_heads(x: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, s, H, D]`` -> ``[P, B, s, H/P, D]``: head group j first, to be sent to rank j."""
    b, s, h, d = x.shape
    return x.view(b, s, world, h // world, d).permute(2, 0, 1, 3, 4)


Pieces = list[tuple[int, int, int]]


def _sequence_pieces(world: int, shard_len: int, reorder: bool) -> Pieces:
    """The full sequence in true order as pieces ``(j, start, stop)``: rows ``[start, stop)`` of
    rank ``j``'s shard, consecutive in the sequence.

    Zigzag (``reorder``): chunks ``0 .. P-1`` are the first halves of ranks ``0 .. P-1``, chunks
    ``P .. 2P-1`` the second halves of ranks ``P-1 .. 0``. Otherwise the shards in rank order.
    """
    if not reorder:
        return [(j, 0, shard_len) for j in range(world)]
    c = shard_len // 2
    return [(j, 0, c) for j in range(world)] + [(j, c, shard_len) for j in reversed(range(world))]


def _gather(src: torch.Tensor, pieces: Pieces, h0: int, h1: int) -> torch.Tensor:
    """Heads ``[h0, h1)`` of a ``[P, B, s, H, D]`` buffer in sequence order: ``[B, P*s, h1-h0,
    D]``, contiguous, in one ``cat`` of the pieces' views (one pass, any dtype)."""
    return torch.cat([src[j, :, a:b, h0:h1] for j, a, b in pieces], dim=1)


def _scatter(parts: list[torch.Tensor], pieces: Pieces, dst: torch.Tensor) -> None:
    """Inverse of :func:`_gather`: write ``parts`` (``[B, P*s, h_i, D]`` in sequence order, any
    float dtype, rounded to dst's) side by side along the heads of ``dst`` ``[P, B, s, sum h_i,
    D]``, piece by piece (one pass over dst in all)."""
    t = 0
    for j, a, b in pieces:
        views = [x[:, t:t + b - a] for x in parts]
        if len(views) == 1:
            dst[j, :, a:b].copy_(views[0])
        else:
            torch.cat(views, dim=2, out=dst[j, :, a:b])
        t += b - a


class _UlyssesLocal(torch.autograd.Function):
    """Received ``[P, B, s, hq + 2 hkv, D]`` (q, k, v head groups packed, shard order) -> the
    output all-to-all's send buffer ``[P, B, s, hq, D]`` (shard order), in recv's dtype."""

    @staticmethod
    def forward(ctx: FunctionCtx, recv: torch.Tensor, hq: int, hkv: int, causal: bool,
                reorder: bool, scale: float, backend: Backend) -> torch.Tensor:
        world, b, s, _, d = recv.shape
        pieces = _sequence_pieces(world, s, reorder)
        q = _gather(recv, pieces, 0, hq)                              # [B, S, hq, D]
        k = _gather(recv, pieces, hq, hq + hkv)
        v = _gather(recv, pieces, hq + hkv, hq + 2 * hkv)
        out, lse = attention_block_forward(q, k, v, causal, scale, backend, cast_float32=False)
        out = out.to(recv.dtype)         # a no-op for the CUDA kernels (already recv's dtype)
        send = torch.empty((world, b, s, hq, d), dtype=recv.dtype, device=recv.device)
        _scatter([out], pieces, send)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.recv_shape, ctx.causal = pieces, tuple(recv.shape), causal
        ctx.scale, ctx.backend = scale, backend
        return send

    @staticmethod
    def backward(ctx: Any, grad_send: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dout = _gather(grad_send, ctx.pieces, 0, q.shape[2])          # [B, S, hq, D]
        dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale,
                                              ctx.backend, cast_float32=False)
        grad = torch.empty(ctx.recv_shape, dtype=q.dtype, device=q.device)
        _scatter([dq, dk, dv], ctx.pieces, grad)
        return grad, None, None, None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None, causal: bool = True,
                      load_balance: LoadBalance = "zigzag", scale: float | None = None,
                      timeout_s: float | None = None, stats: CommStats | None = None,
                      backend: Backend = "math") -> torch.Tensor:
    """Ulysses (sequence <-> head all-to-all) attention on local shards.

    Args:
        q: ``[B, S_local, Hq, D]``; k, v: ``[B, S_local, Hkv, D]``; one dtype, sharded by
            ``load_balance``.
        group: the CP group; causal: causal mask over true positions.
        stats: per-call :class:`CommStats` (records ``all_to_all``, forward and backward).

    Returns:
        ``[B, S_local, Hq, D]`` in q's dtype.

    Raises:
        ValueError: on every rank, before the first all-to-all, when the ranks disagree on
            batch, local length, heads, head dim, dtype, ``causal`` or ``load_balance``
            (``peers.check_attention_call``), or on bad head counts / local layout.
    """
    check_attention_call("ulysses_attention", q, k, v, group, causal, load_balance, timeout_s)
    check_load_balance(load_balance)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ulysses: q must be [B, S, Hq, D] and k, v [B, S, Hkv, D] of one shape; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"ulysses: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, "
                         f"local length or head dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"ulysses: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    world = comm.group_size(group)
    b, s, hq, d = q.shape
    reorder = causal and load_balance == "zigzag"
    if reorder and s % 2:
        raise ValueError(f"ulysses: local length {s} must be even under zigzag (two chunks per "
                         f"rank; the full length must be a multiple of 2 * cp)")
    hkv = ulysses_kv_heads(hq, k.shape[2], world)
    if hkv != k.shape[2]:
        rep = hkv // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    hq_l, hkv_l = hq // world, hkv // world

    # sequence -> heads: one all-to-all for q, k, v together (the cat is the one packing copy).
    send = torch.cat([_pack_heads(q, world), _pack_heads(k, world), _pack_heads(v, world)], dim=3)
    #                                                             [P, B, s, hq_l + 2 hkv_l, D]
    nbytes = send.numel() * send.element_size()
    recv = comm.all_to_all_single(send, group=group, timeout_s=timeout_s)
    assert isinstance(recv, torch.Tensor)
    if stats is not None:
        stats.record("forward", "all_to_all", nbytes)
        recv = record_backward(recv, stats, "all_to_all", nbytes)
    sc = default_scale(d) if scale is None else float(scale)
    send_o = _UlyssesLocal.apply(recv, hq_l, hkv_l, bool(causal), reorder, sc,
                                 backend)                       # [P, B, s, hq_l, D]

    # heads -> sequence.
    nbytes_o = send_o.numel() * send_o.element_size()
    recv_o = comm.all_to_all_single(send_o, group=group, timeout_s=timeout_s)
    assert isinstance(recv_o, torch.Tensor)
    if stats is not None:
        stats.record("forward", "all_to_all", nbytes_o)
        recv_o = record_backward(recv_o, stats, "all_to_all", nbytes_o)
    # recv_o[j] holds this rank's tokens for head group j.
    return recv_o.permute(1, 2, 0, 3, 4).reshape(b, s, hq, d)
