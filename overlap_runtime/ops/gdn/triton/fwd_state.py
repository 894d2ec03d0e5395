"""Forward state kernels: the chunked state scan (per-chunk states, residuals, segment ends or
segment summaries) and the chain that carries a state across segment summaries.

``fwd_scan_kernel``, grid ``(column blocks, NS segments, B * HV)``: one program walks the chunks
``[s L, min((s + 1) L, NT))`` of its segment for ``BV`` columns of the state (``VARLEN``: the
chunks of the segment table, common.segment_span, over the chunk table's spans)::

    v_new_n = u_n - w_n h_n                     (stored, residuals)
    h_(n+1) = exp(gamma_C) h_n + Ktail_n^T v_new_n

* state mode (``SUMMARY=False``): columns are the V columns of the state; it starts from the
  segment's entering state (or zero), stores ``h_n`` (input dtype) and ``v_new`` when ``STORE``,
  and writes the state leaving the segment (fp32).
* summary mode (``SUMMARY=True``): the same walk on the augmented state ``[M | S]``
  (``K + V`` columns) from ``[I | 0]`` with ``u`` replaced by ``[0 | u]``; the end is the
  segment's affine summary ``H_out = M H_in + S``. Nothing per chunk is stored.

``chain_kernel``, grid ``(column blocks, B * HV)``: ``h <- M_s h + S_s`` over the segments
(``REVERSE``: ``h <- M_s^T h + S_s`` from the last segment back), fp32 throughout, storing the
value entering each segment. It also serves ``apply`` (one segment) and ``compose``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import SCAN_PAIRS, autotune_configs, chunk_span, mm, mm_f32x3, mma, segment_span


@triton.autotune(configs=autotune_configs(SCAN_PAIRS), key=["K", "V", "BV", "SUMMARY", "VARLEN"])
@triton.jit
def fwd_scan_kernel(k, w, u, gamma, h_init, states, v_new, h_end, m_sum, s_sum, chunks, segs,
                    T, NT, L, NS, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                    SUMMARY: tl.constexpr, HAS_INIT: tl.constexpr, STORE: tl.constexpr,
                    VARLEN: tl.constexpr):
    i_c, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    n0, n1, row = segment_span(segs, i_s, i_bh, i_hv, L, NT, NS, HV, VARLEN)
    o_k = tl.arange(0, K)
    o_c = tl.arange(0, BV)
    DT = k.dtype.element_ty
    if SUMMARY:
        is_m = (i_c * BV + o_c) < K  # [BV]: the whole block is M columns or S columns
        col_m = i_c * BV + o_c
        col_v = (i_c - K // BV) * BV + o_c
        b_h = tl.where((o_k[:, None] == col_m[None, :]) & is_m[None, :], 1.0, 0.0)
        u_mask = (col_v >= 0) & (col_v < V)
    else:
        col_v = i_c * BV + o_c
        u_mask = col_v < V
        if HAS_INIT:
            b_h = tl.load(h_init + (row * K + o_k[:, None]) * V + col_v[None, :])
        else:
            b_h = tl.zeros([K, BV], dtype=tl.float32)
    for n in range(n0, n1):
        t0, eos = chunk_span(chunks, n, T, BT, VARLEN)
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        if STORE:
            base = ((i_b * NT + n) * HV + i_hv).to(tl.int64) * (K * V)
            tl.store(states + base + o_k[:, None] * V + col_v[None, :], b_h.to(DT))
        b_w = tl.load(w + ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :],
                      mask=m_t[:, None], other=0.0)
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + col_v[None, :]
        b_u = tl.load(u + off_v, mask=m_t[:, None] & u_mask[None, :], other=0.0)
        b_v = b_u.to(tl.float32) - mm(b_w, b_h.to(DT))
        if STORE:
            tl.store(v_new + off_v, b_v.to(v_new.dtype.element_ty), mask=m_t[:, None])
        b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
        g_last = tl.load(gamma + (i_b * T + tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        b_vs = b_v * tl.where(m_t, tl.exp(g_last - b_gam), 0.0)[:, None]
        b_kt = tl.load(k + ((i_b * T + o_t[None, :]) * H + i_h) * K + o_k[:, None],
                       mask=m_t[None, :], other=0.0)
        b_h = mma(b_kt, b_vs.to(DT), b_h * tl.exp(g_last))
    if SUMMARY:
        tl.store(m_sum + (row * K + o_k[:, None]) * K + col_m[None, :], b_h,
                 mask=(o_k[:, None] < K) & is_m[None, :])
        tl.store(s_sum + (row * K + o_k[:, None]) * V + col_v[None, :], b_h,
                 mask=(o_k[:, None] < K) & u_mask[None, :])
    else:
        tl.store(h_end + (row * K + o_k[:, None]) * V + col_v[None, :], b_h)


@triton.jit
def chain_kernel(m, s, h0, h_seg, h_out, seq_segs, NS, K: tl.constexpr, N: tl.constexpr,
                 BN: tl.constexpr, HAS_H0: tl.constexpr, HAS_S: tl.constexpr,
                 STORE_SEG: tl.constexpr, REVERSE: tl.constexpr, HV: tl.constexpr = 1,
                 VARLEN: tl.constexpr = False):
    """m ``[BH, NS, K, K]``, s ``[BH, NS, K, N]``, h0 / h_out ``[BH, K, N]``,
    h_seg ``[BH, NS, K, N]``; all fp32. ``VARLEN`` (grid ``(N / BN, num_seqs * HV)``): m, s,
    h_seg are ``[NS, HV, ...]`` and sequence ``i`` chains its segments
    ``[seq_segs[i], seq_segs[i + 1])``; h0 / h_out are ``[num_seqs, HV, K, N]``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, K)
    col = i_c * BN + tl.arange(0, BN)
    if VARLEN:
        s_lo = tl.load(seq_segs + i_bh // HV)
        count = tl.load(seq_segs + i_bh // HV + 1) - s_lo
    else:
        s_lo = 0
        count = NS
    if HAS_H0:
        b_h = tl.load(h0 + (i_bh * K + o_k[:, None]) * N + col[None, :])
    else:
        b_h = tl.zeros([K, BN], dtype=tl.float32)
    for j in range(count):
        if REVERSE:
            i_s = s_lo + count - 1 - j
        else:
            i_s = s_lo + j
        if VARLEN:
            row = i_s * HV + i_bh % HV
        else:
            row = i_bh * NS + i_s
        if STORE_SEG:
            tl.store(h_seg + (row * K + o_k[:, None]) * N + col[None, :], b_h)
        m_base = m + row.to(tl.int64) * (K * K)
        if REVERSE:
            b_m = tl.load(m_base + o_k[None, :] * K + o_k[:, None])
        else:
            b_m = tl.load(m_base + o_k[:, None] * K + o_k[None, :])
        b_h = mm_f32x3(b_m, b_h)
        if HAS_S:
            b_h += tl.load(s + (row * K + o_k[:, None]) * N + col[None, :])
    tl.store(h_out + (i_bh * K + o_k[:, None]) * N + col[None, :], b_h)
