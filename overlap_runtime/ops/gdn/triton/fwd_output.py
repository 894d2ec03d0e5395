"""Output kernel: ``o = scale (diag(exp(gamma)) Q h_n + (Q K^T * Gamma) v_new)`` per chunk.

Grid ``(V / BV, NT, B * HV)`` (``VARLEN``: chunk ``i_n`` spans the tokens of the chunk table,
common.chunk_span); reads q, k (key head), the chunk's entering state and residuals
from the state scan; writes o in v's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import autotune_configs, chunk_span, mm


@triton.autotune(configs=autotune_configs(), key=["K", "V", "VARLEN"])
@triton.jit
def output_kernel(q, k, gamma, states, v_new, o, chunks, scale, T, NT, H: tl.constexpr,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BV: tl.constexpr, VARLEN: tl.constexpr):
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    DT = k.dtype.element_ty
    b_q = tl.load(q + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    # padded tokens (t >= eos) take the last token's gamma: no exponent is positive
    b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
    base = ((i_b * NT + i_n) * HV + i_hv).to(tl.int64) * (K * V)
    b_h = tl.load(states + base + o_k[:, None] * V + o_v[None, :])
    b_o = mm(b_q, b_h) * tl.exp(b_gam)[:, None]
    causal = o_i[:, None] >= o_i[None, :]
    b_s = mm(b_q, tl.trans(b_k))
    b_s = tl.where(causal, b_s * tl.exp(tl.where(causal, b_gam[:, None] - b_gam[None, :], 0.0)),
                   0.0)
    off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
    b_vn = tl.load(v_new + off_v, mask=m_t[:, None], other=0.0)
    b_o = (b_o + mm(b_s.to(DT), b_vn)) * scale
    tl.store(o + off_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None])
