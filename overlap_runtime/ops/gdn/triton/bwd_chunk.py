"""Backward kernels that work on each chunk independently, once the state gradients are known.

With ``h`` the state entering the chunk, ``dH`` the gradient of the state leaving it,
``dv_new`` the full gradient of the residuals (from the reverse scan) and ``P = dO v_new^T``:

``dqkwg_kernel``, grid ``(K / BK, NT, B * HV)``::

    dq  = scale (diag(exp(gamma)) dO h^T + (P * Gamma) K)
    dk  = scale (P * Gamma)^T Q + diag(exp(gamma_C - gamma)) v_new dH^T
    dw  = -dv_new h^T
    dgamma (partial) = q . dq - k . dk  (+ the chunk-end terms on the last valid token)

``(P * Gamma)^T`` is formed by a second product ``v_new dO^T`` rather than transposing the
cast result of a product (the Hopper miscompile pattern of gpu/README.md).

``wy_bwd_kernel``, grid ``(NT, B * HV)``: through ``u = Ainv diag(beta) V``,
``w = Ainv diag(beta exp(gamma)) K``: ``dR = Ainv^T [du | dw]`` gives dv, the w part of dk,
dbeta and dgamma, and ``dA = -strict_lower(dR R^T Ainv^T)`` (written to memory, fp32).

``kkt_bwd_kernel``, grid ``(NT, B * HV)``: through ``A = strict_lower(diag(beta) K K^T * Gamma)``
(dA and its transpose both loaded from memory): adds the A part of dk, finishes dbeta, and
turns the summed dgamma into dg by a reverse cumsum inside the chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import autotune_configs, mm, mm_f32

__all__ = ["dqkwg_kernel", "wy_bwd_kernel", "kkt_bwd_kernel"]


@triton.autotune(configs=autotune_configs(), key=["K", "V"])
@triton.jit
def dqkwg_kernel(q, k, gamma, states, dhs, v_new, dv2, do, dq, dk, dw, dg_part, scale,
                 T, NT, B, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_kb, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, BT)
    t0 = i_n * BT
    o_t = t0 + o_i
    m_t = o_t < T
    o_k = i_kb * BK + tl.arange(0, BK)
    DT = k.dtype.element_ty
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
        off_vt = ((i_b * T + o_t[None, :]) * HV + i_hv) * V + o_v[:, None]
        b_vn = tl.load(v_new + off_v, mask=m_t[:, None], other=0.0)
        b_vnt = tl.load(v_new + off_vt, mask=m_t[None, :], other=0.0)
        b_do = tl.load(do + off_v, mask=m_t[:, None], other=0.0).to(DT)
        b_dot = tl.load(do + off_vt, mask=m_t[None, :], other=0.0).to(DT)
        b_dv = tl.load(dv2 + off_v, mask=m_t[:, None], other=0.0)
        b_ht = tl.load(states + base + o_k[None, :] * V + o_v[:, None])  # [BV, BK]
        b_dht = tl.load(dhs + base + o_k[None, :] * V + o_v[:, None])
        b_dq += mm(b_do, b_ht)
        b_p += mm(b_do, b_vnt)
        b_pt += mm(b_vn, b_dot)
        b_dkt += mm(b_vn, b_dht)
        b_dw += mm(b_dv, b_ht)
        b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
    b_q = tl.load(q + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
    last = tl.minimum(t0 + BT, T) - 1
    g_last = tl.load(gamma + (i_b * T + last) * HV + i_hv)
    causal = o_i[:, None] >= o_i[None, :]
    b_p = tl.where(causal, b_p * tl.exp(tl.where(causal, b_gam[:, None] - b_gam[None, :], 0.0)),
                   0.0) * scale
    later = o_i[None, :] >= o_i[:, None]
    b_pt = tl.where(later, b_pt * tl.exp(tl.where(later, b_gam[None, :] - b_gam[:, None], 0.0)),
                    0.0) * scale
    b_dq = b_dq * (scale * tl.exp(b_gam))[:, None] + mm(b_p.to(DT), b_k)
    b_dko = mm(b_pt.to(DT), b_q)
    b_dkt = b_dkt * tl.where(m_t, tl.exp(g_last - b_gam), 0.0)[:, None]
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    b_tail = tl.sum(b_kf * b_dkt, axis=1)
    b_dgam = tl.sum(b_qf * b_dq, axis=1) - tl.sum(b_kf * b_dko, axis=1) - b_tail
    end_term = tl.sum(b_tail, axis=0) + tl.exp(g_last) * tl.sum(b_hdh, axis=0)
    b_dgam += tl.where(o_t == last, end_term, 0.0)
    off_k = ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
    tl.store(dq + off_k, b_dq, mask=m_t[:, None])
    tl.store(dk + off_k, b_dko + b_dkt, mask=m_t[:, None])
    tl.store(dw + off_k, (-b_dw).to(dw.dtype.element_ty), mask=m_t[:, None])
    tl.store(dg_part + ((i_kb * B + i_b) * T + o_t) * HV + i_hv, b_dgam, mask=m_t)


@triton.autotune(configs=autotune_configs(), key=["K", "V"], restore_value=["dk"])
@triton.jit
def wy_bwd_kernel(k, v, beta, gamma, ainv, dv2, dw, dv, dk, da, db_part, dg_part, T, B,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SLOT: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i
    m_t = o_t < T
    DT = k.dtype.element_ty
    # Ainv^T, loaded transposed from memory
    b_at = tl.load(ainv + ((i_b * T + o_t[None, :]) * HV + i_hv) * BT + o_i[:, None],
                   mask=m_t[None, :], other=0.0)
    b_atd = b_at.to(DT)
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
    b_bk = b_beta * tl.exp(b_gam)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgam = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_du = tl.load(dv2 + off_v, mask=m_t[:, None], other=0.0)
        b_dr = mm(b_atd, b_du)
        b_v = tl.load(v + off_v, mask=m_t[:, None], other=0.0)
        b_vt = tl.load(v + ((i_b * T + o_t[None, :]) * HV + i_hv) * V + o_v[:, None],
                       mask=m_t[None, :], other=0.0)
        tl.store(dv + off_v, (b_dr * b_beta[:, None]).to(dv.dtype.element_ty),
                 mask=m_t[:, None])
        b_db += tl.sum(b_dr * b_v.to(tl.float32), axis=1)
        b_da += mm(b_dr.to(DT), (b_vt * b_beta[None, :]).to(DT))
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        off_k = ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
        b_dwb = tl.load(dw + off_k, mask=m_t[:, None], other=0.0)
        b_dr = mm(b_atd, b_dwb)
        b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None], other=0.0)
        b_kt = tl.load(k + ((i_b * T + o_t[None, :]) * H + i_h) * K + o_k[:, None],
                       mask=m_t[None, :], other=0.0)
        b_dkp = tl.load(dk + off_k, mask=m_t[:, None], other=0.0)
        tl.store(dk + off_k, b_dkp + b_dr * b_bk[:, None], mask=m_t[:, None])
        b_rk = tl.sum(b_dr * b_k.to(tl.float32), axis=1)
        b_db += tl.exp(b_gam) * b_rk
        b_dgam += b_bk * b_rk
        b_da += mm(b_dr.to(DT), (b_kt * b_bk[None, :]).to(DT))
    b_da = -mm_f32(b_da, b_at)
    b_da = tl.where(o_i[:, None] > o_i[None, :], b_da, 0.0)
    tl.store(da + ((i_b * T + o_t[:, None]) * HV + i_hv) * BT + o_i[None, :], b_da,
             mask=m_t[:, None])
    tl.store(db_part + (i_b * T + o_t) * HV + i_hv, b_db, mask=m_t)
    tl.store(dg_part + ((SLOT * B + i_b) * T + o_t) * HV + i_hv, b_dgam, mask=m_t)


@triton.autotune(configs=autotune_configs(), key=["K"], restore_value=["dk"])
@triton.jit
def kkt_bwd_kernel(k, beta, gamma, da, dk, db_part, dg_part, dbeta, dg, T, B,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   SLOTS: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, BT)
    o_t = i_n * BT + o_i
    m_t = o_t < T
    o_k = tl.arange(0, K)
    DT = k.dtype.element_ty
    b_da = tl.load(da + ((i_b * T + o_t[:, None]) * HV + i_hv) * BT + o_i[None, :],
                   mask=m_t[:, None], other=0.0)
    b_dat = tl.load(da + ((i_b * T + o_t[None, :]) * HV + i_hv) * BT + o_i[:, None],
                    mask=m_t[None, :], other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
    lower = o_i[:, None] > o_i[None, :]
    upper = o_i[None, :] > o_i[:, None]
    b_decay = tl.exp(tl.where(lower, b_gam[:, None] - b_gam[None, :], 0.0))
    b_decay_t = tl.exp(tl.where(upper, b_gam[None, :] - b_gam[:, None], 0.0))
    b_kk = mm(b_k, tl.trans(b_k))
    b_dam = tl.where(lower, b_da * b_decay * b_beta[:, None], 0.0)
    b_damt = tl.where(upper, b_dat * b_decay_t * b_beta[None, :], 0.0)
    b_dka = mm(b_dam.to(DT), b_k) + mm(b_damt.to(DT), b_k)
    b_z = tl.where(lower, b_da * b_decay * b_kk, 0.0)
    b_dba = tl.sum(b_z, axis=1)
    b_z = b_z * b_beta[:, None]
    b_dgam = tl.sum(b_z, axis=1) - tl.sum(b_z, axis=0)
    off_k = ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :]
    b_dk = tl.load(dk + off_k, mask=m_t[:, None], other=0.0)
    tl.store(dk + off_k, b_dk + b_dka, mask=m_t[:, None])
    off = (i_b * T + o_t) * HV + i_hv
    b_db = tl.load(db_part + off, mask=m_t, other=0.0) + b_dba
    tl.store(dbeta + off, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    for s in range(SLOTS):
        b_dgam += tl.load(dg_part + s * B * T * HV + off, mask=m_t, other=0.0)
    # dg_i = sum_{j >= i} dgamma_j inside the chunk (gamma is the chunk-local cumsum of g)
    b_dg = tl.sum(b_dgam, axis=0) - tl.cumsum(b_dgam, axis=0) + b_dgam
    tl.store(dg + off, b_dg, mask=m_t)
