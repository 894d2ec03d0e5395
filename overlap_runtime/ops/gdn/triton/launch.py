"""Launchers of the Triton backend's kernels: one function per launch, shapes in, tensors out.

The orchestration (which launches a forward or backward runs, the saved set, the autograd
Function) is function.py's; the kernels are those of l2norm.py, fwd_prepare.py, fwd_state.py
and bwd_state.py. Every launcher takes contiguous ``[B, T, heads, dim]``
tensors (``B = 1`` with a varlen layout, varlen.py) and returns new tensors; none keeps state.
"""

from __future__ import annotations

import torch
import triton

from .bwd_state import bwd_scan_kernel, dv_local_kernel
from .common import CHUNK, choose_segments
from .fwd_prepare import kkt_solve, wy_forward, wy_norms_forward
from .fwd_state import chain_kernel, fwd_scan_kernel
from .l2norm import l2norm_forward
from .varlen import VarlenLayout


def value_block(key_dim: int, value_dim: int) -> int:
    """Value columns per program of the scans and dv_local (64, or less for small heads)."""
    return min(64, key_dim, value_dim)


def segment_layout(num_chunks: int, programs: int, device: torch.device,
                   num_segments: int | None) -> tuple[int, int]:
    """``(NS, L)``: segments and chunks per segment (the last segment may be shorter)."""
    wanted = num_segments if num_segments is not None else choose_segments(num_chunks, programs,
                                                                           device)
    wanted = max(1, min(int(wanted), num_chunks))
    per_segment = -(-num_chunks // wanted)
    return -(-num_chunks // per_segment), per_segment


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, use_qk_l2norm: bool, chunks: torch.Tensor | None = None
            ) -> dict[str, torch.Tensor | None]:
    """Normalised q, k (and 1/norm), gamma, Ainv, w, u: everything before the state scan
    (``chunks``: the varlen chunk table, varlen.py, or None)."""
    if use_qk_l2norm:
        qn, q_rstd = l2norm_forward(q)
        kn, k_rstd = l2norm_forward(k)
    else:
        qn, kn, q_rstd, k_rstd = q, k, None, None
    gamma, ainv, _ = kkt_solve(kn, g, beta, v.shape[2], chunks)
    w, u = wy_forward(kn, v, beta, gamma, ainv, chunks)
    return {"qn": qn, "kn": kn, "q_rstd": q_rstd, "k_rstd": k_rstd, "gamma": gamma,
            "ainv": ainv, "w": w, "u": u}


def prepare_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, use_qk_l2norm: bool, chunks: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor | None]:
    """The fused forward's prep: two launches, no normalised copy of q, k.

    ``kkt_solve`` with the norm folded in (the keys' 1/norms, gamma, Ainv in k's dtype), then
    ``wy_fwd`` (w, u and the queries' 1/norms), fwd_prepare.py.
    Without the norm q, k are used as given and the 1/norms are None. Returns ``{"q", "k"``
    (the raw inputs), ``"q_rstd", "k_rstd", "gamma", "ainv", "w", "u"}`` (shapes:
    fwd_prepare.py)."""
    gamma, ainv, k_rstd = kkt_solve(k, g, beta, v.shape[2], chunks, norm=use_qk_l2norm)
    out = wy_norms_forward(q, k, v, beta, gamma, ainv, k_rstd, chunks)
    return {"q": q, "k": k, "k_rstd": k_rstd, "gamma": gamma, "ainv": ainv, **out}


def segment_rows(bh: int, num_segments: int, layout: VarlenLayout | None) -> tuple[int, int]:
    """Leading dims of the per-segment tensors: ``[B*HV, NS]`` dense, ``[NS, HV]`` varlen
    (B = 1; common.segment_span)."""
    return (bh, num_segments) if layout is None else (num_segments, bh)


def _tables(layout: VarlenLayout | None, dummy: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(chunks, segments, NT)`` arguments of a scan launch (``dummy`` pointers when dense)."""
    if layout is None:
        return dummy, dummy, 0
    return layout.chunks, layout.segments, layout.num_chunks


def segment_summaries(kn: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gamma: torch.Tensor,
                      num_segments: int, per_segment: int, layout: VarlenLayout | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary of every segment from zero, all in parallel.

    Returns:
        ``(M [B*HV, NS, K, K], S [B*HV, NS, K, V])`` fp32: ``h_out = M_s h_in + S_s``
        (``[NS, HV, ...]`` with a varlen ``layout``).
    """
    batch, seq_len, heads, key_dim = kn.shape
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    bv = value_block(key_dim, value_dim)
    bh = batch * num_value_heads
    rows = segment_rows(bh, num_segments, layout)
    m = torch.empty(*rows, key_dim, key_dim, device=kn.device, dtype=torch.float32)
    s = torch.empty(*rows, key_dim, value_dim, device=kn.device, dtype=torch.float32)
    chunks, segs, num_chunks = _tables(layout, m)
    fwd_scan_kernel[((key_dim + value_dim) // bv, num_segments, bh)](
        kn, w, u, gamma, m, kn, u, m, m, s, chunks, segs, seq_len,
        triton.cdiv(seq_len, CHUNK) if layout is None else num_chunks, per_segment,
        num_segments, H=heads, HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK, BV=bv,
        SUMMARY=True, HAS_INIT=False, STORE=False, VARLEN=layout is not None,
    )
    return m, s


def chain(m: torch.Tensor, s: torch.Tensor | None, h0: torch.Tensor | None, *,
          reverse: bool = False, store_segments: bool = False,
          layout: VarlenLayout | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Carry a state through ``NS`` affine maps in fp32.

    Args:
        m: ``[BH, NS, K, K]`` fp32; s: ``[BH, NS, K, N]`` fp32 or None (zero offsets).
        h0: ``[BH, K, N]`` fp32 or None (zero start; then ``s`` fixes N).
        reverse: walk from the last map back with ``M_s^T`` (state gradients).
        store_segments: also return the value entering each map ``[BH, NS, K, N]``.
        layout: varlen tables: m, s and the entering values are ``[NS, HV, ...]``, each
            sequence chains its own segments, h0 and h_out are ``[N * HV, K, N]``.

    Returns:
        ``(h_out [BH, K, N], h_seg or None)``.
    """
    rows = tuple(m.shape[:2])
    key_dim = m.shape[2]
    if layout is None:
        bh, num_segments, value_heads, programs = rows[0], rows[1], 1, rows[0]
    else:
        num_segments, value_heads = rows
        programs = bh = layout.num_seqs * value_heads
    cols = (s if s is not None else h0).shape[-1]
    block = min(32, cols)
    h_out = torch.empty(bh, key_dim, cols, device=m.device, dtype=torch.float32)
    h_seg = (torch.empty(*rows, key_dim, cols, device=m.device, dtype=torch.float32)
             if store_segments else None)
    chain_kernel[(triton.cdiv(cols, block), programs)](
        m, s if s is not None else m, h0 if h0 is not None else m,
        h_seg if h_seg is not None else m, h_out,
        layout.seq_segments if layout is not None else m, num_segments, K=key_dim, N=cols,
        BN=block, HAS_H0=h0 is not None, HAS_S=s is not None, STORE_SEG=store_segments,
        REVERSE=reverse, HV=value_heads, VARLEN=layout is not None, num_warps=8,
    )
    return h_out, h_seg


def state_scan(kn: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gamma: torch.Tensor,
               seg_init: torch.Tensor | None, num_segments: int, per_segment: int,
               layout: VarlenLayout | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every segment from its entering state, storing per-chunk states and residuals.

    Args:
        seg_init: ``[B*HV, NS, K, V]`` fp32 state entering each segment, or None (one segment
            from zero). With a varlen ``layout``: ``[NS, HV, K, V]``, or None (zeros).

    Returns:
        ``(states [B, NT, HV, K, V] in k's dtype, v_new [B, T, HV, V] in v's dtype,
        h_end [B*HV, NS, K, V] fp32)``; ``h_end[:, -1]`` is the final state (varlen: h_end is
        ``[NS, HV, K, V]``, and with one segment per sequence the final states).
    """
    batch, seq_len, heads, key_dim = kn.shape
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    num_chunks = triton.cdiv(seq_len, CHUNK) if layout is None else layout.num_chunks
    bv = value_block(key_dim, value_dim)
    bh = batch * num_value_heads
    states = torch.empty(batch, num_chunks, num_value_heads, key_dim, value_dim, device=kn.device,
                         dtype=kn.dtype)
    v_new = torch.empty_like(u)
    h_end = torch.empty(*segment_rows(bh, num_segments, layout), key_dim, value_dim,
                        device=kn.device, dtype=torch.float32)
    chunks, segs, _ = _tables(layout, h_end)
    fwd_scan_kernel[(value_dim // bv, num_segments, bh)](
        kn, w, u, gamma, seg_init if seg_init is not None else h_end, states, v_new, h_end,
        h_end, h_end, chunks, segs, seq_len, num_chunks, per_segment, num_segments, H=heads,
        HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK, BV=bv, SUMMARY=False,
        HAS_INIT=seg_init is not None, STORE=True, VARLEN=layout is not None,
    )
    return states, v_new, h_end


def state_grad_scan(qn: torch.Tensor, kn: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor,
                    do: torch.Tensor, dv_local: torch.Tensor, seg_init: torch.Tensor | None,
                    scale: float, num_segments: int, per_segment: int, store: bool = True,
                    layout: VarlenLayout | None = None,
                    rstd: tuple[torch.Tensor, torch.Tensor] | None = None,
                    first_segment: int = 0
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Reverse walk of every segment from the gradient of the state leaving it.

    Args:
        qn, kn: the normalised q, k; or with ``rstd = (q_rstd, k_rstd)`` (fp32 ``[B, T, H]``)
            the raw ones, normalised by the kernel as it loads them.
        seg_init: ``[B*HV, NS, K, V]`` fp32 gradient of the state leaving each segment, or None
            for zero (varlen ``layout``: ``[NS, HV, K, V]``).
        store: keep the per-chunk state gradients and dv_new (else only the segment starts).
        first_segment: 0, or 1 (dense, without ``store``) to leave the first segment out: its
            ``dh_start`` rows are zero (its local gradient reaches nothing but the gradient of
            the initial state, which the stored walk gives).

    Returns:
        ``(dhs [B, NT, HV, K, V] or None, dv2 [B, T, HV, V] or None,
        dh_start [B*HV, NS, K, V] fp32)`` (varlen: dh_start ``[NS, HV, K, V]``).
    """
    batch, seq_len, heads, key_dim = kn.shape
    num_value_heads, value_dim = do.shape[2], do.shape[3]
    num_chunks = triton.cdiv(seq_len, CHUNK) if layout is None else layout.num_chunks
    bv = value_block(key_dim, value_dim)
    bh = batch * num_value_heads
    if first_segment not in (0, 1) or (first_segment and (store or layout is not None
                                                          or num_segments < 2)):
        raise ValueError(f"state_grad_scan: first_segment={first_segment} must be 0, or 1 for a "
                         f"dense walk of 2+ segments without store")
    dh_start = torch.empty(*segment_rows(bh, num_segments, layout), key_dim, value_dim,
                           device=kn.device, dtype=torch.float32)
    if first_segment:
        dh_start[:, 0].zero_()
    chunks, segs, _ = _tables(layout, dh_start)
    dhs = dv2 = None
    if store:
        dhs = torch.empty(batch, num_chunks, num_value_heads, key_dim, value_dim,
                          device=kn.device, dtype=kn.dtype)
        dv2 = torch.empty(batch, seq_len, num_value_heads, value_dim, device=kn.device,
                          dtype=kn.dtype)
    bwd_scan_kernel[(value_dim // bv, num_segments - first_segment, bh)](
        qn, kn, *(rstd or (w, w)), w, gamma, do, dv_local,
        seg_init if seg_init is not None else dh_start, dhs if store else dh_start,
        dv2 if store else dh_start, dh_start, chunks, segs, scale, seq_len, num_chunks,
        per_segment, num_segments, first_segment, H=heads, HV=num_value_heads, K=key_dim,
        V=value_dim, BT=CHUNK, BV=bv, HAS_INIT=seg_init is not None, STORE=store,
        VARLEN=layout is not None, NORM=rstd is not None,
    )
    return dhs, dv2, dh_start


def dv_local(qn: torch.Tensor, kn: torch.Tensor, gamma: torch.Tensor, do: torch.Tensor,
             scale: float, chunks: torch.Tensor | None = None,
             rstd: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``scale (Q K^T * Gamma)^T dO`` per chunk: ``[B, T, HV, V]`` in dO's dtype (the reverse
    scan adds it to ``Ktail dh`` in fp32 and rounds the sum to that dtype anyway); ``chunks``:
    the varlen chunk table or None; ``rstd``: as :func:`state_grad_scan`."""
    batch, seq_len, heads, key_dim = kn.shape
    num_value_heads, value_dim = do.shape[2], do.shape[3]
    out = torch.empty_like(do)
    num_chunks = triton.cdiv(seq_len, CHUNK) if chunks is None else chunks.shape[0]
    dv_local_kernel[(num_chunks, batch * heads)](
        qn, kn, *(rstd or (out, out)), gamma, do, out, chunks if chunks is not None else out,
        scale, seq_len, H=heads, HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK,
        BV=value_block(key_dim, value_dim), VARLEN=chunks is not None, NORM=rstd is not None,
    )
    return out
