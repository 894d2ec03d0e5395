"""The Triton backend's forward and backward (which launches run, what is saved) and its
autograd Function; the launchers themselves are launch.py's.

Forward by the kernel chain (``B`` batch, ``H`` key and ``HV`` value heads, ``NT`` chunks of 64,
``NS`` segments; the fused forward, fused_fwd.py, has its own prep and walk)::

    l2norm_fwd            q, k -> normalised q, k and 1/norm             (optional)
    kkt_solve             gamma (gate cumsum), Ainv = (I + A)^-1          grid (NT, B*HV)
    wy_fwd                w, u                                            grid (NT, B*HV)
    state scan            NS = 1: one walk per (value block, B*HV)
                          NS > 1: segment summaries (M_s, S_s) in parallel, the chain
                          h_(s+1) = M_s h_s + S_s across segments, then every segment's walk
                          from its true entering state, in parallel   grid (blocks, NS, B*HV)
    output                o (Q K^T once per key head)                     grid (V/BV, NT, B*H)

Saved for backward (per layer at T = 32K, B = 1, H = 16, HV = 32, K = V = 128, bf16, NS = 4;
1.77 GB, 1.50 GB with ``recompute_w``)::

    q, k                  the raw inputs [B, T, H, K]                     2 x 134 MB
    q_rstd, k_rstd        fp32 1/norm [B, T, H] (with the norm)           2 x 2.1 MB
    v, g, beta            inputs (g fp32: dg = 0 where it was floored)    268 + 4.2 + 2.1 MB
    gamma, Ainv           [B, T, HV] fp32, [B, T, HV, 64] in k's dtype    4.2 + 134 MB
    w                     [B, T, HV, K] (not with recompute_w)            268 MB
    M_s                   fp32 segment transitions (NS > 1 only)          8.4 MB
    states, v_new         per-chunk states [B, NT, HV, K, V] and residuals
                          [B, T, HV, V] of the forward scan               537 + 268 MB

Not saved: the normalised q, k (the backward's kernels read the raw q, k and 1/norm and
normalise each tile they load with the norm kernel's operations, common.normalised: the same
bits, no copy written; -268 MB),
u (no backward kernel reads it: the state gradients go through v_new; -268 MB), the states
entering the segments (dead after the scan). w with ``recompute_w`` (``GDNKernelOptions``):
one w-only ``wy_fwd`` launch in the backward (bitwise the forward's w; it reads Ainv and k and
writes w where the forward's also reads v and writes u: an estimated 0.05-0.065 ms of wy_fwd's
measured 0.097 ms, ~3% of 1.94 ms forward+backward at 8K on an H200, not measured; -268 MB);
off by default. The per-chunk states stay saved: they spare the backward a whole sequential walk
(about 4% of forward+backward on an H200; flash-linear-attention recomputes them and w, u).

Backward::

    recompute             w from Ainv and the raw keys (with recompute_w)  grid (NT, B*HV)
    dv_local              scale (Q K^T * Gamma)^T dO (per key head)       grid (NT, B*H)
    reverse scan          NS > 1: segment-local state gradients c_s from zero, the chain
                          dH_(s) = M_s^T dH_(s+1) + c_s, then every segment's reverse walk
    dqkwg                 dw, dgamma per value head; dq, dk (output and chunk-end parts)
                          summed over each key head's value heads  grid (K/BK, NT, B*H)
    wy_kkt_bwd            dv, dbeta, dg (reverse cumsum); dk: H == HV: finished in the kernel
                          (dqkwg's rows + the WY and A parts + the norm backward); H < HV:
                          each value head's WY and A parts                  grid (NT, B*HV)
    l2norm_bwd            norm backward of dq; with H < HV also of dk: dqkwg's key-head rows
                          plus the sum of the value heads' parts

Packed variable-length sequences (``cu_seqlens``, varlen.py): ``B = 1``, offsets int32 or
int64 ``[N + 1]`` from 0 to T (empty sequences allowed); the state restarts at every offset;
initial_state, the final state and their gradients are ``[N, HV, K, V]`` fp32. The same
launches as above, one per kernel for all sequences (no loop over sequences): a chunk table
built once per call maps every chunk index to ``(first token, sequence end)`` so that no chunk
straddles two sequences (a sequence of L tokens owns ``ceil(L / 64)`` chunks, the last cut at
its end and masked there as the dense path masks rows >= T; ``NT`` is the total), and the
scans walk segment tables instead of ``NS`` equal segments: one segment per sequence when
``num_segments`` (that of the longest sequence) is 1 or the sequences fill the machine, else
each sequence is cut into segments of the longest one's length whose summaries are chained per
sequence (``chain_kernel`` with ``VARLEN``). No token is copied or padded. Per-segment fp32
tensors are ``[NS, HV, K, V]`` there (``[B*HV, NS, K, V]`` dense), so with one segment per
sequence the initial and final states are those tensors. The dense path (``cu_seqlens=None``)
runs the same arithmetic as before (``VARLEN`` is a constexpr; ``cu_seqlens = [0, T]`` gives the
dense bits). Not combined with a context-parallel ``StateLink`` (raises).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch.autograd.function import once_differentiable

from .bwd_chunk import dqkwg_kernel, wy_kkt_bwd_kernel
from ..state_link import StateLink
from .common import CHUNK
from .fwd_output import output_kernel
from .fwd_prepare import wy_forward
from . import fused_fwd
from .fused_fwd import FusedConfig, fused_summaries, fused_walk
from .l2norm import l2norm_group_backward
from .launch import (chain, dv_local, prepare, prepare_fused, segment_layout, segment_rows,
                     segment_summaries, state_grad_scan, state_scan, value_block)
from .varlen import VarlenLayout, varlen_layout


@dataclass(frozen=True)
class ScanMeta:
    """What one forward decided and its backward reuses: the query scale, the segment
    layout (``num_segments`` segments of ``per_segment`` chunks, the last possibly shorter;
    with ``varlen``, the tables of varlen.py instead and ``per_segment`` unused) and whether w
    was left out of the saved tensors (``recompute_w``: the backward forms it again)."""

    scale: float
    num_segments: int
    per_segment: int
    varlen: VarlenLayout | None = None
    recompute_w: bool = False

    @property
    def chained(self) -> bool:
        """The scans need the segment summaries and the chain (more than one segment in a
        sequence)."""
        return self.num_segments > 1 if self.varlen is None else not self.varlen.single


def _entering(flat: torch.Tensor | None, bh: int, layout: VarlenLayout | None
              ) -> torch.Tensor | None:
    """A per-sequence state (``[BH, K, V]`` dense, ``[N * HV, K, V]`` varlen) as the value
    entering (or leaving) the scan's one segment per sequence."""
    if flat is None:
        return None
    return flat.reshape(bh, 1, *flat.shape[1:]) if layout is None else flat


def _layout(kn: torch.Tensor, u: torch.Tensor, num_segments: int | None,
            min_segments: int) -> tuple[int, int]:
    batch, seq_len, _, key_dim = kn.shape
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    programs = batch * num_value_heads * (value_dim // value_block(key_dim, value_dim))
    num_chunks = triton.cdiv(seq_len, CHUNK)
    ns, per_segment = segment_layout(num_chunks, programs, kn.device, num_segments)
    if ns < min_segments and num_chunks >= min_segments:
        ns, per_segment = segment_layout(num_chunks, programs, kn.device, min_segments)
    return ns, per_segment


def gdn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, h0: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
                num_segments: int | None, link: StateLink | None = None,
                cu_seqlens: torch.Tensor | None = None, recompute_w: bool = False,
                fused: bool = False, save: bool = True,
                fused_config: FusedConfig | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...] | None,
                           "ScanMeta"]:
    """The forward kernels (module docstring) without autograd.

    Args:
        q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, beta ``[B, T, HV]`` contiguous, one of
        bf16/fp16/fp32; g ``[B, T, HV]`` fp32; h0 ``[B, HV, K, V]`` fp32 or None (with a
        ``link``, the link's entering state is used instead).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B = 1; no ``link``);
            h0 and the final state are then ``[N, HV, K, V]``.
        recompute_w: leave w out of ``saved``; :func:`gdn_backward` forms it again from the
            saved Ainv (one w-only ``wy_fwd`` launch, bitwise the same w).
        fused: run the fused forward (fused_fwd.py: two prep launches with the norm folded
            in, then one summary launch and one walk that keeps the state on chip and writes
            o, residuals formed on chip) instead of the chain's l2norm, scan and output
            kernels; the same ``saved`` set (states and v_new written by the walk; the prep's
            1/norms, gamma, Ainv and w bitwise the chain's). ``save=False`` (fused only):
            nothing for a backward is written and ``saved`` is None (inference, no autograd).
        fused_config: the fused kernel's launch choices (None: fused_fwd.DEFAULT_CONFIG).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final [B, HV, K, V] fp32, saved tensors, meta)``:
        what :func:`gdn_backward` needs (``saved`` may hold None; the normalised q, k and u are
        never in it, module docstring).
    """
    layout = None
    if cu_seqlens is not None:
        layout = _varlen(q, v, num_segments, link, cu_seqlens)
    if fused:
        return _fused_forward(q, k, v, g, beta, h0, scale, use_qk_l2norm, num_segments, link,
                              layout, recompute_w, save, fused_config)
    if not save:
        raise ValueError("gdn_forward(save=False) needs fused=True: the kernel chain always "
                         "writes the saved tensors")
    prep = prepare(q, k, v, g, beta, use_qk_l2norm, None if layout is None else layout.chunks)
    kn, w, u, gamma = prep["kn"], prep["w"], prep["u"], prep["gamma"]
    batch, seq_len, heads, key_dim = kn.shape
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    bh = batch * num_value_heads
    if layout is None:
        num_chunks = triton.cdiv(seq_len, CHUNK)
        ns, per_segment = _layout(kn, u, num_segments, link.min_segments if link else 1)
    else:
        num_chunks, ns, per_segment = layout.num_chunks, layout.num_segments, 0
    meta = ScanMeta(scale, ns, per_segment, layout, recompute_w)
    m_seg = s_seg = None
    wants_maps = link is not None and link.wants_segment_maps
    if meta.chained or wants_maps:
        m_seg, s_seg = segment_summaries(kn, w, u, gamma, ns, per_segment, layout)
    if link is not None:
        if wants_maps:
            link.segment_maps(m_seg, s_seg)
        h0 = link.entering_state()
    h0_flat = None if h0 is None else h0.reshape(-1, key_dim, value_dim)
    if meta.chained:
        final_flat, seg_init = chain(m_seg, s_seg, h0_flat, store_segments=True, layout=layout)
        if link is not None:
            link.leaving_state(final_flat.reshape(batch, num_value_heads, key_dim, value_dim))
    else:
        seg_init = _entering(h0_flat, bh, layout)
    del s_seg
    states, v_new, h_end = state_scan(kn, w, u, gamma, seg_init, ns, per_segment, layout)
    if layout is None:
        final = h_end[:, -1].reshape(batch, num_value_heads, key_dim, value_dim)
    else:
        final = (h_end if layout.single else final_flat).reshape(-1, num_value_heads, key_dim,
                                                                   value_dim)
    if link is not None and ns == 1:
        link.leaving_state(final)
    o = torch.empty_like(v)
    bv = value_block(key_dim, value_dim)
    output_kernel[(value_dim // bv, num_chunks, batch * heads)](
        prep["qn"], kn, gamma, states, v_new, o, o if layout is None else layout.chunks, scale,
        seq_len, num_chunks, H=heads, HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK,
        BV=bv, VARLEN=layout is not None,
    )
    # not the normalised q, k (recomputed from q, k and 1/norm), nor u (the backward reads
    # none), nor seg_init (dead once the scan ran); w only without recompute_w
    saved = (q, k, v, g, beta, prep["q_rstd"], prep["k_rstd"], gamma, prep["ainv"],
             None if recompute_w else w, m_seg, states, v_new)
    return o, final, saved, meta


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, h0: torch.Tensor | None, scale: float,
                   use_qk_l2norm: bool, num_segments: int | None, link: StateLink | None,
                   layout: VarlenLayout | None, recompute_w: bool, save: bool,
                   config: FusedConfig | None
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...] | None,
                              "ScanMeta"]:
    """:func:`gdn_forward` by the fused walk: two prep launches with the norm folded in
    (:func:`prepare_fused`), segment summaries (when the sequence is split), the chain and the
    state hooks as the kernel chain runs them, then one walk that writes o (and, with ``save``,
    the per-chunk states and v_new of the chain's saved set; the rest of that set is the
    prep's)."""
    batch, seq_len, heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    bh = batch * num_value_heads
    if layout is None:
        num_chunks = triton.cdiv(seq_len, CHUNK)
        ns, per_segment = _layout(q, v, num_segments, link.min_segments if link else 1)
        tables: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    else:
        num_chunks, ns, per_segment = layout.num_chunks, layout.num_segments, 0
        tables = (layout.chunks, layout.segments)
    meta = ScanMeta(scale, ns, per_segment, layout, recompute_w)
    rows = segment_rows(bh, ns, layout)
    config = fused_fwd.DEFAULT_CONFIG if config is None else config
    prep = prepare_fused(q, k, v, g, beta, use_qk_l2norm, tables[0])
    prep["ainv"] = prep["ainv"] if save else None  # the backward's alone: freed before the walks
    m_seg = s_seg = None
    wants_maps = link is not None and link.wants_segment_maps
    if meta.chained or wants_maps:
        m_seg, s_seg = fused_summaries(prep, ns, per_segment, num_chunks, rows, tables, config)
    if link is not None:
        if wants_maps:
            link.segment_maps(m_seg, s_seg)
        h0 = link.entering_state()
    h0_flat = None if h0 is None else h0.reshape(-1, key_dim, value_dim)
    if meta.chained:
        final_flat, seg_init = chain(m_seg, s_seg, h0_flat, store_segments=True, layout=layout)
        if link is not None:
            link.leaving_state(final_flat.reshape(batch, num_value_heads, key_dim, value_dim))
    else:
        seg_init = _entering(h0_flat, bh, layout)
    del s_seg
    res = fused_walk(prep, seg_init, scale, ns, per_segment, num_chunks, rows, tables, save,
                     config=config)
    h_end = res["h_end"]
    if layout is None:
        final = h_end[:, -1].reshape(batch, num_value_heads, key_dim, value_dim)
    else:
        final = (h_end if layout.single else final_flat).reshape(-1, num_value_heads, key_dim,
                                                                   value_dim)
    if link is not None and ns == 1:
        link.leaving_state(final)
    saved = None
    if save:
        saved = (q, k, v, g, beta, prep["q_rstd"], prep["k_rstd"], prep["gamma"],
                 prep["ainv"], None if recompute_w else prep["w"], m_seg, res["states"],
                 res["v_new"])
    return res["o"], final, saved, meta


def _recompute_w(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                 k_rstd: torch.Tensor | None, gamma: torch.Tensor, ainv: torch.Tensor,
                 chunks: torch.Tensor | None) -> torch.Tensor:
    """w when the forward did not save it: the forward's WY kernel on the raw keys, normalised
    as it loads them (bitwise the forward's w, which was formed from the same bits)."""
    w, _ = wy_forward(k, v, beta, gamma, ainv, chunks, w_only=True, k_rstd=k_rstd)
    return w


def _varlen(q: torch.Tensor, v: torch.Tensor, num_segments: int | None,
            link: StateLink | None, cu_seqlens: torch.Tensor) -> VarlenLayout:
    """The varlen tables of a call, after its two rules (B = 1, no state link)."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into batch 1, got B={q.shape[0]}")
    if link is not None:
        raise NotImplementedError("cu_seqlens with a context-parallel state link is not "
                                  "supported by the Triton kernels (one sequence per rank chain)")
    key_dim, value_heads, value_dim = q.shape[3], v.shape[2], v.shape[3]
    programs = value_heads * (value_dim // value_block(key_dim, value_dim))
    return varlen_layout(cu_seqlens, q.shape[1], programs, q.device, num_segments)


def gdn_backward(saved: tuple[torch.Tensor | None, ...], meta: ScanMeta, do: torch.Tensor,
                 dht: torch.Tensor | None, link: StateLink | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor]:
    """The backward kernels (module docstring) given :func:`gdn_forward`'s ``saved, meta``.

    Args:
        do: ``[B, T, HV, V]``; dht: ``[B, HV, K, V]`` gradient of the final state or None
            (zeros; with a ``link``, the link's leaving-state gradient is used instead);
            ``[N, HV, K, V]`` after a varlen forward.

    Returns:
        ``(dq, dk, dv, dg fp32, dbeta, dh0 [B, HV, K, V] fp32)``; dh0 is the gradient of the
        entering state (zeros-start included; ``[N, HV, K, V]`` after a varlen forward).
    """
    q, k, v, g, beta, q_rstd, k_rstd, gamma, ainv, w, m_seg, states, v_new = saved
    scale, ns, per_segment, layout = meta.scale, meta.num_segments, meta.per_segment, meta.varlen
    chunks = None if layout is None else layout.chunks
    if (w is None) != meta.recompute_w:
        raise RuntimeError(f"gdn_backward: saved w is {'missing' if w is None else 'present'} "
                           f"but the forward ran with recompute_w={meta.recompute_w}")
    if w is None:
        w = _recompute_w(k, v, beta, k_rstd, gamma, ainv, chunks)
    # the kernels read the raw q, k and normalise each tile they load (no normalised copies)
    rstd = None if q_rstd is None else (q_rstd, k_rstd)
    do = do.contiguous()
    batch, seq_len, heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    bh = batch * num_value_heads
    num_chunks = triton.cdiv(seq_len, CHUNK) if layout is None else layout.num_chunks
    dvl = dv_local(q, k, gamma, do, scale, chunks, rstd)
    local = None
    wants_maps = link is not None and link.wants_segment_maps
    # dense without a link, the first segment's local gradient reaches only the chain's dh_in
    # (the initial state's gradient), which the stored walk below gives as dh_start[:, 0]
    skip_first = layout is None and link is None
    if meta.chained or wants_maps:
        _, _, local = state_grad_scan(q, k, w, gamma, do, dvl, None, scale, ns,
                                      per_segment, store=False, layout=layout, rstd=rstd,
                                      first_segment=int(skip_first and meta.chained))
    if link is not None:
        if wants_maps:
            assert m_seg is not None, "the forward ran without the link's segment maps"
            link.segment_state_grads(m_seg, local)
        dht = link.leaving_state_grad()
    dht_flat = (None if dht is None
                else dht.to(torch.float32).reshape(-1, key_dim, value_dim).contiguous())
    if meta.chained:
        # dh_in (without the first segment's term when skip_first: then unread)
        dh_in, dh_seg = chain(m_seg, local, dht_flat, reverse=True, store_segments=True,
                              layout=layout)
        if link is not None:
            link.entering_state_grad(dh_in.reshape(batch, num_value_heads, key_dim, value_dim))
    else:
        dh_seg = _entering(dht_flat, bh, layout)
    del local
    dhs, dv2, dh_start = state_grad_scan(q, k, w, gamma, do, dvl, dh_seg, scale, ns,
                                         per_segment, layout=layout, rstd=rstd)
    if link is not None and ns == 1:
        link.entering_state_grad(dh_start[:, 0].reshape(batch, num_value_heads, key_dim,
                                                        value_dim))
    del dvl
    bk = min(64, key_dim)
    bv = min(64, value_dim)
    slots = key_dim // bk
    f32 = dict(device=q.device, dtype=torch.float32)
    # dq, dk of the key heads (dqkwg sums them over their value heads), fp32
    dq_h = torch.empty(batch, seq_len, heads, key_dim, **f32)
    dk_h = torch.empty(batch, seq_len, heads, key_dim, **f32)
    dw = torch.empty_like(w)
    dg_part = torch.empty(slots, batch, seq_len, num_value_heads, **f32)
    dqkwg_kernel[(key_dim // bk, num_chunks, batch * heads)](
        q, k, *(rstd or (dw, dw)), gamma, states, dhs, v_new, dv2, do, dq_h, dk_h, dw, dg_part,
        chunks if chunks is not None else dw, scale, seq_len, num_chunks, batch, H=heads,
        HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK, BK=bk, BV=bv,
        VARLEN=chunks is not None, NORM=rstd is not None,
    )
    del states, dhs, v_new, w
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dg = torch.empty(batch, seq_len, num_value_heads, **f32)
    # one value head per key head: the kernel finishes dk (norm backward included); else it
    # writes each value head's WY and A parts, and the grouped norm backward adds dqkwg's rows
    finish = heads == num_value_heads
    dk_out = (torch.empty_like(k) if finish
              else torch.empty(batch, seq_len, num_value_heads, key_dim, **f32))
    wy_kkt_bwd_kernel[(num_chunks, bh)](
        k, v, beta, g, gamma, ainv, dv2, dw, dv, dk_h, dg_part, dbeta, dg,
        dbeta if k_rstd is None else k_rstd, dk_out, chunks if chunks is not None else dg,
        seq_len, batch, H=heads, HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK, BK=bk,
        BV=bv, SLOTS=slots, VARLEN=chunks is not None, NORM=rstd is not None,
    )
    dq = l2norm_group_backward(q, q_rstd, dq_h)
    dk = dk_out if finish else l2norm_group_backward(k, k_rstd, dk_out, base=dk_h)
    if layout is None:
        dh0 = dh_start[:, 0].reshape(batch, num_value_heads, key_dim, value_dim)
    else:
        dh0 = (dh_start if layout.single else dh_in).reshape(-1, num_value_heads, key_dim,
                                                              value_dim)
    return dq, dk, dv, dg, dbeta, dh0


class TritonChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """``apply(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, num_segments,
    cu_seqlens, recompute_w)`` returns ``(o [B, T, HV, V] in v's dtype, final_state
    [B, HV, K, V] fp32)`` (``[N, HV, K, V]`` with ``cu_seqlens``)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor | None, scale: float,
                use_qk_l2norm: bool, num_segments: int | None,
                cu_seqlens: torch.Tensor | None = None, recompute_w: bool = False,
                fused_forward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        o, final, saved, meta = gdn_forward(q, k, v, g, beta, h0, scale, use_qk_l2norm,
                                            num_segments, cu_seqlens=cu_seqlens,
                                            recompute_w=recompute_w, fused=fused_forward)
        ctx.save_for_backward(*saved)
        ctx.meta = meta
        ctx.has_initial_state = initial_state is not None
        ctx.state_dtype = None if initial_state is None else initial_state.dtype
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor, dht: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        dq, dk, dv, dg, dbeta, dh0 = gdn_backward(ctx.saved_tensors, ctx.meta, do, dht)
        dh0 = dh0.to(ctx.state_dtype) if ctx.has_initial_state else None
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None


def chunk_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  g: torch.Tensor, beta: torch.Tensor, scale: float,
                                  initial_state: torch.Tensor | None = None,
                                  use_qk_l2norm: bool = True, num_segments: int | None = None,
                                  cu_seqlens: torch.Tensor | None = None,
                                  recompute_w: bool = False, fused_forward: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton chunked gated delta rule (inputs are not validated here: use
    ``chunk_gated_delta_rule(..., backend="triton")``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]``, all one of
            bf16/fp16/fp32; g: ``[B, T, HV]`` fp32; initial_state ``[B, HV, K, V]`` fp32.
        num_segments: segments of the parallel state scan (None: chosen from the machine);
            with ``cu_seqlens``, the segments of the longest sequence.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N sequences packed in ``B = 1``
            (0 first, T last, never decreasing; empty sequences allowed): the state restarts
            at every offset, initial_state and the final state are ``[N, HV, K, V]``.
        recompute_w: do not save w ``[B, T, HV, K]`` for the backward, form it again there
            (one more ``wy_fwd`` launch, w only; same results bit for bit).
        fused_forward: two prep kernels with the norm folded in, then the fused walk
            (fused_fwd.py) instead of the chain's norm, scan and output; the same backward.
            With no gradient wanted (grad mode off, or no input requires grad) nothing is kept
            for a backward: o, final state.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] fp32)``, differentiable
        (final_state ``[N, HV, K, V]`` with ``cu_seqlens``).
    """
    inputs = (q, k, v, g, beta, initial_state)
    wants_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                                 for x in inputs)
    if fused_forward and not wants_grad:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        o, final, _, _ = gdn_forward(q, k, v, g, beta, h0, scale, use_qk_l2norm, num_segments,
                                     cu_seqlens=cu_seqlens, fused=True, save=False)
        return o, final
    return TritonChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_state, scale,
                                                   use_qk_l2norm, num_segments, cu_seqlens,
                                                   recompute_w, fused_forward)
