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
before attention and back after (a local index_select; non-causal attention needs no reorder).

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

import torch
import torch.distributed as dist

from overlap_runtime.context_parallel.sharding import (
    LoadBalance,
    check_load_balance,
    reorder_to_sequence,
    reorder_to_shards,
)
from overlap_runtime.context_parallel.stats import CommStats, record_backward
from overlap_runtime.ops import comm
from overlap_runtime.ops.attention import Backend, attention

__all__ = ["ulysses_attention", "ulysses_kv_heads"]


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
    """
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
    hkv = ulysses_kv_heads(hq, k.shape[2], world)
    if hkv != k.shape[2]:
        rep = hkv // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    hq_l, hkv_l = hq // world, hkv // world

    # sequence -> heads: one all-to-all for q, k, v together.
    send = torch.cat([_pack_heads(q, world), _pack_heads(k, world), _pack_heads(v, world)], dim=3)
    send = send.contiguous()                                    # [P, B, s, hq_l + 2 hkv_l, D]
    nbytes = send.numel() * send.element_size()
    recv = comm.all_to_all_single(send, group=group, timeout_s=timeout_s)
    assert isinstance(recv, torch.Tensor)
    if stats is not None:
        stats.record("forward", "all_to_all", nbytes)
        recv = record_backward(recv, stats, "all_to_all", nbytes)
    full = recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, hq_l + 2 * hkv_l, d)
    if causal:
        full = reorder_to_sequence(full, world, 1, load_balance)
    q_f, k_f, v_f = full.split([hq_l, hkv_l, hkv_l], dim=2)

    out = attention(q_f, k_f, v_f, causal, scale, backend)     # [B, S, hq_l, D]

    # heads -> sequence.
    if causal:
        out = reorder_to_shards(out, world, 1, load_balance)
    send_o = out.reshape(b, world, s, hq_l, d).transpose(0, 1).contiguous()   # [P, B, s, hq_l, D]
    nbytes_o = send_o.numel() * send_o.element_size()
    recv_o = comm.all_to_all_single(send_o, group=group, timeout_s=timeout_s)
    assert isinstance(recv_o, torch.Tensor)
    if stats is not None:
        stats.record("forward", "all_to_all", nbytes_o)
        recv_o = record_backward(recv_o, stats, "all_to_all", nbytes_o)
    # recv_o[j] holds this rank's tokens for head group j.
    return recv_o.permute(1, 2, 0, 3, 4).reshape(b, s, hq, d)
