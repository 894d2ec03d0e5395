"""Fused forward: two launches instead of the chain's five (l2norm x2, kkt_solve, wy_fwd, the
state scan, the output kernel); the state stays in registers across the chunks of a segment
and neither the per-chunk states nor v_new go to memory unless a backward needs them.

1. ``fused_prep_kernel``, grid ``(NT, B * HV)``, fully parallel over chunks: per chunk of
   ``BT = 64`` tokens it reads the raw k (l2-normalised in registers with ``NORM``), v, g and
   beta once and forms::

       gamma   = cumsum of the floored gates                 (kkt_solve's block-wise cumsum)
       A       = strict_lower(diag(beta) K K^T * Gamma)       in 16 x 16 blocks
       Ainv    = (I + A)^-1                                   diagonal blocks, then the blocks below
       w       = Ainv diag(beta e^gamma) K,  u = Ainv diag(beta) V

   It writes gamma (fp32), w and u (input dtype): the only per-token intermediates that go
   through memory. With ``SAVE`` also the fp32 Ainv and, with ``NORM``, the keys' fp32 1/norm
   (value head 0 of each key head).
2. ``fused_walk_kernel``, grid ``(column blocks, NS, B * HV)``: one program walks the chunks of
   one segment for ``BV`` columns of the state of one ``(sequence, value head)``; per chunk it
   reads w, u, gamma and the raw q, k (normalised in registers) and forms::

       v_new   = u - w h
       o       = scale (diag(e^gamma) Q h + (Q K^T * Gamma) v_new)       (output mode)
       h      <- e^gamma_C h + Ktail^T diag(e^(gamma_C - gamma)) v_new

   Two modes, as ``fwd_scan_kernel`` (fwd_state.py):

   * output mode (``SUMMARY=False``): columns are the V columns; starts from the segment's
     entering state (``HAS_INIT``) or zero; writes o for its columns and the state leaving the
     segment (fp32). With ``SAVE`` it also writes what the unfused backward reads
     (function.py): the per-chunk entering states and v_new of its columns and, with ``NORM``,
     the queries' fp32 1/norm (column block 0, value head 0 of each key head).
   * summary mode (``SUMMARY=True``): the walk of the augmented state ``[M | S]`` (``K + V``
     columns) from ``[I | 0]`` with u replaced by ``[0 | u]``: the segment's affine summary
     ``H_out = M H_in + S`` (fp32). Nothing per chunk is written.

Why two launches and not one: in a walk of one program per state block every operation inside
the chunk loop is on the critical path (Triton offers no warp specialisation here to overlap a
chunk's WY solve with the previous chunk's state update), and the WY solve's small 16 x 16
products, substitution steps and tile joins made a one-launch design's chunk step about 40x
longer than the state update itself (docs/benchmarks.md, "Fused forward"). Formed in a
parallel launch, they cost what ``kkt_solve`` + ``wy_fwd`` cost, without the Ainv round trip
through memory and without the separate l2norm launches; the walk's step is the chain scan's
plus the output products.

Small ``B * HV`` fills the machine by the segment split of function.py: summaries of all
segments in parallel (summary mode), the fp32 ``chain_kernel`` across them, then every segment's
output walk from its true entering state, in parallel.

The inverse of each 16 x 16 diagonal block is either the forward substitution of
``kkt_solve_kernel`` (``INV_DOUBLING=False``: 15 dependent row steps, exact fp32) or the
product ``(I - A)(I + A^2)(I + A^4)(I + A^8)`` (``INV_DOUBLING=True``: 6 dependent 3xTF32
products; A is nilpotent of order 16 within a block). The doubling form carries the size of
``A^8`` (at most ``C(15, 7) = 6435`` for sixteen equal keys with beta = 1, far less for distinct
keys) times the product's rounding into Ainv, which the products then round to the input dtype
anyway; both are checked against the float64 recurrence.

No product's cast result is transposed (Triton miscompiles that on Hopper): the only
transposes are of the normalised keys, built from loaded data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import CHUNK, GATE_FLOOR, chunk_span, gate_floor, mm, mm_f32x3, mma, segment_span
from .fwd_prepare import _kkt_block, _store_block, _store_gamma, _unit_lower_inverse
from .l2norm import L2NORM_EPS


@dataclass(frozen=True)
class FusedConfig:
    """Launch choices of the fused forward (results equal up to rounding across them).

    Attributes:
        inv_doubling: the diagonal-block inverse by the doubling product (else substitution).
        prep_warps, prep_stages: ``num_warps``, ``num_stages`` of the parallel WY launch.
        walk_warps, walk_stages / summary_warps, summary_stages: ``num_warps``,
            ``num_stages`` of the output walk / the summary launch.
        block: state columns per program (None: ``min(64, K, V)``).
        prenorm: with the l2 norm, the parallel launch writes the normalised q and k and the
            walk reads them (loads that feed the products straight from memory, fewer live
            registers in the walk); else the walk normalises the raw q, k in registers
            (less memory traffic: no normalised copy written).
    """

    inv_doubling: bool = False
    prep_warps: int = 4
    prep_stages: int = 1
    walk_warps: int = 4
    walk_stages: int = 2
    summary_warps: int = 4
    summary_stages: int = 2
    block: int | None = None
    prenorm: bool = True

    def columns(self, key_dim: int, value_dim: int) -> int:
        """State columns per program; raises naming the rule when they do not tile V."""
        block = min(64, key_dim, value_dim) if self.block is None else self.block
        if value_dim % block or key_dim % block:
            raise ValueError(f"FusedConfig.block={block} must divide K={key_dim} and "
                             f"V={value_dim}")
        return block


DEFAULT_CONFIG = FusedConfig()

_ = GATE_FLOOR  # the floor is applied by gate_floor (common.py)


@triton.jit
def _key_rows(k, g, beta, k_rstd, rstd_end, i_b, i_hv, i_h, row0, T, eos, H: tl.constexpr,
              HV: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
              STORE_RSTD: tl.constexpr, kn, WRITE_K: tl.constexpr):
    """Rows ``row0 .. row0 + 15``: keys ``[16, K]`` in the storage dtype (normalised with
    ``NORM``, by the arithmetic of ``l2norm_fwd_kernel``), g floored and beta ``[16]`` fp32;
    rows ``>= eos`` read as zeros. ``STORE_RSTD``: the keys' 1/norm of the rows
    ``< rstd_end`` are written (``rstd_end`` is 0 in the programs that write none), and with
    ``WRITE_K`` the normalised keys of those rows into ``kn``."""
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < eos
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + tl.arange(0, K)[None, :],
                  mask=m_t[:, None], other=0.0)
    if NORM:
        b_x = b_k.to(tl.float32)
        b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + EPS)
        b_k = (b_x * b_r[:, None]).to(k.dtype.element_ty)
        if STORE_RSTD:
            tl.store(k_rstd + (i_b * T + o_t) * H + i_h, b_r, mask=o_t < rstd_end)
    if WRITE_K:
        tl.store(kn + ((i_b * T + o_t[:, None]) * H + i_h) * K + tl.arange(0, K)[None, :], b_k,
                 mask=(o_t < rstd_end)[:, None])
    b_g = gate_floor(tl.load(g + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32))
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    return b_k, b_g, b_beta


@triton.jit
def _doubling_inverse(a):
    """``(I + a)^-1 = (I - a)(I + a^2)(I + a^4)(I + a^8)`` of a strictly lower ``[16, 16]``
    fp32 block (``a^16 = 0``), by 3xTF32 products."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    a2 = mm_f32x3(a, a)
    p = mm_f32x3(eye - a, eye + a2)
    a4 = mm_f32x3(a2, a2)
    p = mm_f32x3(p, eye + a4)
    a8 = mm_f32x3(a4, a4)
    return mm_f32x3(p, eye + a8)


@triton.jit
def _diag_inverse(a, INV_DOUBLING: tl.constexpr):
    if INV_DOUBLING:
        return _doubling_inverse(a)
    else:
        return _unit_lower_inverse(a)


@triton.jit
def _cat_rows(a, b):
    """``[a; b]``: two ``[R, N]`` tiles stacked into ``[2R, N]`` (on chip)."""
    j = tl.join(a, b)  # [R, N, 2]
    j = tl.permute(j, (2, 0, 1))  # [2, R, N]
    return tl.reshape(j, (2 * a.shape[0], a.shape[1]))


@triton.jit
def _cat_cols(a, b):
    """``[a, b]``: two ``[R, N]`` tiles side by side, ``[R, 2N]``."""
    j = tl.join(a, b)  # [R, N, 2]
    j = tl.permute(j, (0, 2, 1))  # [R, 2, N]
    return tl.reshape(j, (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _cat_vec(a, b):
    """``[a, b]`` of two ``[R]`` vectors."""
    j = tl.permute(tl.join(a, b), (1, 0))  # [2, R]
    return tl.reshape(j, (2 * a.shape[0],))


@triton.jit
def _cat4_rows(a0, a1, a2, a3):
    return _cat_rows(_cat_rows(a0, a1), _cat_rows(a2, a3))


@triton.jit
def _cat4_cols(a0, a1, a2, a3):
    return _cat_cols(_cat_cols(a0, a1), _cat_cols(a2, a3))


@triton.jit
def _cat4_vec(a0, a1, a2, a3):
    return _cat_vec(_cat_vec(a0, a1), _cat_vec(a2, a3))


@triton.jit
def fused_prep_kernel(q, k, v, g, beta, gamma, w, u, ainv, q_rstd, k_rstd, qn, kn, chunks, T,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, NORM: tl.constexpr, SAVE: tl.constexpr,
                      INV_DOUBLING: tl.constexpr, VARLEN: tl.constexpr, EPS: tl.constexpr,
                      STORE_RSTD: tl.constexpr, WRITE_QK: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    DT = k.dtype.element_ty
    # the keys' 1/norm once per key head (value head 0 of its group)
    rstd_end = tl.where(i_hv % (HV // H) == 0, eos, 0)
    if WRITE_QK:
        # the normalised q for the walk, once per key head (rows < rstd_end), first: it is
        # dead before the chunk's WY work starts
        b_q = _normed_rows(q, q_rstd, o_t, m_t, i_b, i_h, T, H, K, NORM, EPS, STORE_RSTD,
                           rstd_end)
        tl.store(qn + ((i_b * T + o_t[:, None]) * H + i_h) * K + tl.arange(0, K)[None, :],
                 b_q, mask=(o_t < rstd_end)[:, None])
    k0, g0, b0 = _key_rows(k, g, beta, k_rstd, rstd_end, i_b, i_hv, i_h, t0, T,
                           eos, H, HV, K, NORM, EPS, STORE_RSTD, kn, WRITE_QK)
    k1, g1, b1 = _key_rows(k, g, beta, k_rstd, rstd_end, i_b, i_hv, i_h, t0 + 16, T,
                           eos, H, HV, K, NORM, EPS, STORE_RSTD, kn, WRITE_QK)
    k2, g2, b2 = _key_rows(k, g, beta, k_rstd, rstd_end, i_b, i_hv, i_h, t0 + 32, T,
                           eos, H, HV, K, NORM, EPS, STORE_RSTD, kn, WRITE_QK)
    k3, g3, b3 = _key_rows(k, g, beta, k_rstd, rstd_end, i_b, i_hv, i_h, t0 + 48, T,
                           eos, H, HV, K, NORM, EPS, STORE_RSTD, kn, WRITE_QK)
    s0, s1, s2 = tl.sum(g0, axis=0), tl.sum(g1, axis=0), tl.sum(g2, axis=0)
    c0 = tl.cumsum(g0, axis=0)
    c1 = tl.cumsum(g1, axis=0) + s0
    c2 = tl.cumsum(g2, axis=0) + (s0 + s1)
    c3 = tl.cumsum(g3, axis=0) + (s0 + s1 + s2)
    _store_gamma(gamma, c0, i_b, i_hv, t0, T, eos, HV)
    _store_gamma(gamma, c1, i_b, i_hv, t0 + 16, T, eos, HV)
    _store_gamma(gamma, c2, i_b, i_hv, t0 + 32, T, eos, HV)
    _store_gamma(gamma, c3, i_b, i_hv, t0 + 48, T, eos, HV)
    a00 = _kkt_block(k0, k0, c0, c0, b0, True)
    a11 = _kkt_block(k1, k1, c1, c1, b1, True)
    a22 = _kkt_block(k2, k2, c2, c2, b2, True)
    a33 = _kkt_block(k3, k3, c3, c3, b3, True)
    a10 = _kkt_block(k1, k0, c1, c0, b1, False)
    a20 = _kkt_block(k2, k0, c2, c0, b2, False)
    a21 = _kkt_block(k2, k1, c2, c1, b2, False)
    a30 = _kkt_block(k3, k0, c3, c0, b3, False)
    a31 = _kkt_block(k3, k1, c3, c1, b3, False)
    a32 = _kkt_block(k3, k2, c3, c2, b3, False)
    t00 = _diag_inverse(a00, INV_DOUBLING)
    t11 = _diag_inverse(a11, INV_DOUBLING)
    t22 = _diag_inverse(a22, INV_DOUBLING)
    t33 = _diag_inverse(a33, INV_DOUBLING)
    t10 = -mm_f32x3(t11, mm_f32x3(a10, t00))
    t21 = -mm_f32x3(t22, mm_f32x3(a21, t11))
    t32 = -mm_f32x3(t33, mm_f32x3(a32, t22))
    t20 = -mm_f32x3(t22, mm_f32x3(a20, t00) + mm_f32x3(a21, t10))
    t31 = -mm_f32x3(t33, mm_f32x3(a31, t11) + mm_f32x3(a32, t21))
    t30 = -mm_f32x3(t33, mm_f32x3(a30, t00) + mm_f32x3(a31, t10) + mm_f32x3(a32, t20))
    zero = tl.zeros([16, 16], dtype=tl.float32)
    if SAVE:
        _store_block(ainv, t00, i_b, i_hv, t0, 0, T, eos, HV, BT)
        _store_block(ainv, zero, i_b, i_hv, t0, 16, T, eos, HV, BT)
        _store_block(ainv, zero, i_b, i_hv, t0, 32, T, eos, HV, BT)
        _store_block(ainv, zero, i_b, i_hv, t0, 48, T, eos, HV, BT)
        _store_block(ainv, t10, i_b, i_hv, t0 + 16, 0, T, eos, HV, BT)
        _store_block(ainv, t11, i_b, i_hv, t0 + 16, 16, T, eos, HV, BT)
        _store_block(ainv, zero, i_b, i_hv, t0 + 16, 32, T, eos, HV, BT)
        _store_block(ainv, zero, i_b, i_hv, t0 + 16, 48, T, eos, HV, BT)
        _store_block(ainv, t20, i_b, i_hv, t0 + 32, 0, T, eos, HV, BT)
        _store_block(ainv, t21, i_b, i_hv, t0 + 32, 16, T, eos, HV, BT)
        _store_block(ainv, t22, i_b, i_hv, t0 + 32, 32, T, eos, HV, BT)
        _store_block(ainv, zero, i_b, i_hv, t0 + 32, 48, T, eos, HV, BT)
        _store_block(ainv, t30, i_b, i_hv, t0 + 48, 0, T, eos, HV, BT)
        _store_block(ainv, t31, i_b, i_hv, t0 + 48, 16, T, eos, HV, BT)
        _store_block(ainv, t32, i_b, i_hv, t0 + 48, 32, T, eos, HV, BT)
        _store_block(ainv, t33, i_b, i_hv, t0 + 48, 48, T, eos, HV, BT)
    zdt = zero.to(DT)
    b_a = _cat4_rows(_cat4_cols(t00.to(DT), zdt, zdt, zdt),
                     _cat4_cols(t10.to(DT), t11.to(DT), zdt, zdt),
                     _cat4_cols(t20.to(DT), t21.to(DT), t22.to(DT), zdt),
                     _cat4_cols(t30.to(DT), t31.to(DT), t32.to(DT), t33.to(DT)))
    b_k = _cat4_rows(k0, k1, k2, k3)  # [BT, K], normalised
    b_gam = _cat4_vec(c0, c1, c2, c3)
    b_beta = _cat4_vec(b0, b1, b2, b3)
    o_k = tl.arange(0, K)
    b_w = mm(b_a, (b_k * (b_beta * tl.exp(b_gam))[:, None]).to(DT))
    tl.store(w + ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :],
             b_w.to(w.dtype.element_ty), mask=m_t[:, None])
    off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + tl.arange(0, V)[None, :]
    b_v = tl.load(v + off_v, mask=m_t[:, None], other=0.0)
    b_u = mm(b_a, (b_v * b_beta[:, None]).to(b_v.dtype))
    tl.store(u + off_v, b_u.to(u.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _normed_rows(x, rstd, o_t, m_t, i_b, i_h, T, H: tl.constexpr, K: tl.constexpr,
                 NORM: tl.constexpr, EPS: tl.constexpr, STORE_RSTD: tl.constexpr, rstd_end):
    """Rows ``o_t`` of a ``[B, T, H, K]`` tensor for key head ``i_h``, l2-normalised with
    ``NORM`` (the arithmetic of ``l2norm_fwd_kernel``); rows masked off read as zeros. With
    ``STORE_RSTD`` the fp32 1/norm of the rows ``< rstd_end`` is written."""
    b_x = tl.load(x + ((i_b * T + o_t[:, None]) * H + i_h) * K + tl.arange(0, K)[None, :],
                  mask=m_t[:, None], other=0.0)
    if NORM:
        b_f = b_x.to(tl.float32)
        b_r = 1.0 / tl.sqrt(tl.sum(b_f * b_f, axis=1) + EPS)
        b_x = (b_f * b_r[:, None]).to(x.dtype.element_ty)
        if STORE_RSTD:
            tl.store(rstd + (i_b * T + o_t) * H + i_h, b_r, mask=o_t < rstd_end)
    return b_x


@triton.jit
def fused_walk_kernel(q, k, w, u, gamma, h_init, o, h_end, m_sum, s_sum, states, v_new,
                      q_rstd, chunks, segs, scale, T, NT, L, NS, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr, SUMMARY: tl.constexpr, HAS_INIT: tl.constexpr,
                      NORM: tl.constexpr, SAVE: tl.constexpr, VARLEN: tl.constexpr,
                      EPS: tl.constexpr, STORE_RSTD: tl.constexpr):
    i_c, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    n0, n1, row = segment_span(segs, i_s, i_bh, i_hv, L, NT, NS, HV, VARLEN)
    o_k = tl.arange(0, K)
    o_c = tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    DT = k.dtype.element_ty
    # the queries' 1/norm once per key head (column block 0, value head 0 of its group)
    rstd_here = (i_c == 0) & (i_hv % (HV // H) == 0)
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
        o_t = t0 + o_i
        m_t = o_t < eos
        # padded rows (t >= eos) take the last token's gamma: no exponent is positive
        b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
        g_last = tl.load(gamma + (i_b * T + tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        b_k = _normed_rows(k, q_rstd, o_t, m_t, i_b, i_h, T, H, K, NORM, EPS, False, 0)
        b_hd = b_h.to(DT)
        if SAVE:
            base = ((i_b * NT + n) * HV + i_hv).to(tl.int64) * (K * V)
            tl.store(states + base + o_k[:, None] * V + col_v[None, :], b_hd)
        # the query side first (q is dead before w is loaded: fewer live registers)
        if not SUMMARY:
            b_q = _normed_rows(q, q_rstd, o_t, m_t, i_b, i_h, T, H, K, NORM, EPS, STORE_RSTD,
                               tl.where(rstd_here, eos, 0))
            causal = o_i[:, None] >= o_i[None, :]
            b_s = mm(b_q, tl.trans(b_k))
            b_s = tl.where(causal,
                           b_s * tl.exp(tl.where(causal, b_gam[:, None] - b_gam[None, :], 0.0)),
                           0.0).to(DT)
            b_o = mm(b_q, b_hd) * tl.exp(b_gam)[:, None]
        b_w = tl.load(w + ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :],
                      mask=m_t[:, None], other=0.0)
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + col_v[None, :]
        b_u = tl.load(u + off_v, mask=m_t[:, None] & u_mask[None, :], other=0.0)
        b_vn = b_u.to(tl.float32) - mm(b_w, b_hd)
        b_vnd = b_vn.to(DT)
        if SAVE:
            tl.store(v_new + off_v, b_vnd, mask=m_t[:, None])
        if not SUMMARY:
            b_o = (b_o + mm(b_s, b_vnd)) * scale
            tl.store(o + off_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None])
        b_vs = b_vn * tl.where(m_t, tl.exp(g_last - b_gam), 0.0)[:, None]
        b_h = mma(tl.trans(b_k), b_vs.to(DT), b_h * tl.exp(g_last))
    if SUMMARY:
        tl.store(m_sum + (row * K + o_k[:, None]) * K + col_m[None, :], b_h,
                 mask=(o_k[:, None] < K) & is_m[None, :])
        tl.store(s_sum + (row * K + o_k[:, None]) * V + col_v[None, :], b_h,
                 mask=(o_k[:, None] < K) & u_mask[None, :])
    else:
        tl.store(h_end + (row * K + o_k[:, None]) * V + col_v[None, :], b_h)


def fused_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, use_qk_l2norm: bool, num_chunks: int,
                  chunks: torch.Tensor | None, save: bool, config: FusedConfig = DEFAULT_CONFIG
                  ) -> dict[str, torch.Tensor | None]:
    """The parallel launch: ``{"gamma" [B, T, HV] fp32, "w" [B, T, HV, K] in k's dtype,
    "u" [B, T, HV, V] in v's dtype}``; with ``save`` ``"ainv" [B, T, HV, 64] fp32`` and
    ``"k_rstd"``, ``"q_rstd" [B, T, H] fp32`` (None without the norm); with
    ``config.prenorm`` and the norm, ``"qn"``, ``"kn"`` (the normalised q, k in their dtype,
    which the walk then reads instead of normalising); entries not formed are None.

    q, k ``[B, T, H, K]`` raw (normalised in the kernel with ``use_qk_l2norm``), v
    ``[B, T, HV, V]``, g, beta ``[B, T, HV]``; ``chunks`` the varlen chunk table or None."""
    batch, seq_len, heads, key_dim = k.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    f32 = dict(device=k.device, dtype=torch.float32)
    write_qk = config.prenorm and use_qk_l2norm
    rstd = save and use_qk_l2norm
    out: dict[str, torch.Tensor | None] = {
        "gamma": torch.empty(batch, seq_len, num_value_heads, **f32),
        "w": torch.empty(batch, seq_len, num_value_heads, key_dim, device=k.device,
                         dtype=k.dtype),
        "u": torch.empty_like(v),
        "ainv": torch.empty(batch, seq_len, num_value_heads, CHUNK, **f32) if save else None,
        "k_rstd": torch.empty(batch, seq_len, heads, **f32) if rstd else None,
        # q's 1/norm comes from here when q is normalised here, else from the walk
        "q_rstd": torch.empty(batch, seq_len, heads, **f32) if rstd and write_qk else None,
        "qn": torch.empty_like(q) if write_qk else None,
        "kn": torch.empty_like(k) if write_qk else None,
    }
    dummy = out["gamma"]

    def get(name: str) -> torch.Tensor:
        x = out[name]
        return dummy if x is None else x

    fused_prep_kernel[(num_chunks, batch * num_value_heads)](
        q, k, v, g, beta, out["gamma"], out["w"], out["u"], get("ainv"), get("q_rstd"),
        get("k_rstd"), get("qn"), get("kn"), dummy if chunks is None else chunks, seq_len,
        H=heads, HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK, NORM=use_qk_l2norm,
        SAVE=save, INV_DOUBLING=config.inv_doubling, VARLEN=chunks is not None, EPS=L2NORM_EPS,
        STORE_RSTD=rstd, WRITE_QK=write_qk, num_warps=config.prep_warps,
        num_stages=config.prep_stages,
    )
    return out


def _launch(grid, q, k, prep: dict, outs: dict, tables, scale: float, num_chunks: int,
            per_segment: int, num_segments: int, block: int, summary: bool, norm: bool,
            save: bool, num_warps: int, num_stages: int, value_dim: int):
    batch, seq_len, heads, key_dim = q.shape
    num_value_heads = prep["u"].shape[2]
    dummy = outs["dummy"]

    def get(name: str) -> torch.Tensor:
        x = outs.get(name)
        return dummy if x is None else x

    chunks, segs = tables
    if prep["qn"] is not None:  # normalised by the parallel launch
        q, k, norm = prep["qn"], prep["kn"], False
    fused_walk_kernel[grid](
        q, k, prep["w"], prep["u"], prep["gamma"], get("h_init"), get("o"), get("h_end"),
        get("m"), get("s"), get("states"), get("v_new"), get("q_rstd"),
        dummy if chunks is None else chunks, dummy if segs is None else segs,
        scale, seq_len, num_chunks, per_segment, num_segments, H=heads, HV=num_value_heads,
        K=key_dim, V=value_dim, BT=CHUNK, BV=block, SUMMARY=summary,
        HAS_INIT=outs.get("h_init") is not None, NORM=norm, SAVE=save,
        VARLEN=chunks is not None, EPS=L2NORM_EPS, STORE_RSTD=save and norm and not summary,
        num_warps=num_warps, num_stages=num_stages,
    )


def fused_summaries(q: torch.Tensor, k: torch.Tensor, prep: dict[str, torch.Tensor | None],
                    use_qk_l2norm: bool, num_segments: int, per_segment: int, num_chunks: int,
                    rows: tuple[int, int],
                    tables: tuple[torch.Tensor | None, torch.Tensor | None],
                    config: FusedConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary ``(M [*rows, K, K], S [*rows, K, V])`` fp32 of every segment from zero,
    all in parallel (summary mode of :func:`fused_walk_kernel`), from the raw k and
    :func:`fused_prepare`'s ``prep``.

    ``rows``: ``(B * HV, NS)`` dense, ``(NS, HV)`` with varlen ``tables`` (chunk table,
    segment table; ``(None, None)`` dense)."""
    batch, seq_len, heads, key_dim = q.shape
    num_value_heads, value_dim = prep["u"].shape[2], prep["u"].shape[3]
    m = torch.empty(*rows, key_dim, key_dim, device=q.device, dtype=torch.float32)
    s = torch.empty(*rows, key_dim, value_dim, device=q.device, dtype=torch.float32)
    block = config.columns(key_dim, value_dim)
    grid = ((key_dim + value_dim) // block, num_segments, batch * num_value_heads)
    _launch(grid, q, k, prep, {"dummy": m, "m": m, "s": s}, tables, 1.0, num_chunks,
            per_segment, num_segments, block, True, use_qk_l2norm, False,
            config.summary_warps, config.summary_stages, value_dim)
    return m, s


def fused_walk(q: torch.Tensor, k: torch.Tensor, prep: dict[str, torch.Tensor | None],
               seg_init: torch.Tensor | None, scale: float, use_qk_l2norm: bool,
               num_segments: int, per_segment: int, num_chunks: int, rows: tuple[int, int],
               tables: tuple[torch.Tensor | None, torch.Tensor | None], save: bool,
               config: FusedConfig = DEFAULT_CONFIG) -> dict[str, torch.Tensor | None]:
    """Every segment's output walk from its entering state (output mode), from the raw q, k
    and :func:`fused_prepare`'s ``prep``.

    Args:
        seg_init: ``[*rows, K, V]`` fp32 state entering each segment, or None (zeros).
        save: also write the tensors the unfused backward reads (module docstring).

    Returns:
        ``{"o" in u's dtype, "h_end" [*rows, K, V] fp32}`` and with ``save`` ``"states"
        [B, NT, HV, K, V]`` (k's dtype), ``"v_new"``, ``"q_rstd" [B, T, H]`` fp32 (None
        without the norm).
    """
    batch, seq_len, heads, key_dim = q.shape
    u = prep["u"]
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    dev = q.device
    out: dict[str, torch.Tensor | None] = {
        "o": torch.empty_like(u),
        "h_end": torch.empty(*rows, key_dim, value_dim, device=dev, dtype=torch.float32),
    }
    if save:
        out["states"] = torch.empty(batch, num_chunks, num_value_heads, key_dim, value_dim,
                                    device=dev, dtype=k.dtype)
        out["v_new"] = torch.empty_like(u)
        out["q_rstd"] = prep["q_rstd"]
        if use_qk_l2norm and prep["qn"] is None:
            out["q_rstd"] = torch.empty(batch, seq_len, heads, device=dev, dtype=torch.float32)
    block = config.columns(key_dim, value_dim)
    grid = (value_dim // block, num_segments, batch * num_value_heads)
    _launch(grid, q, k, prep, {"dummy": out["h_end"], "h_init": seg_init, **out}, tables,
            scale, num_chunks, per_segment, num_segments, block, False, use_qk_l2norm, save,
            config.walk_warps, config.walk_stages, value_dim)
    return out
