"""Ring attention: local queries against K/V blocks that travel around the CP ring.

Each of the ``P`` ranks holds its shard of q, k, v (``[B, S/P, H, D]``). In step ``s`` rank
``me`` holds the K/V block of rank ``src = (me - s) % P``; while it computes with that block it
already sends it on to ``me + 1`` and receives the next one from ``me - 1`` (point-to-point,
prefetch), so the transfer hides behind the block's attention. Partial results are merged by
online softmax in float32 (``ops.attention.merge_attention_``). Here and below "float32" is
the accumulation dtype (``ops.attention.accumulation_dtype``): float64 inputs are computed,
merged and summed in float64, not in float32.

Elementwise work besides the kernels and the K/V packing: blocks return their kernel's dtype
(``cast_float32=False``) and every sum reads it as is, in float32 arithmetic. The forward keeps
the diagonal block's output as the starting value and materialises a float32 accumulator only
for the rows a later block merges into, the last merge writing the output dtype
(:class:`_OutputMerger`); the backward's dq, dK, dV take each row piece's first contribution by
a copy and its last one straight into the result dtype (:class:`_GradSum`). So there are no
zero fills, no float32 copies of block results and no cast passes of their own; the rounding is
that of float32 accumulators cast once.

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

What travels (causal zigzag)
----------------------------
A block's hops visit ``src+1 .. P-1`` (they need ``kv_lo`` only) and then, after wrapping,
``0 .. src-1`` (they need all of it), so the second half must pass every rank in between: only
block 0 never wraps, and it travels as its first half (chunk 0) on every hop: chunk ``2P-1`` is
read by rank 0 alone. That is ``(P-1)/2`` blocks fewer per call, a quarter of the forward bytes
at ``P = 2`` (rank 0 sends half, rank 1 the whole block: rank 0's ``q_hi`` reads all of it).

Backward
--------
A custom autograd Function with a hand-written ring: K/V travel the same way again (block 0 as
its first half); for each block the gradients are recomputed from the saved ``(q, k, v, out,
lse)`` and ``dout`` (``attention_block_backward``; no per-block graph is kept). ``dq``
accumulates locally. The owner keeps its own (diagonal) share of dK/dV at home; the other
ranks' shares travel in one float32 accumulator that starts at ``src + 1``: in step ``s`` rank
``me`` adds its share to the accumulator it received and sends it on, and after step ``P-1``
the accumulator of block ``me + 1`` is complete at ``me`` and goes home (``P-1`` hops, not
``P``). While the accumulator has not wrapped past rank 0 it holds ``kv_lo`` rows only (every
rank above ``src`` reads only chunk ``src``) and travels as that half.

The diagonal block's backward is cut in two pieces of equal work (``q_hi x kv_lo`` unmasked;
``q_lo x kv_lo`` and ``q_hi x kv_hi`` causal): the first runs while the first K/V hop is in
flight, the second after the last dK/dV hop is posted, so that hop is hidden too.

Communication per call (``P > 1``), per rank, counted in :class:`CommStats`:
forward ``P-1`` sends and ``P-1`` receives (K/V packed in one tensor); backward ``P-1`` K/V
sends/receives plus ``P-1`` dK/dV sends/receives. Bytes: :func:`kv_hop_is_half`,
:func:`dkv_hop_is_half`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.context_parallel.peers import check_attention_call
from overlap_runtime.context_parallel.sharding import LoadBalance, check_load_balance
from overlap_runtime.ops.comm_stats import CommStats, Phase
from overlap_runtime.ops.attention import (
    Backend,
    accumulation_dtype,
    attention_block_backward,
    attention_block_forward,
    default_scale,
)
from overlap_runtime.context_parallel.ring_accumulate import _GradSum, _OutputMerger, _span
from overlap_runtime.ops import comm
from overlap_runtime.ops.comm import group_rank, group_size

_ALL = slice(None)


def _ring_step_block(src: int, me: int, local_len: int, causal: bool,
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
    """One ring hop in flight (``comm.ring_shift``: send to ``me + 1``, receive from ``me - 1``).

    ``comm.ring_shift`` keeps both buffers alive until :meth:`wait` and fixes the posting order
    that keeps two ranks from deadlocking and the untagged K/V and dK/dV messages matched in
    order; their sizes (whole or first half, see :func:`kv_hop_is_half` and
    :func:`dkv_hop_is_half`) are computed by sender and receiver from the same rule. Records the
    hop's bytes in ``stats``.
    """

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None,
                 timeout_s: float, stats: CommStats | None, phase: Phase, what: str) -> None:
        self.recv = recv
        self.handle = comm.ring_shift(send, recv, group, timeout_s=timeout_s,
                                      what=f"ring attention {what} ({phase})")
        if stats is not None:
            stats.record(phase, "send", send.numel() * send.element_size())
            stats.record(phase, "recv", recv.numel() * recv.element_size())

    def wait(self) -> torch.Tensor:
        """Complete both transfers (bounded); return the received tensor."""
        self.handle.wait()
        return self.recv


def kv_hop_is_half(src: int, causal: bool, load_balance: LoadBalance) -> bool:
    """Whether the K/V block of rank ``src`` travels as its first half only (every hop).

    Under causal zigzag a block's hops visit ``src+1, ..., P-1`` (all need only ``kv_lo``) and,
    after wrapping, ``0, ..., src-1`` (all need the whole block). Only block 0 never wraps: its
    second half (chunk ``2P-1``, the last of the sequence) is read by rank 0's own queries only.
    """
    return causal and load_balance == "zigzag" and src == 0


def dkv_hop_is_half(holder: int, src: int, causal: bool, load_balance: LoadBalance) -> bool:
    """Whether the dK/dV accumulator of block ``src``, sent on by rank ``holder``, is its first
    half only.

    The accumulator starts at ``src + 1`` (the owner keeps its own diagonal share at home) and
    holds the shares of ranks ``src+1 .. holder``. Under causal zigzag, while ``holder > src``
    (no wrap yet) every one of those ranks only touched ``kv_lo``; after the wrap ranks below
    ``src`` add to both halves.
    """
    return causal and load_balance == "zigzag" and holder > src


def _kv_message(k: torch.Tensor, v: torch.Tensor, half: bool) -> torch.Tensor:
    """``[2, B, L, Hkv, D]`` contiguous: k and v (their first halves when ``half``)."""
    if half:
        n = k.shape[1] // 2
        return torch.stack((k[:, :n], v[:, :n]))
    return torch.stack((k, v))


def _kv_rows(kv: torch.Tensor, kv_rows: slice, local_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v rows ``kv_rows`` of a K/V message that may hold the first half only."""
    if kv.shape[2] != local_len:  # a half message: it is exactly the rows the plan asks for
        if kv_rows != slice(0, local_len // 2):
            raise AssertionError(f"ring attention: half K/V block but rows {kv_rows} needed")
        return kv[0], kv[1]
    return kv[0][:, kv_rows], kv[1][:, kv_rows]


def _diag_backward_parts(local_len: int, causal: bool, split: bool
                         ) -> tuple[list[tuple[slice, slice, bool]], list[tuple[slice, slice, bool]]]:
    """The diagonal block's backward cut in two halves of equal work: the first runs while the
    first K/V hop is in flight, the second while the last dK/dV hop is (it would otherwise be
    the one exposed transfer of the ring). Exact: the pieces partition the block's mask.

    causal: ``q_hi x kv_lo`` (no mask) | ``q_lo x kv_lo`` and ``q_hi x kv_hi`` (causal squares).
    not causal: ``q_lo x kv`` | ``q_hi x kv``.
    """
    whole = [(_ALL, _ALL, causal)]
    if not split or local_len < 2 or (causal and local_len % 2):
        return whole, []
    n = local_len // 2
    lo, hi = slice(0, n), slice(n, local_len)
    if causal:
        return [(hi, lo, False)], [(lo, lo, True), (hi, hi, True)]
    return [(lo, _ALL, False)], [(hi, _ALL, False)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup | None, causal: bool, load_balance: LoadBalance,
                scale: float, timeout_s: float, stats: CommStats | None,
                backend: Backend) -> torch.Tensor:
        me, world = group_rank(group), group_size(group)
        s = q.shape[1]
        plans = [_ring_step_block((me - step) % world, me, s, causal, load_balance)
                 for step in range(world)]
        merger: _OutputMerger | None = None
        kv = _kv_message(k, v, kv_hop_is_half(me, causal, load_balance)) if world > 1 else None
        spare: dict[tuple[int, ...], torch.Tensor] = {}  # free receive buffers, by shape
        for step in range(world):
            shift = None
            if step + 1 < world:  # prefetch the next block before this one computes
                nsrc = (me - step - 1) % world
                recv = _take(spare, kv, kv_hop_is_half(nsrc, causal, load_balance), s)
                shift = _RingShift(kv, recv, group, timeout_s, stats, "forward", "K/V")
            plan = plans[step]
            if plan is not None:
                qr, kr, blk_causal = plan
                kk, vv = (k, v) if step == 0 else _kv_rows(kv, kr, s)
                # The kernel's own dtype: the merges read it as is (float32 arithmetic).
                blk_out, blk_lse = attention_block_forward(q[:, qr], kk, vv, blk_causal, scale,
                                                           backend, cast_float32=False)
                if merger is None:  # the diagonal covers every row: it starts the accumulator
                    merges = [p[0] for p in plans[1:] if p is not None]
                    merger = _OutputMerger(blk_out, blk_lse, q.dtype, merges)
                else:
                    merger.merge(qr, blk_out, blk_lse)
            if shift is not None:
                sent, kv = kv, shift.wait()
                spare[tuple(sent.shape)] = sent  # its send is complete: reuse as a buffer
        assert merger is not None  # step 0 (diagonal) always computes
        out, lse = merger.finish()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.load_balance = group, causal, load_balance
        ctx.scale, ctx.timeout_s, ctx.stats, ctx.backend = scale, timeout_s, stats, backend
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, stats, scale, backend = ctx.group, ctx.stats, ctx.scale, ctx.backend
        causal, lb, timeout_s = ctx.causal, ctx.load_balance, ctx.timeout_s
        me, world = group_rank(group), group_size(group)
        s = q.shape[1]
        dout = dout.contiguous()
        first, last = _diag_backward_parts(s, causal, split=world > 1)
        plans = [_ring_step_block((me - step) % world, me, s, causal, lb)
                 for step in range(world)]
        # Every contribution's rows are known up front, so each gradient row piece takes its
        # first contribution by a copy (no zero fill) and its last one straight into the
        # result dtype (no cast pass): _GradSum.
        dq = _GradSum(q, q.dtype, [p[0] for p in first + [p for p in plans[1:] if p] + last])
        # This rank's share of its own block's dK/dV stays here; the other ranks' shares come
        # home in one accumulator of home_len rows after the ring (P-1 dK/dV hops, not P).
        home_len = 0
        if world > 1:
            sender = (me - 1) % world
            home_half = dkv_hop_is_half(sender, (sender - (world - 1)) % world, causal, lb)
            home_len = s // 2 if home_half else s
        own_spans = [p[1] for p in first + last] + ([slice(0, home_len)] if world > 1 else [])
        dk, dv = _GradSum(k, k.dtype, own_spans), _GradSum(v, v.dtype, own_spans)

        def block(qr: slice, kk: torch.Tensor, vv: torch.Tensor, blk_causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            # Gradients in the kernel's dtype: the sums read them as is (float32 arithmetic).
            dq_b, dk_b, dv_b = attention_block_backward(
                dout[:, qr], q[:, qr], kk, vv, out[:, qr], lse[:, :, qr], blk_causal, scale,
                backend, cast_float32=False)
            dq.add(qr, dq_b)
            return dk_b, dv_b

        kv = _kv_message(k, v, kv_hop_is_half(me, causal, lb)) if world > 1 else None
        kv_shift = None
        if world > 1:  # block me-1 arrives while the first half of the diagonal computes
            recv = torch.empty(_msg_shape(kv, kv_hop_is_half((me - 1) % world, causal, lb), s),
                               dtype=kv.dtype, device=kv.device)
            kv_shift = _RingShift(kv, recv, group, timeout_s, stats, "backward", "K/V")
        for qr, kr, blk_causal in first:
            dk_b, dv_b = block(qr, k[:, kr], v[:, kr], blk_causal)
            dk.add(kr, dk_b)
            dv.add(kr, dv_b)
        dkv_shift: _RingShift | None = None
        spare: dict[tuple[int, ...], torch.Tensor] = {}
        for step in range(1, world):
            src = (me - step) % world
            assert kv_shift is not None
            sent, kv = kv, kv_shift.wait()
            spare[tuple(sent.shape)] = sent  # its send is complete: reuse as a buffer
            kv_shift = None
            if step + 1 < world:  # prefetch the next block before this one computes
                nsrc = (me - step - 1) % world
                kv_shift = _RingShift(kv, _take(spare, kv, kv_hop_is_half(nsrc, causal, lb), s),
                                      group, timeout_s, stats, "backward", "K/V")
            share = None
            plan = plans[step]
            if plan is not None:
                qr, kr, blk_causal = plan
                share = (kr, *block(qr, *_kv_rows(kv, kr, s), blk_causal))
            # The accumulator of block ``src``: the shares of ranks src+1 .. me.
            half = dkv_hop_is_half(me, src, causal, lb)
            acc = dkv_shift.wait() if dkv_shift is not None else None
            acc = _accumulate(acc, share, half, k)
            sender = (me - 1) % world
            rhalf = dkv_hop_is_half(sender, (sender - step) % world, causal, lb)
            recv = torch.empty(_msg_shape(acc, rhalf, s), dtype=acc.dtype, device=acc.device)
            # Pass it on; at step P-1 this delivers block me+1's dK/dV home (and ours arrives).
            dkv_shift = _RingShift(acc, recv, group, timeout_s, stats, "backward", "dK/dV")
        for qr, kr, blk_causal in last:  # hides the last dK/dV hop
            dk_b, dv_b = block(qr, k[:, kr], v[:, kr], blk_causal)
            dk.add(kr, dk_b)
            dv.add(kr, dv_b)
        if dkv_shift is not None:
            home = dkv_shift.wait()
            if home.shape[2] != home_len:
                raise AssertionError(f"ring attention: dK/dV home message has {home.shape[2]} "
                                     f"rows, expected {home_len}")
            dk.add(slice(0, home_len), home[0])
            dv.add(slice(0, home_len), home[1])
        return (dq.finish(), dk.finish(), dv.finish(),
                None, None, None, None, None, None, None)


def _msg_shape(like: torch.Tensor, half: bool, local_len: int) -> tuple[int, ...]:
    """Shape of a ``[2, B, L, H, D]`` ring message of ``like``'s kind: L = local_len or half."""
    shape = list(like.shape)
    shape[2] = local_len // 2 if half else local_len
    return tuple(shape)


def _take(spare: dict[tuple[int, ...], torch.Tensor], like: torch.Tensor, half: bool,
          local_len: int) -> torch.Tensor:
    """A receive buffer of the right size: a block whose send has completed, else a new one."""
    shape = _msg_shape(like, half, local_len)
    buf = spare.pop(shape, None)
    return buf if buf is not None else torch.empty(shape, dtype=like.dtype, device=like.device)


def _accumulate(acc: torch.Tensor | None, share: tuple[slice, torch.Tensor, torch.Tensor] | None,
                half: bool, k: torch.Tensor) -> torch.Tensor:
    """The dK/dV message ``acc + share`` (float32 ``[2, B, L, Hkv, D]``, float64 for float64
    inputs; L = half or whole).

    ``acc``: the received float32 message or None; ``share``: ``(kv_rows, dk [B, n, Hkv, D],
    dv)`` in any float dtype (a kernel's bf16 gradients are read as is). Adds in place into the
    received accumulator where it is big enough; otherwise writes a new message segment by
    segment (``torch.add(..., out=)`` where both cover rows, a copy where one does, zeros where
    neither): one pass, no zero fill under rows that are then overwritten.
    """
    b, s, h, d = k.shape
    length = s // 2 if half else s
    ka, kb = _span(share[0], s) if share is not None else (0, 0)
    if kb > length:
        raise AssertionError(f"ring attention: dK/dV share rows {(ka, kb)} outside a "
                             f"{length}-row message")
    if acc is not None and acc.shape[2] >= length:
        if share is not None:
            acc[0][:, ka:kb].add_(share[1])
            acc[1][:, ka:kb].add_(share[2])
        return acc
    new = torch.empty((2, b, length, h, d), dtype=accumulation_dtype(k.dtype), device=k.device)
    have = 0 if acc is None else acc.shape[2]
    cuts = sorted({0, length, have, ka, kb})
    for a, z in zip(cuts, cuts[1:]):
        in_acc = acc is not None and z <= have
        in_share = share is not None and ka <= a and z <= kb
        if acc is not None and in_acc and share is not None and in_share:
            for i in (0, 1):
                torch.add(acc[i][:, a:z], share[1 + i][:, a - ka:z - ka], out=new[i][:, a:z])
        elif acc is not None and in_acc:
            new[:, :, a:z].copy_(acc[:, :, a:z])
        elif share is not None and in_share:
            for i in (0, 1):
                new[i][:, a:z].copy_(share[1 + i][:, a - ka:z - ka])
        else:
            new[:, :, a:z].zero_()
    return new


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, causal: bool = True,
                   load_balance: LoadBalance = "zigzag", scale: float | None = None,
                   timeout_s: float | None = None, stats: CommStats | None = None,
                   backend: Backend = "math") -> torch.Tensor:
    """Attention over the whole sequence, each rank holding its shard; K/V go round the ring.

    Args:
        q: local queries ``[B, S_local, Hq, D]``; k, v: ``[B, S_local, Hkv, D]``; all one dtype
            (fp32, bf16, fp16: accumulation is float32, the result is cast back; float64:
            computed, merged and sent (dK/dV) in float64 throughout). Sharded by
            ``load_balance`` (``sharding.shard_sequence``); every rank the same shapes.
        group: the CP process group (``cp_mesh.get_group()``); None: the default group.
        causal: causal mask over true positions.
        load_balance: ``"zigzag"`` (``S_local`` even) or None (contiguous).
        stats: a per-call :class:`CommStats` to record the point-to-point traffic into.
        backend: local block backend (``ops.attention``).

    Returns:
        ``[B, S_local, Hq, D]`` in q's dtype: this rank's rows of the full attention output.

    Raises:
        ValueError: on every rank, before any K/V moves, when the ranks disagree on batch,
            local length, heads, head dim, dtype, ``causal`` or ``load_balance``
            (``peers.check_attention_call``), or on a bad local layout.
    """
    check_attention_call("ring_attention", q, k, v, group, causal, load_balance, timeout_s)
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
        comm.check_device_backend(q, group, "ring_attention")
    sc = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, bool(causal),
                                load_balance, sc, comm.resolve_timeout(timeout_s), stats, backend)
