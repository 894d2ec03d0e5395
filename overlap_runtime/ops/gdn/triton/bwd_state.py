"""Backward state kernels: the local value gradient and the reverse state-gradient scan.

``dv_local_kernel``, grid ``(NT, B * H)``: ``dv_local = scale (Q K^T * Gamma)^T dO`` per chunk
(the part of dv_new's gradient that does not depend on the state gradient), in dO's dtype;
one program per key head walks its ``HV / H`` value heads with the raw ``K Q^T`` formed once.

Both read q, k as given, or with ``NORM`` the raw q, k and their 1/norms, normalising each
loaded tile (common.normalised: the same bits as the norm kernel's copy, which is not written).

``bwd_scan_kernel``, grid ``(V / BV, NS - S0 segments, B * HV)``: walks the chunks of its
segment (segments ``S0 .. NS - 1``; ``S0 = 1`` leaves out the first, whose local gradient only
the gradient of the initial state would read)
(``VARLEN``: of the segment table, common.segment_span) backwards with ``dh`` the gradient of
the state leaving chunk n::

    dv_new_n = dv_local_n + Ktail_n dh                         (stored: the gradient of u)
    dh      <- exp(gamma_C) dh + scale (diag(exp(gamma)) Q_n)^T dO_n - w_n^T dv_new_n

storing ``dh`` per chunk (input dtype) when ``STORE``; it writes the gradient of the state
entering the segment (fp32). With ``STORE=False`` from a zero start it computes the segment's
local state gradient ``c_s``, which ``chain_kernel(REVERSE=True)`` combines with the forward
summaries' ``M_s^T`` (``dH_in = M^T dH_out + c``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (SCAN_PAIRS, autotune_configs, chunk_span, mm, mma, normalised,
                     normalised_cols, segment_span)


@triton.autotune(configs=autotune_configs(), key=["H", "HV", "K", "V", "VARLEN", "NORM"])
@triton.jit
def dv_local_kernel(q, k, q_rstd, k_rstd, gamma, do, dv_local, chunks, scale, T,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
                    NORM: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    G: tl.constexpr = HV // H
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k = tl.arange(0, K)
    DT = k.dtype.element_ty
    b_q = tl.load(q + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    if NORM:
        b_q = normalised(b_q, tl.load(q_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0))
        b_k = normalised(b_k, tl.load(k_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0))
    # (K Q^T)[j, i] for i >= j: the transposed intra-chunk attention, built directly, once for
    # the key head's G value heads
    later = o_i[None, :] >= o_i[:, None]
    b_kq_raw = mm(b_k, tl.trans(b_q))
    for j in range(G):
        i_hv = i_h * G + j
        # padded tokens (t >= eos) take the last token's gamma, so no exponent is positive
        # (gamma 0 there overflowed to inf once a partial chunk's gates summed below -88:
        # inf * 0 = NaN)
        b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
        b_kq = tl.where(later, b_kq_raw * tl.exp(tl.where(later, b_gam[None, :]
                                                          - b_gam[:, None], 0.0)), 0.0) * scale
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
            b_do = tl.load(do + off_v, mask=m_t[:, None], other=0.0).to(DT)
            tl.store(dv_local + off_v, mm(b_kq.to(DT), b_do).to(dv_local.dtype.element_ty),
                     mask=m_t[:, None])


@triton.autotune(configs=autotune_configs(SCAN_PAIRS), key=["K", "V", "STORE", "VARLEN", "NORM"])
@triton.jit
def bwd_scan_kernel(q, k, q_rstd, k_rstd, w, gamma, do, dv_local, dh_init, dhs, dv2, dh_start,
                    chunks, segs, scale, T, NT, L, NS, S0, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                    HAS_INIT: tl.constexpr, STORE: tl.constexpr, VARLEN: tl.constexpr,
                    NORM: tl.constexpr):
    i_v, i_s, i_bh = tl.program_id(0), tl.program_id(1) + S0, tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    n0, n1, row = segment_span(segs, i_s, i_bh, i_hv, L, NT, NS, HV, VARLEN)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    DT = k.dtype.element_ty
    if HAS_INIT:
        b_dh = tl.load(dh_init + (row * K + o_k[:, None]) * V + o_v[None, :])
    else:
        b_dh = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(n1 - n0):
        n = n1 - 1 - j
        t0, eos = chunk_span(chunks, n, T, BT, VARLEN)
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        if STORE:
            base = ((i_b * NT + n) * HV + i_hv).to(tl.int64) * (K * V)
            tl.store(dhs + base + o_k[:, None] * V + o_v[None, :], b_dh.to(DT))
        b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
        g_last = tl.load(gamma + (i_b * T + tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None], other=0.0)
        if NORM:
            b_k = normalised(b_k, tl.load(k_rstd + (i_b * T + o_t) * H + i_h, mask=m_t,
                                          other=0.0))
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_dv = (mm(b_k, b_dh.to(DT)) * tl.where(m_t, tl.exp(g_last - b_gam), 0.0)[:, None]
                + tl.load(dv_local + off_v, mask=m_t[:, None], other=0.0))
        if STORE:
            tl.store(dv2 + off_v, b_dv.to(dv2.dtype.element_ty), mask=m_t[:, None])
        b_qt = tl.load(q + ((i_b * T + o_t[None, :]) * H + i_h) * K + o_k[:, None],
                       mask=m_t[None, :], other=0.0)
        if NORM:
            b_qt = normalised_cols(b_qt, tl.load(q_rstd + (i_b * T + o_t) * H + i_h, mask=m_t,
                                                 other=0.0))
        b_qt = (b_qt * (tl.exp(b_gam) * scale)[None, :]).to(DT)
        b_do = tl.load(do + off_v, mask=m_t[:, None], other=0.0).to(DT)
        b_wt = tl.load(w + ((i_b * T + o_t[None, :]) * HV + i_hv) * K + o_k[:, None],
                       mask=m_t[None, :], other=0.0)
        b_dh = mma(b_qt, b_do, b_dh * tl.exp(g_last))
        b_dh = mma(b_wt, (-b_dv).to(DT), b_dh)
    tl.store(dh_start + (row * K + o_k[:, None]) * V + o_v[None, :], b_dh)
