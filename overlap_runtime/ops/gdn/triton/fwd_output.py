"""Output kernel: ``o = scale (diag(exp(gamma)) Q h_n + (Q K^T * Gamma) v_new)`` per chunk.

Grid ``(V / BV, NT, B * H)``: one program per key head walks its ``HV / H`` value heads, the
raw scores ``Q K^T`` formed once for them (``VARLEN``: chunk ``i_n`` spans the tokens of the
chunk table, common.chunk_span); reads q, k, each value head's entering state and residuals
from the state scan; writes o in v's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import autotune_configs, chunk_span, mm


@triton.autotune(configs=autotune_configs(), key=["H", "HV", "K", "V", "VARLEN"])
@triton.jit
def output_kernel(q, k, gamma, states, v_new, o, chunks, scale, T, NT, H: tl.constexpr,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BV: tl.constexpr, VARLEN: tl.constexpr):
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    G: tl.constexpr = HV // H
    t0, eos = chunk_span(chunks, i_n, T, BT, VARLEN)
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    DT = k.dtype.element_ty
    # the key head's q, k and raw scores, shared by its G value heads
    b_q = tl.load(q + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None], other=0.0)
    b_qk = mm(b_q, tl.trans(b_k))
    causal = o_i[:, None] >= o_i[None, :]
    for j in range(G):
        i_hv = i_h * G + j
        # padded tokens (t >= eos) take the last token's gamma: no exponent is positive
        b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
        base = ((i_b * NT + i_n) * HV + i_hv).to(tl.int64) * (K * V)
        b_h = tl.load(states + base + o_k[:, None] * V + o_v[None, :])
        b_o = mm(b_q, b_h) * tl.exp(b_gam)[:, None]
        b_s = tl.where(causal, b_qk * tl.exp(tl.where(causal, b_gam[:, None] - b_gam[None, :],
                                                          0.0)), 0.0)
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_vn = tl.load(v_new + off_v, mask=m_t[:, None], other=0.0)
        b_o = (b_o + mm(b_s.to(DT), b_vn)) * scale
        tl.store(o + off_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None])
