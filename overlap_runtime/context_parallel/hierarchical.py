"""Hierarchical attention CP: Ulysses over the inner CP dimension, ring over the outer one.

The CP group of ``P`` ranks is a 2-D mesh ``(R, A)``: ``P = R x A``, CP rank ``p = j * A + a``
(``j``: ring index, outer; ``a``: all-to-all index, inner, the ranks of one node). Every rank
holds its shard of the sequence by the **flat** rule over ``P`` (``sharding.py``), the rule the
rest of the model uses, so a hierarchical layer can sit beside flat ones::

    rank p: q [B, s, Hq, D] --a2a over A--> [B, A*s, Hq/A, D]   (the A shards of ring rank j)
            --ring attention over R (zigzag or contiguous, GQA)--> [B, A*s, Hq/A, D]
            --a2a over A--> [B, s, Hq, D]

Why the union of an inner group's shards is ring rank ``j``'s shard over ``R``
----------------------------------------------------------------------------------
Zigzag over ``P``: rank ``p`` holds ``P``-chunks ``p`` and ``2P-1-p`` (chunks of ``S/2P``).
The ranks ``jA .. jA+A-1`` of ring rank ``j`` hold the chunks ``[jA, (j+1)A)`` (first halves,
in order of ``a``) and ``[2P-(j+1)A, 2P-jA)`` (second halves, in reverse order of ``a``). The
first range is ``R``-chunk ``j`` (chunks of ``S/2R = A * S/2P``), the second ``R``-chunk
``2R-1-j``: exactly rank ``j``'s zigzag shard over ``R``. So after the all-to-all the gathered
tokens are put in true order (first halves by ``a``, then second halves by ``a`` descending:
``ulysses._sequence_pieces``, a ``cat`` of views) and the ring runs its zigzag plan over ``R``
unchanged. Contiguous over ``P``: the inner group holds ``[jS/R, (j+1)S/R)`` in rank order,
ring rank ``j``'s contiguous shard. ``P = 8 = 2 x 4`` zigzag, ``S = 16`` (one token a chunk)::

    flat ranks         0:(0,15) 1:(1,14) 2:(2,13) 3:(3,12) 4:(4,11) 5:(5,10) 6:(6,9) 7:(7,8)
    A=2: ring rank j   0:{0,1,14,15}  1:{2,3,12,13}  2:{4,5,10,11}  3:{6,7,8,9}   zigzag over 4

Heads: ``Hq % A == 0``; kv heads are scattered (``Hkv % A == 0``) or replicated up to ``A``
(``A % Hkv == 0``), as in ``ulysses.py``; the ring takes ``Hq/A`` query heads against the
received kv heads (GQA).

Communication per call and rank (``b``: element bytes, ``t = B s`` local tokens,
``hkv' = max(Hkv, A)``):

* forward: 2 all-to-alls on the inner group (q/k/v ``t (Hq + 2 hkv') D b`` bytes in, outputs
  ``t Hq D b`` back) and the ring's ``R-1`` K/V hops of ``2 A t (hkv'/A) D b`` bytes on the
  outer group (under causal zigzag ring rank 0's hops carry half);
* backward: the two all-to-alls reversed, the ring's ``R-1`` K/V hops and ``R-1`` dK/dV hops
  (fp32 accumulators); plus one agreement all-gather per group before the forward
  (``peers.check_attention_call``).

Against flat Ulysses over ``P`` the all-to-all stays inside a node and needs only ``Hq % A``;
against a flat ring over ``P`` there are ``R - 1`` hops instead of ``P - 1``, each ``A`` tokens
longer and ``A`` times fewer heads (the same bytes), so the cross-node traffic drops by
``(P-1)/(R-1)`` hops' worth of latency. docs/context_parallel.md has the table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.config.cp import check_hierarchical_degrees
from overlap_runtime.context_parallel.peers import check_attention_call
from overlap_runtime.context_parallel.ring import ring_attention
from overlap_runtime.context_parallel.sharding import LoadBalance, check_load_balance
from overlap_runtime.context_parallel.ulysses import (
    Pieces,
    _gather,
    _pack_heads,
    _sequence_pieces,
    ulysses_kv_heads,
)
from overlap_runtime.ops import comm
from overlap_runtime.ops.attention import Backend
from overlap_runtime.ops.comm_stats import CommStats, record_backward

#: Dimension names of the 2-D hierarchical CP mesh: outer (ring) first, inner (all-to-all).
HIERARCHICAL_MESH_DIMS = ("cp_ring", "cp_a2a")


def hierarchical_cp_mesh(cp_mesh: DeviceMesh, a2a: int) -> DeviceMesh:
    """The 2-D ``("cp_ring", "cp_a2a")`` mesh of the 1-D ``cp_mesh``: CP rank ``j * a2a + a``
    at ``(j, a)``. A collective call (it creates process groups): every rank of the world calls
    it once, in the same order (the trainer's ``ParallelDims.build_meshes`` does)."""
    if not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1:
        raise ValueError(f"hierarchical_cp_mesh: cp_mesh must be a 1-D DeviceMesh, got "
                         f"{cp_mesh!r}")
    if not cp_mesh.mesh_dim_names:
        raise ValueError("hierarchical_cp_mesh: cp_mesh has no dimension name; build it with "
                         "mesh_dim_names (init_device_mesh(..., mesh_dim_names=('cp',)))")
    problems = check_hierarchical_degrees(cp_mesh.size(), a2a, cp_mesh.size() // max(a2a, 1))
    if problems:
        raise ValueError("hierarchical_cp_mesh: " + "; ".join(problems))
    return cp_mesh._unflatten(0, (cp_mesh.size() // a2a, a2a), HIERARCHICAL_MESH_DIMS)


def _to_shards(x: torch.Tensor, pieces: Pieces, world: int) -> torch.Tensor:
    """Inverse of ``ulysses._gather``: ``[B, world*s, h, D]`` in sequence order -> the send
    buffer ``[world, B, s, h, D]`` in shard order (differentiable: views, cat, stack)."""
    rows: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(world)]
    t = 0
    for j, a, b in pieces:
        rows[j].append((a, x[:, t:t + b - a]))
        t += b - a
    return torch.stack([torch.cat([v for _, v in sorted(r, key=lambda p: p[0])], dim=1)
                        for r in rows])


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           a2a_group: dist.ProcessGroup, ring_group: dist.ProcessGroup,
                           causal: bool = True, load_balance: LoadBalance = "zigzag",
                           scale: float | None = None, timeout_s: float | None = None,
                           stats: CommStats | None = None, backend: Backend = "math"
                           ) -> torch.Tensor:
    """Ulysses over ``a2a_group`` (inner, ``A`` ranks) and ring attention over ``ring_group``
    (outer, ``R`` ranks) on local shards split by the flat rule over ``P = R x A``.

    Args:
        q: ``[B, S/P, Hq, D]``; k, v: ``[B, S/P, Hkv, D]``; one dtype; this rank's shard by
            ``load_balance`` over ``P`` with CP rank ``ring_rank * A + a2a_rank``.
        a2a_group, ring_group: the two groups of this rank (``hierarchical_cp_mesh``).
        stats: per-call :class:`CommStats` (``all_to_all`` of the inner group and the ring's
            ``send`` / ``recv``, forward and backward).

    Returns:
        ``[B, S/P, Hq, D]`` in q's dtype.

    Raises:
        ValueError: on every rank of a group, before its first message, when its ranks disagree
            on the call (``peers.check_attention_call``), or on bad head counts / local layout.
    """
    check_attention_call("hierarchical_attention", q, k, v, a2a_group, causal, load_balance,
                         timeout_s)
    check_load_balance(load_balance)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"hierarchical: q must be [B, S, Hq, D] and k, v [B, S, Hkv, D] of one "
                         f"shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"hierarchical: q {tuple(q.shape)} and k {tuple(k.shape)} differ in "
                         f"batch, local length or head dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"hierarchical: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    a2a = comm.group_size(a2a_group)
    b, s, hq, d = q.shape
    reorder = load_balance == "zigzag"
    if reorder and s % 2:
        raise ValueError(f"hierarchical: local length {s} must be even under zigzag (two chunks "
                         f"per rank; the full length must be a multiple of 2 * cp)")
    try:
        hkv = ulysses_kv_heads(hq, k.shape[2], a2a)
    except ValueError as exc:
        raise ValueError(f"hierarchical (all-to-all degree {a2a}): {exc}") from None
    if hkv != k.shape[2]:
        rep = hkv // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    hq_l, hkv_l = hq // a2a, hkv // a2a

    # inner: sequence -> heads, q/k/v in one all-to-all            [A, B, s, hq_l + 2 hkv_l, D]
    send = torch.cat([_pack_heads(q, a2a), _pack_heads(k, a2a), _pack_heads(v, a2a)], dim=3)
    nbytes = send.numel() * send.element_size()
    recv = comm.all_to_all_single(send, group=a2a_group, timeout_s=timeout_s,
                                  what="hierarchical q/k/v")
    assert isinstance(recv, torch.Tensor)
    if stats is not None:
        stats.record("forward", "all_to_all", nbytes)
        recv = record_backward(recv, stats, "all_to_all", nbytes)
    # The A shards in the ring's local order (true order under zigzag: see the module doc).
    pieces = _sequence_pieces(a2a, s, reorder)
    qh = _gather(recv, pieces, 0, hq_l)                                 # [B, A*s, hq_l, D]
    kh = _gather(recv, pieces, hq_l, hq_l + hkv_l)
    vh = _gather(recv, pieces, hq_l + hkv_l, hq_l + 2 * hkv_l)

    # outer: ring over R ranks, each holding its zigzag (or contiguous) shard over R.
    out = ring_attention(qh, kh, vh, group=ring_group, causal=causal, load_balance=load_balance,
                         scale=scale, timeout_s=timeout_s, stats=stats, backend=backend)

    # inner: heads -> sequence.
    send_o = _to_shards(out, pieces, a2a)                               # [A, B, s, hq_l, D]
    nbytes_o = send_o.numel() * send_o.element_size()
    recv_o = comm.all_to_all_single(send_o, group=a2a_group, timeout_s=timeout_s,
                                    what="hierarchical output")
    assert isinstance(recv_o, torch.Tensor)
    if stats is not None:
        stats.record("forward", "all_to_all", nbytes_o)
        recv_o = record_backward(recv_o, stats, "all_to_all", nbytes_o)
    return recv_o.permute(1, 2, 0, 3, 4).reshape(b, s, hq, d)


def mesh_groups(mesh: DeviceMesh) -> tuple[Any, Any]:
    """``(a2a_group, ring_group)`` of a 2-D ``(ring, a2a)`` hierarchical mesh."""
    return mesh.get_group(1), mesh.get_group(0)
