"""Backward kernels that work on each chunk independently, once the state gradients are known.

With ``h`` the state entering the chunk, ``dH`` the gradient of the state leaving it,
``dv_new`` the full gradient of the residuals (from the reverse scan) and ``P = dO v_new^T``:

``dqkwg_kernel``, grid ``(K / BK, NT, B * H)``, for each of the ``G = HV / H`` value heads of
the key head in turn (q, k tiles loaded once)::

    dq  = scale (diag(exp(gamma)) dO h^T + (P * Gamma) K)
    dk  = scale (P * Gamma)^T Q + diag(exp(gamma_C - gamma)) v_new dH^T
    dw  = -dv_new h^T
    dgamma (partial) = q . dq - k . dk  (+ the chunk-end terms on the last valid token)

dw and dgamma are stored per value head; dq and dk are summed over the group in registers and
stored once per key head in fp32 (``[B, T, H, K]``: half the bytes of per-value-head copies at
G = 2, read once by what follows).

``(P * Gamma)^T`` is formed by a second product ``v_new dO^T`` rather than transposing the
cast result of a product (Triton miscompiles that transpose on Hopper; docs/gdn.md).

Both take a ``VARLEN`` constexpr: chunk ``i_n`` is then the chunk table's (common.chunk_span),
and a ``NORM`` one: q, k are then the raw inputs with their 1/norms, each loaded tile
normalised in registers (common.normalised: the norm kernel's bits; no normalised copy).

``wy_kkt_bwd_kernel``, grid ``(NT, B * HV)``: everything left, in one pass per chunk. Through
``u = Ainv diag(beta) V`` and ``w = Ainv diag(beta exp(gamma)) K``: dv, the beta and gamma parts,
and ``dAinv = du (beta V)^T + dw (beta e^gamma K)^T``; through ``Ainv = (I + A)^-1``:
``dA = -strict_lower(Ainv^T dAinv Ainv^T)`` (in registers; operands in k's dtype, fp32
accumulation); through ``A = strict_lower(diag(beta) K K^T * Gamma)``: the A parts of dk, dbeta
and dgamma. With one value head per key head (``H == HV``) whole rows get dqkwg's dk, both
parts and (with the norm) the l2norm backward ``dk_raw = rstd (dk - y (y . dk))``, stored once
in k's dtype. With ``H < HV`` the value head's WY and A parts are written alone in fp32
(nothing read back); the grouped norm backward adds them to dqkwg's key-head rows. (Summing
the group inside this kernel, one program per key head, spilled 0.6-0.9 KB per thread on sm_90
and ran 1.03 ms slower at B=1 T=32K H=16 HV=32 on an H100.) dgamma's partial sums are added
and turned into dg by a reverse cumsum inside the chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import SCAN_PAIRS, autotune_configs, chunk_span, gate_floored, mm, mma, normalised


@triton.autotune(configs=autotune_configs(SCAN_PAIRS), key=["H", "HV", "K", "V", "VARLEN", "NORM"])
@triton.jit
def dqkwg_kernel(q, k, q_rstd, k_rstd, gamma, states, dhs, v_new, dv2, do, dq, dk, dw, dg_part,
                 chunks, scale, T, NT, B, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 VARLEN: tl.constexpr, NORM: tl.constexpr):
    i_kb, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    G: tl.constexpr = HV // H
    o_i = tl.arange(0, BT)
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k = i_kb * BK + tl.arange(0, BK)
    DT = k.dtype.element_ty
    # the key head's q, k tiles, shared by its G value heads
    b_q = tl.load(q + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    if NORM:
        b_q = normalised(b_q, tl.load(q_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0))
        b_k = normalised(b_k, tl.load(k_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0))
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    last = tl.minimum(t0 + BT, eos) - 1
    causal = o_i[:, None] >= o_i[None, :]
    later = o_i[None, :] >= o_i[:, None]
    # dq, dk of the key head: sums over its value heads
    b_dq_h = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk_h = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(G):
        i_hv = i_h * G + j
        base = ((i_b * NT + i_n) * HV + i_hv).to(tl.int64) * (K * V)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkt = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_p = tl.zeros([BT, BT], dtype=tl.float32)
        b_pt = tl.zeros([BT, BT], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
            b_vn = tl.load(v_new + off_v, mask=m_t[:, None], other=0.0)
            b_do = tl.load(do + off_v, mask=m_t[:, None], other=0.0).to(DT)
            b_vnt = tl.trans(b_vn)
            b_dot = tl.trans(b_do)
            b_dv = tl.load(dv2 + off_v, mask=m_t[:, None], other=0.0)
            b_ht = tl.load(states + base + o_k[None, :] * V + o_v[:, None])  # [BV, BK]
            b_dht = tl.load(dhs + base + o_k[None, :] * V + o_v[:, None])
            b_dq += mm(b_do, b_ht)
            b_p += mm(b_do, b_vnt)
            b_pt += mm(b_vn, b_dot)
            b_dkt += mm(b_vn, b_dht)
            b_dw += mm(b_dv, b_ht)
            b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
        # padded tokens (t >= eos) take the last token's gamma: every exponent below stays <= 0
        # (with gamma 0 there, 0 - gamma_j overflowed to inf once a partial chunk's gates summed
        # below -88, and inf * 0 = NaN reached dk)
        b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
        g_last = tl.load(gamma + (i_b * T + last) * HV + i_hv)
        b_p = tl.where(causal, b_p * tl.exp(tl.where(causal, b_gam[:, None] - b_gam[None, :],
                                                     0.0)), 0.0) * scale
        b_pt = tl.where(later, b_pt * tl.exp(tl.where(later, b_gam[None, :] - b_gam[:, None],
                                                      0.0)), 0.0) * scale
        b_dq = b_dq * (scale * tl.exp(b_gam))[:, None] + mm(b_p.to(DT), b_k)
        b_dko = mm(b_pt.to(DT), b_q)
        b_dkt = b_dkt * tl.where(m_t, tl.exp(g_last - b_gam), 0.0)[:, None]
        b_tail = tl.sum(b_kf * b_dkt, axis=1)
        b_dgam = tl.sum(b_qf * b_dq, axis=1) - tl.sum(b_kf * b_dko, axis=1) - b_tail
        end_term = tl.sum(b_tail, axis=0) + tl.exp(g_last) * tl.sum(b_hdh, axis=0)
        b_dgam += tl.where(o_t == last, end_term, 0.0)
        off_w = ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
        tl.store(dw + off_w, (-b_dw).to(dw.dtype.element_ty), mask=m_t[:, None])
        tl.store(dg_part + ((i_kb * B + i_b) * T + o_t) * HV + i_hv, b_dgam, mask=m_t)
        b_dq_h += b_dq
        b_dk_h += b_dko + b_dkt
    off_k = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
    tl.store(dq + off_k, b_dq_h, mask=m_t[:, None])
    tl.store(dk + off_k, b_dk_h, mask=m_t[:, None])


@triton.jit
def _dk_block(k, dw, dk, o_t, m_t, o_k, i_b, i_h, i_hv, T, b_atd, b_dmd, b_beta, b_bk, b_knr,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
              ADD_DK: tl.constexpr):
    """Columns ``o_k`` of one value head's key gradient of one chunk (fp32 ``[BT, len(o_k)]``):
    the WY part ``diag(beta e^gamma) Ainv^T dw`` and both A parts ``diag(beta) dM K``,
    ``dM^T diag(beta) K`` (``dM`` the decayed gradient of A); with ``ADD_DK`` plus dqkwg's key-head
    rows of ``dk``."""
    DT = k.dtype.element_ty
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    if NORM:
        b_k = normalised(b_k, b_knr)
    off_w = ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
    b_dk = mm(b_atd, tl.load(dw + off_w, mask=m_t[:, None], other=0.0)) * b_bk[:, None]
    if ADD_DK:
        b_dk += tl.load(dk + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                        mask=m_t[:, None], other=0.0)
    b_dk += mm(b_dmd, b_k) * b_beta[:, None]
    b_dk += tl.trans(mm(tl.trans((b_k * b_beta[:, None]).to(DT)), b_dmd))
    return b_dk


@triton.autotune(configs=autotune_configs(SCAN_PAIRS), key=["H", "HV", "K", "V", "VARLEN", "NORM"])
@triton.jit
def wy_kkt_bwd_kernel(k, v, beta, g, gamma, ainv, dv2, dw, dv, dk, dg_part, dbeta, dg, k_rstd,
                      dk_out, chunks, T, B, H: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, SLOTS: tl.constexpr, VARLEN: tl.constexpr,
                      NORM: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    DT = k.dtype.element_ty
    # Ainv^T (stored in k's dtype), loaded transposed from memory
    p_at = ainv + ((i_b * T + o_t[None, :]) * HV + i_hv) * BT + o_i[:, None]
    b_atd = tl.load(p_at, mask=m_t[None, :], other=0.0)
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    # padded tokens take the last token's gamma (no positive exponent, as in dqkwg)
    b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
    b_eg = tl.exp(b_gam)
    b_bk = b_beta * b_eg
    if NORM:  # raw keys, normalised on load with their 1/norms
        b_knr = tl.load(k_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
    else:
        b_knr = b_beta  # unread
    b_dai = tl.zeros([BT, BT], dtype=tl.float32)  # gradient of Ainv
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgam = tl.zeros([BT], dtype=tl.float32)
    # u = Ainv diag(beta) V: dv, the beta part, dAinv += du (beta V)^T
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(v + off_v, mask=m_t[:, None], other=0.0)
        b_du = tl.load(dv2 + off_v, mask=m_t[:, None], other=0.0)
        b_dai = mma(b_du, tl.trans((b_v * b_beta[:, None]).to(DT)), b_dai)
        b_dvb = mm(b_atd, b_du)
        tl.store(dv + off_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty),
                 mask=m_t[:, None])
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), axis=1)
    # w = Ainv diag(beta exp(gamma)) K: the beta and gamma parts, dAinv += dw (beta e^gamma K)^T;
    # K K^T for the A parts
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None], other=0.0)
        if NORM:
            b_k = normalised(b_k, b_knr)
        b_dwb = tl.load(dw + ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :],
                        mask=m_t[:, None], other=0.0)
        b_dai = mma(b_dwb, tl.trans((b_k * b_bk[:, None]).to(DT)), b_dai)
        b_kk = mma(b_k, tl.trans(b_k), b_kk)
        b_rk = tl.sum(mm(b_atd, b_dwb) * b_k.to(tl.float32), axis=1)
        b_db += b_eg * b_rk
        b_dgam += b_bk * b_rk
    # through Ainv = (I + A)^-1: dA = -Ainv^T dAinv Ainv^T (strictly lower; operands in the
    # storage dtype, fp32 accumulation), then dM = dA * Gamma
    lower = o_i[:, None] > o_i[None, :]
    b_dm = mm(b_atd, mm(tl.where(lower, b_dai, 0.0).to(DT), b_atd).to(DT))
    b_decay = tl.exp(tl.where(lower, b_gam[:, None] - b_gam[None, :], 0.0))
    b_dm = tl.where(lower & m_t[:, None] & m_t[None, :], -b_dm * b_decay, 0.0)
    # A = strict_lower(diag(beta) K K^T * Gamma): beta and gamma parts from dA * A
    b_z = b_dm * b_kk
    b_db += tl.sum(b_z, axis=1)
    b_z = b_z * b_beta[:, None]
    b_dgam += tl.sum(b_z, axis=1) - tl.sum(b_z, axis=0)
    b_dmd = b_dm.to(DT)
    if H == HV:
        # one value head per key head: whole rows, dqkwg's part added, then (with the norm) the
        # l2norm backward dk_raw = rstd (dk - y (y . dk)), y = k_raw rstd; stored in k's dtype
        o_k = tl.arange(0, K)
        b_dk = _dk_block(k, dw, dk, o_t, m_t, o_k, i_b, i_h, i_hv, T, b_atd, b_dmd, b_beta,
                         b_bk, b_knr, H, HV, K, NORM, True)
        off_raw = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        if NORM:
            b_y = tl.load(k + off_raw, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_y = b_y * b_knr[:, None]
            b_dk = b_knr[:, None] * (b_dk - b_y * tl.sum(b_y * b_dk, axis=1)[:, None])
        tl.store(dk_out + off_raw, b_dk.to(dk_out.dtype.element_ty), mask=m_t[:, None])
    else:
        # this value head's parts alone, fp32, for the grouped norm backward (which adds
        # dqkwg's key-head rows): nothing read back
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            b_dk = _dk_block(k, dw, dk, o_t, m_t, o_k, i_b, i_h, i_hv, T, b_atd, b_dmd, b_beta,
                             b_bk, b_knr, H, HV, K, NORM, False)
            tl.store(dk_out + ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :], b_dk,
                     mask=m_t[:, None])
    off = (i_b * T + o_t) * HV + i_hv
    tl.store(dbeta + off, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    for s in range(SLOTS):
        b_dgam += tl.load(dg_part + s * B * T * HV + off, mask=m_t, other=0.0)
    # dg_i = sum_{j >= i} dgamma_j inside the chunk (gamma is the chunk-local cumsum of g);
    # 0 where the forward floored g (the floor's derivative; the true one is below fp32's
    # resolution there, common.py)
    b_dg = tl.sum(b_dgam, axis=0) - tl.cumsum(b_dgam, axis=0) + b_dgam
    b_dg = tl.where(gate_floored(tl.load(g + off, mask=m_t, other=0.0)), 0.0, b_dg)
    tl.store(dg + off, b_dg, mask=m_t)
