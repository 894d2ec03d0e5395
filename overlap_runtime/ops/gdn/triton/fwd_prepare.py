"""Forward preparation kernels: gate cumsum, decayed KKT, triangular inverse, WY factors.

Per chunk of ``BT = 64`` tokens (``gamma`` the gate cumsum inside the chunk)::

    A = strict_lower(diag(beta) (K K^T) * exp(gamma_i - gamma_j))         [BT, BT]
    Ainv = (I + A)^-1                                                     unit lower triangular
    u = Ainv diag(beta) V,   w = Ainv diag(beta exp(gamma)) K             the WY factors

Gates are raised to ``-GATE_FLOOR`` (-20) where lower before the fp32 cumsum (common.py): -inf
(a reset) and -1e38 become finite, and the cumsum stays small enough that the differences
``gamma_i - gamma_j`` every kernel forms keep fp32 accuracy (docs/gdn.md, "Extreme gates").

``kkt_solve_kernel`` (grid ``(NT, B * HV)``) writes gamma and Ainv; it builds A in 16 x 16
blocks, inverts the four diagonal blocks by forward substitution (row by row, in registers)
and the six blocks below them by block forward substitution
``Ainv_ij = -Ainv_ii sum_{j <= m < i} A_im Ainv_mj``, all in fp32 (block products in 3xTF32 on
NVIDIA: ``ieee`` fp32 products run on the CUDA cores, not the tensor cores), stored once in
k's dtype (the operand dtype of every product that reads it).
``wy_fwd_kernel`` (grid ``(NT, B * HV)``) forms u and w from Ainv with tensor-core products;
with ``W_ONLY`` it forms w alone, the same operations in the same order (bitwise the forward's
w): the backward's recomputation of w (``recompute_w``, function.py).

The fused forward's prep (launch.py ``prepare_fused``) runs both kernels on the raw q, k:
with ``NORM`` ``kkt_solve_kernel`` forms the keys' 1/norms ``rk`` (l2norm.py's formula) and
both kernels normalise the tiles they load (common.normalised: the l2 norm kernel's own
operations, so gamma, Ainv, w and u are the chain's bits); with ``QN`` ``wy_fwd_kernel`` also
forms the queries' 1/norms in its one pass over q. No normalised copy of q or k is written.
With ``VARLEN`` chunk ``i_n`` is the chunk table's (common.chunk_span): it starts anywhere and
its rows end at its sequence's end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (CHUNK, autotune_configs, chunk_span, gate_floor, mm, mm_f32x3, mma,
                     normalised)
from .l2norm import L2NORM_EPS


@triton.jit
def _load_rows(k, g, beta, i_b, i_hv, i_h, row0, T, eos, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr):
    """Rows ``row0 .. row0 + 15``: keys ``[16, K]`` (storage dtype), g (floored, common.py)
    and beta ``[16]`` fp32; rows ``>= eos`` read as zeros."""
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < eos
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + tl.arange(0, K)[None, :],
                  mask=m_t[:, None], other=0.0)
    b_g = gate_floor(tl.load(g + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32))
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    return b_k, b_g, b_beta


@triton.jit
def _kkt_block(k_i, k_j, gam_i, gam_j, beta_i, DIAG: tl.constexpr):
    """Block (i, j) of ``A``; on the diagonal only the strictly lower part (exponent masked)."""
    s = mm(k_i, tl.trans(k_j))
    if DIAG:
        o = tl.arange(0, 16)
        low = o[:, None] > o[None, :]
        gap = tl.where(low, gam_i[:, None] - gam_j[None, :], 0.0)
        return tl.where(low, s * tl.exp(gap) * beta_i[:, None], 0.0)
    else:
        return s * tl.exp(gam_i[:, None] - gam_j[None, :]) * beta_i[:, None]


@triton.jit
def _row_rstd(x, EPS: tl.constexpr):
    """``1 / sqrt(sum x^2 + EPS)`` per row of ``x`` (fp32), the l2 norm's (l2norm.py)."""
    xf = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) + EPS)


@triton.jit
def _store_rstd(k_rstd, r, i_b, i_h, row0, T, eos, H: tl.constexpr):
    o_t = row0 + tl.arange(0, 16)
    tl.store(k_rstd + (i_b * T + o_t) * H + i_h, r, mask=o_t < eos)


@triton.jit
def _unit_lower_inverse4(a0, a1, a2, a3):
    """``(I + a)^-1`` of four strictly lower ``[16, 16]`` fp32 blocks, by forward substitution:
    row r of an inverse is ``e_r - sum_{c < r} a_rc inv_c``, rows taken in order. One loop
    updates row r of all four blocks (independent chains: their latencies overlap instead of
    running one block after the other)."""
    o = tl.arange(0, 16)
    o_row = o[:, None]
    eye = tl.where(o_row == o[None, :], 1.0, 0.0)
    inv0, inv1, inv2, inv3 = eye, eye, eye, eye
    for r in range(1, 16):
        at_r = o_row == r
        e_r = tl.where(o == r, 1.0, 0.0)
        r0 = e_r - tl.sum(tl.sum(tl.where(at_r, a0, 0.0), axis=0)[:, None] * inv0, axis=0)
        r1 = e_r - tl.sum(tl.sum(tl.where(at_r, a1, 0.0), axis=0)[:, None] * inv1, axis=0)
        r2 = e_r - tl.sum(tl.sum(tl.where(at_r, a2, 0.0), axis=0)[:, None] * inv2, axis=0)
        r3 = e_r - tl.sum(tl.sum(tl.where(at_r, a3, 0.0), axis=0)[:, None] * inv3, axis=0)
        inv0 = tl.where(at_r, r0[None, :], inv0)
        inv1 = tl.where(at_r, r1[None, :], inv1)
        inv2 = tl.where(at_r, r2[None, :], inv2)
        inv3 = tl.where(at_r, r3[None, :], inv3)
    return inv0, inv1, inv2, inv3


@triton.jit
def _store_row(ainv, b0, b1, b2, b3, i_b, i_hv, row0, T, eos, HV: tl.constexpr,
               BT: tl.constexpr):
    """Rows ``row0 .. row0 + 15`` of ``ainv``: the ``[16, 16]`` blocks ``b0 .. b3`` at columns
    0, 16, 32, 48 (rows ``>= eos`` are not stored); the pointers and the mask are computed once
    for the four stores."""
    o_t = row0 + tl.arange(0, 16)
    p = ainv + ((i_b * T + o_t[:, None]) * HV + i_hv) * BT + tl.arange(0, 16)[None, :]
    m = (o_t < eos)[:, None]
    tl.store(p, b0, mask=m)
    tl.store(p + 16, b1, mask=m)
    tl.store(p + 32, b2, mask=m)
    tl.store(p + 48, b3, mask=m)


@triton.jit
def _store_gamma(gamma, c, i_b, i_hv, row0, T, eos, HV: tl.constexpr):
    o_t = row0 + tl.arange(0, 16)
    tl.store(gamma + (i_b * T + o_t) * HV + i_hv, c, mask=o_t < eos)


@triton.autotune(configs=autotune_configs(((4, 1), (1, 1), (2, 1), (2, 2))),
                 key=["K", "VARLEN", "NORM"])
@triton.jit
def kkt_solve_kernel(k, g, beta, gamma, ainv, k_rstd, chunks, T, H: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr,
                     NORM: tl.constexpr, EPS: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    k0, g0, b0 = _load_rows(k, g, beta, i_b, i_hv, i_h, t0, T, eos, H, HV, K)
    k1, g1, b1 = _load_rows(k, g, beta, i_b, i_hv, i_h, t0 + 16, T, eos, H, HV, K)
    k2, g2, b2 = _load_rows(k, g, beta, i_b, i_hv, i_h, t0 + 32, T, eos, H, HV, K)
    k3, g3, b3 = _load_rows(k, g, beta, i_b, i_hv, i_h, t0 + 48, T, eos, H, HV, K)
    if NORM:  # raw keys: their 1/norms (stored once per key head), then the normalised keys
        r0, r1, r2, r3 = (_row_rstd(k0, EPS), _row_rstd(k1, EPS), _row_rstd(k2, EPS),
                          _row_rstd(k3, EPS))
        if i_hv % (HV // H) == 0:
            _store_rstd(k_rstd, r0, i_b, i_h, t0, T, eos, H)
            _store_rstd(k_rstd, r1, i_b, i_h, t0 + 16, T, eos, H)
            _store_rstd(k_rstd, r2, i_b, i_h, t0 + 32, T, eos, H)
            _store_rstd(k_rstd, r3, i_b, i_h, t0 + 48, T, eos, H)
        k0, k1, k2, k3 = (normalised(k0, r0), normalised(k1, r1), normalised(k2, r2),
                          normalised(k3, r3))
    # chunk-local cumsum of the (floored) gate, block by block; the offsets of the earlier
    # blocks are summed as scalars and added once (one rounding per token, shared by a block)
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

    t00, t11, t22, t33 = _unit_lower_inverse4(a00, a11, a22, a33)
    t10 = -mm_f32x3(t11, mm_f32x3(a10, t00))
    t21 = -mm_f32x3(t22, mm_f32x3(a21, t11))
    t32 = -mm_f32x3(t33, mm_f32x3(a32, t22))
    t20 = -mm_f32x3(t22, mm_f32x3(a20, t00) + mm_f32x3(a21, t10))
    t31 = -mm_f32x3(t33, mm_f32x3(a31, t11) + mm_f32x3(a32, t21))
    t30 = -mm_f32x3(t33, mm_f32x3(a30, t00) + mm_f32x3(a31, t10) + mm_f32x3(a32, t20))

    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_row(ainv, t00, zero, zero, zero, i_b, i_hv, t0, T, eos, HV, BT)
    _store_row(ainv, t10, t11, zero, zero, i_b, i_hv, t0 + 16, T, eos, HV, BT)
    _store_row(ainv, t20, t21, t22, zero, i_b, i_hv, t0 + 32, T, eos, HV, BT)
    _store_row(ainv, t30, t31, t32, t33, i_b, i_hv, t0 + 48, T, eos, HV, BT)


@triton.autotune(configs=autotune_configs(),
                 key=["K", "V", "VARLEN", "W_ONLY", "NORM", "QN"])
@triton.jit
def wy_fwd_kernel(k, v, beta, gamma, ainv, w, u, q, k_rstd, q_rstd, chunks, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
                  W_ONLY: tl.constexpr, NORM: tl.constexpr, QN: tl.constexpr,
                  EPS: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    b_a = tl.load(ainv + ((i_b * T + o_t[:, None]) * HV + i_hv) * BT + tl.arange(0, BT)[None, :],
                  mask=m_t[:, None], other=0.0).to(k.dtype.element_ty)
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
    if not W_ONLY:
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            off = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
            b_v = tl.load(v + off, mask=m_t[:, None], other=0.0)
            b_u = mm(b_a, (b_v * b_beta[:, None]).to(b_v.dtype))
            tl.store(u + off, b_u.to(u.dtype.element_ty), mask=m_t[:, None])
    b_kscale = b_beta * tl.exp(b_gam)
    if NORM:  # raw keys: normalised on load
        b_rk = tl.load(k_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
    if QN:  # the queries' 1/norms, summed in the loop below (q read once)
        b_sq = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        off_k = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        b_k = tl.load(k + off_k, mask=m_t[:, None], other=0.0)
        if NORM:
            b_k = normalised(b_k, b_rk)
        b_w = mm(b_a, (b_k * b_kscale[:, None]).to(b_k.dtype))
        tl.store(w + ((i_b * T + o_t[:, None]) * HV + i_hv) * K + o_k[None, :],
                 b_w.to(w.dtype.element_ty), mask=m_t[:, None])
        if QN:
            b_qf = tl.load(q + off_k, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_sq += tl.sum(b_qf * b_qf, axis=1)
    if QN:
        if i_hv % (HV // H) == 0:
            tl.store(q_rstd + (i_b * T + o_t) * H + i_h, 1.0 / tl.sqrt(b_sq + EPS), mask=m_t)


def kkt_solve(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, num_value_heads: int,
              chunks: torch.Tensor | None = None, norm: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gate cumsum and WY inverse.

    Args:
        k: ``[B, T, H, K]`` keys, bf16/fp16/fp32: normalised already (or used as they are)
            unless ``norm``.
        g: ``[B, T, HV]`` fp32 log decay (any value <= 0, -inf included); beta: ``[B, T, HV]``.
        chunks: the varlen chunk table ``[NT, 2]`` int32 (varlen.py; B = 1), or None (dense
            chunks of 64 from token 0).
        norm: k is raw: the kernel forms the keys' 1/norms and normalises its tiles itself
            (the same bits as ``l2norm_forward``'s copy), which is not written.

    Returns:
        ``(gamma [B, T, HV] fp32, ainv [B, T, HV, 64] in k's dtype, k_rstd [B, T, H] fp32 or
        None)``; gamma is the in-chunk cumsum of the gates floored at ``-GATE_FLOOR``
        (common.py); Ainv is computed in fp32 and rounded once to k's dtype, the operand dtype
        of every product that reads it (``wy_fwd``'s w and u, the backward's
        ``wy_kkt_bwd``); k_rstd with ``norm``.
    """
    batch, seq_len, heads, key_dim = k.shape
    num_chunks = triton.cdiv(seq_len, CHUNK) if chunks is None else chunks.shape[0]
    gamma = torch.empty(batch, seq_len, num_value_heads, device=k.device, dtype=torch.float32)
    ainv = torch.empty(batch, seq_len, num_value_heads, CHUNK, device=k.device, dtype=k.dtype)
    k_rstd = (torch.empty(batch, seq_len, heads, device=k.device, dtype=torch.float32)
              if norm else None)
    kkt_solve_kernel[(num_chunks, batch * num_value_heads)](
        k, g, beta, gamma, ainv, gamma if k_rstd is None else k_rstd,
        chunks if chunks is not None else gamma, seq_len, H=heads, HV=num_value_heads,
        K=key_dim, BT=CHUNK, VARLEN=chunks is not None, NORM=norm, EPS=L2NORM_EPS,
    )
    return gamma, ainv, k_rstd


def wy_forward(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor,
               ainv: torch.Tensor, chunks: torch.Tensor | None = None, w_only: bool = False,
               k_rstd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """WY factors ``(w [B, T, HV, K] in k's dtype, u [B, T, HV, V] in v's dtype)`` of the
    keys as given, or of the raw keys normalised on load with their 1/norms ``k_rstd``
    ``[B, T, H]`` fp32 (the same bits); ``chunks`` as :func:`kkt_solve`; ``w_only``: u is not
    formed (None), w is bitwise the same."""
    batch, seq_len, heads, key_dim = k.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    w = torch.empty(batch, seq_len, num_value_heads, key_dim, device=k.device, dtype=k.dtype)
    u = None if w_only else torch.empty_like(v)
    num_chunks = triton.cdiv(seq_len, CHUNK) if chunks is None else chunks.shape[0]
    wy_fwd_kernel[(num_chunks, batch * num_value_heads)](
        k, v, beta, gamma, ainv, w, w if u is None else u, w, w if k_rstd is None else k_rstd,
        w, chunks if chunks is not None else gamma, seq_len, H=heads, HV=num_value_heads,
        K=key_dim, V=value_dim, BT=CHUNK, BK=min(64, key_dim), BV=min(64, value_dim),
        VARLEN=chunks is not None, W_ONLY=w_only, NORM=k_rstd is not None, QN=False,
        EPS=L2NORM_EPS,
    )
    return w, u


def wy_norms_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     gamma: torch.Tensor, ainv: torch.Tensor, k_rstd: torch.Tensor | None,
                     chunks: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """The WY factors and the queries' 1/norms in one launch (the fused forward's).

    Args:
        q, k: ``[B, T, H, K]``, raw when ``k_rstd`` (from :func:`kkt_solve` with ``norm``) is
            given (the kernel then forms q's 1/norms), else used as they are.
        v, beta, gamma, ainv, chunks: as :func:`wy_forward`.

    Returns:
        ``{"w" [B, T, HV, K], "u" [B, T, HV, V], "q_rstd" [B, T, H] fp32 or None}``.
    """
    batch, seq_len, heads, key_dim = k.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    w = torch.empty(batch, seq_len, num_value_heads, key_dim, device=k.device, dtype=k.dtype)
    u = torch.empty_like(v)
    norm = k_rstd is not None
    q_rstd = torch.empty_like(k_rstd) if norm else None
    num_chunks = triton.cdiv(seq_len, CHUNK) if chunks is None else chunks.shape[0]
    wy_fwd_kernel[(num_chunks, batch * num_value_heads)](
        k, v, beta, gamma, ainv, w, u, q, k_rstd if norm else w, q_rstd if norm else w,
        chunks if chunks is not None else gamma, seq_len, H=heads, HV=num_value_heads,
        K=key_dim, V=value_dim, BT=CHUNK, BK=min(64, key_dim), BV=min(64, value_dim),
        VARLEN=chunks is not None, W_ONLY=False, NORM=norm, QN=norm, EPS=L2NORM_EPS,
    )
    return {"w": w, "u": u, "q_rstd": q_rstd}
