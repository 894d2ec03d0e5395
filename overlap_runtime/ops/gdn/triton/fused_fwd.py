"""Fused forward: two prep launches, then one walk per segment that keeps the
state in registers across the segment's chunks and writes o; neither the per-chunk states nor
v_new go to memory unless a backward needs them.

1. The prep, two launches parallel over chunks (launch.py ``prepare_fused``): ``kkt_solve``
   with the l2 norm folded in (it reads the raw keys, forms their 1/norms and normalises its
   tiles itself: gamma, Ainv) and ``wy_fwd`` (w, u from the raw keys normalised on load, the
   queries' 1/norms). No normalised copy of q or k is written: the walk reads the raw q, k and scales by the 1/norms (``NORM``), which saves the
   chain's two norm launches (read and write q, k). A one-launch parallel prep (norm, cumsum,
   block solve, w and u per chunk) spilled registers and ran 3.5x the chain's prep kernels on
   an H100 (docs/benchmarks.md, "Fused forward").
2. ``fused_walk_kernel``, grid ``(column blocks, NS, B * HV)``: one program walks the chunks of
   one segment for ``BV`` columns of the state of one ``(sequence, value head)``; per chunk it
   reads q, k (raw, with their 1/norms ``rq``, ``rk``; or as given without the norm), w, u,
   gamma and forms::

       v_new   = u - w h
       S       = (diag(rq) Q K^T diag(rk)) * Gamma                     (output mode)
       o       = scale (diag(e^gamma rq) Q h + S v_new)                  (output mode)
       h      <- e^gamma_C h + K^T diag(rk e^(gamma_C - gamma)) v_new

   Two modes, as ``fwd_scan_kernel`` (fwd_state.py):

   * output mode (``SUMMARY=False``): columns are the V columns; starts from the segment's
     entering state (``HAS_INIT``) or zero; writes o for its columns and the state leaving the
     segment (fp32). With ``SAVE`` it also writes the per-chunk entering states and v_new of
     its columns (what the unfused backward reads besides the prep's tensors, function.py).
   * summary mode (``SUMMARY=True``): the walk of the augmented state ``[M | S]`` (``K + V``
     columns) from ``[I | 0]`` with u replaced by ``[0 | u]``: the segment's affine summary
     ``H_out = M H_in + S`` (fp32). Nothing per chunk is written.

The WY solve is not inside the walk: in a walk of one program per state block every operation
of the chunk loop is on the critical path, and the solve's small 16 x 16 products and
substitution steps made a chunk step about 40x longer than the state update itself
(docs/benchmarks.md, "Fused forward"). The walk's step is the chain scan's plus the output
products. Forming the chunk's scores in the prep instead (written to memory, read by the walk)
made ``wy_fwd`` 0.24 ms longer at 32K on an H100 and the walk no shorter; the whole forward
was 2.37 ms against 2.30 with the scores formed in the walk on an H200.

Small ``B * HV`` fills the machine by the segment split of function.py: summaries of all
segments in parallel (summary mode), the fp32 ``chain_kernel`` across them, then every
segment's output walk from its true entering state, in parallel.

No product's cast result is transposed (Triton miscompiles that on Hopper): the only transpose
is of the keys, loaded from memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import CHUNK, chunk_span, mm, mma, segment_span


@dataclass(frozen=True)
class FusedConfig:
    """Launch choices of the fused forward's walks (results equal up to rounding across them).

    Attributes:
        walk_warps, walk_stages / summary_warps, summary_stages: ``num_warps``,
            ``num_stages`` of the output walk / the summary launch.
        block: state columns per program (None: ``min(64, K, V)``).

    The defaults are the fastest measured on an H100 at B=1 T=32K H=32, K = V = 128
    (docs/benchmarks.md): one stage for the output walk (2.69 ms against 2.89 ms with two),
    two for the summary walk (one: 3.01 ms).
    """

    walk_warps: int = 4
    walk_stages: int = 1
    summary_warps: int = 4
    summary_stages: int = 2
    block: int | None = None

    def columns(self, key_dim: int, value_dim: int) -> int:
        """State columns per program; raises naming the rule when they do not tile V."""
        block = min(64, key_dim, value_dim) if self.block is None else self.block
        if value_dim % block or key_dim % block:
            raise ValueError(f"FusedConfig.block={block} must divide K={key_dim} and "
                             f"V={value_dim}")
        return block


DEFAULT_CONFIG = FusedConfig()


@triton.jit
def fused_walk_kernel(q, k, q_rstd, k_rstd, w, u, gamma, h_init, o, h_end, m_sum, s_sum,
                      states, v_new, chunks, segs, scale, T, NT, L, NS, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr, SUMMARY: tl.constexpr, HAS_INIT: tl.constexpr,
                      SAVE: tl.constexpr, VARLEN: tl.constexpr, NORM: tl.constexpr):
    i_c, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    n0, n1, row = segment_span(segs, i_s, i_bh, i_hv, L, NT, NS, HV, VARLEN)
    o_k = tl.arange(0, K)
    o_c = tl.arange(0, BV)
    o_i = tl.arange(0, BT)
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
        o_t = t0 + o_i
        m_t = o_t < eos
        # padded rows (t >= eos) take the last token's gamma: no exponent is positive
        b_gam = tl.load(gamma + (i_b * T + tl.minimum(o_t, eos - 1)) * HV + i_hv)
        g_last = tl.load(gamma + (i_b * T + tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        off_k = ((i_b * T + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        b_k = tl.load(k + off_k, mask=m_t[:, None], other=0.0)
        if NORM:
            b_rk = tl.load(k_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
        b_hd = b_h.to(DT)
        if SAVE:
            base = ((i_b * NT + n) * HV + i_hv).to(tl.int64) * (K * V)
            tl.store(states + base + o_k[:, None] * V + col_v[None, :], b_hd)
        # the query side first (q is dead before w is loaded: fewer live registers)
        if not SUMMARY:
            b_q = tl.load(q + off_k, mask=m_t[:, None], other=0.0)
            b_row = tl.exp(b_gam)
            if NORM:
                b_rq = tl.load(q_rstd + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
                b_row = b_row * b_rq
            # the decayed causal scores of the normalised q, k, from the raw ones
            causal = o_i[:, None] >= o_i[None, :]
            b_s = mm(b_q, tl.trans(b_k))
            if NORM:
                b_s = b_s * (b_rq[:, None] * b_rk[None, :])
            b_s = tl.where(causal, b_s * tl.exp(tl.where(causal, b_gam[:, None]
                                                         - b_gam[None, :], 0.0)),
                           0.0).to(DT)
            b_o = mm(b_q, b_hd) * b_row[:, None]
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
        b_dec = tl.where(m_t, tl.exp(g_last - b_gam), 0.0)
        if NORM:  # raw keys: K^T diag(1/norm) is the normalised keys' transpose
            b_dec = b_dec * b_rk
        b_vs = b_vn * b_dec[:, None]
        b_h = mma(tl.trans(b_k), b_vs.to(DT), b_h * tl.exp(g_last))
    if SUMMARY:
        tl.store(m_sum + (row * K + o_k[:, None]) * K + col_m[None, :], b_h,
                 mask=(o_k[:, None] < K) & is_m[None, :])
        tl.store(s_sum + (row * K + o_k[:, None]) * V + col_v[None, :], b_h,
                 mask=(o_k[:, None] < K) & u_mask[None, :])
    else:
        tl.store(h_end + (row * K + o_k[:, None]) * V + col_v[None, :], b_h)


def _launch(grid, prep: dict, outs: dict, tables, scale: float, num_chunks: int,
            per_segment: int, num_segments: int, block: int, summary: bool, save: bool,
            num_warps: int, num_stages: int):
    q, u = prep["q"], prep["u"]
    batch, seq_len, heads, key_dim = q.shape
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    dummy = outs["dummy"]

    def get(name: str) -> torch.Tensor:
        x = outs.get(name)
        return dummy if x is None else x

    def given(name: str) -> torch.Tensor:
        x = prep.get(name)
        return dummy if x is None else x

    chunks, segs = tables
    fused_walk_kernel[grid](
        q, prep["k"], given("q_rstd"), given("k_rstd"), prep["w"], u,
        prep["gamma"], get("h_init"), get("o"), get("h_end"), get("m"), get("s"),
        get("states"), get("v_new"), dummy if chunks is None else chunks,
        dummy if segs is None else segs, scale, seq_len, num_chunks, per_segment, num_segments,
        H=heads, HV=num_value_heads, K=key_dim, V=value_dim, BT=CHUNK, BV=block,
        SUMMARY=summary, HAS_INIT=outs.get("h_init") is not None, SAVE=save,
        VARLEN=chunks is not None, NORM=prep.get("k_rstd") is not None,
        num_warps=num_warps, num_stages=num_stages,
    )


def fused_summaries(prep: dict[str, torch.Tensor | None], num_segments: int, per_segment: int,
                    num_chunks: int, rows: tuple[int, int],
                    tables: tuple[torch.Tensor | None, torch.Tensor | None],
                    config: FusedConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary ``(M [*rows, K, K], S [*rows, K, V])`` fp32 of every segment from zero,
    all in parallel (summary mode of :func:`fused_walk_kernel`).

    ``prep``: launch.py ``prepare_fused``'s dict (reads ``"q"``, ``"k"`` ``[B, T, H, K]``
    and their 1/norms ``"q_rstd"``, ``"k_rstd"`` ``[B, T, H]`` fp32 or None (no norm),
    ``"w"`` ``[B, T, HV, K]``, ``"u"`` ``[B, T, HV, V]``,
    ``"gamma"`` ``[B, T, HV]`` fp32).
    ``rows``: ``(B * HV, NS)`` dense, ``(NS, HV)`` with varlen ``tables`` (chunk table,
    segment table; ``(None, None)`` dense)."""
    batch, seq_len, heads, key_dim = prep["k"].shape
    num_value_heads, value_dim = prep["u"].shape[2], prep["u"].shape[3]
    dev = prep["k"].device
    m = torch.empty(*rows, key_dim, key_dim, device=dev, dtype=torch.float32)
    s = torch.empty(*rows, key_dim, value_dim, device=dev, dtype=torch.float32)
    block = config.columns(key_dim, value_dim)
    grid = ((key_dim + value_dim) // block, num_segments, batch * num_value_heads)
    _launch(grid, prep, {"dummy": m, "m": m, "s": s}, tables, 1.0, num_chunks, per_segment,
            num_segments, block, True, False, config.summary_warps, config.summary_stages)
    return m, s


def fused_walk(prep: dict[str, torch.Tensor | None], seg_init: torch.Tensor | None,
               scale: float, num_segments: int, per_segment: int, num_chunks: int,
               rows: tuple[int, int], tables: tuple[torch.Tensor | None, torch.Tensor | None],
               save: bool, config: FusedConfig = DEFAULT_CONFIG) -> dict[str, torch.Tensor]:
    """Every segment's output walk from its entering state (output mode), from ``prep``
    (as :func:`fused_summaries`).

    Args:
        seg_init: ``[*rows, K, V]`` fp32 state entering each segment, or None (zeros).
        save: also write the per-chunk states and v_new the unfused backward reads.

    Returns:
        ``{"o" [B, T, HV, V] in u's dtype, "h_end" [*rows, K, V] fp32}`` and with ``save``
        ``"states" [B, NT, HV, K, V]`` in k's dtype, ``"v_new" [B, T, HV, V]`` in u's dtype.
    """
    batch, seq_len, heads, key_dim = prep["k"].shape
    u = prep["u"]
    num_value_heads, value_dim = u.shape[2], u.shape[3]
    dev = u.device
    out = {
        "o": torch.empty_like(u),
        "h_end": torch.empty(*rows, key_dim, value_dim, device=dev, dtype=torch.float32),
    }
    if save:
        out["states"] = torch.empty(batch, num_chunks, num_value_heads, key_dim, value_dim,
                                    device=dev, dtype=prep["k"].dtype)
        out["v_new"] = torch.empty_like(u)
    block = config.columns(key_dim, value_dim)
    grid = (value_dim // block, num_segments, batch * num_value_heads)
    _launch(grid, prep, {"dummy": out["h_end"], "h_init": seg_init, **out}, tables, scale,
            num_chunks, per_segment, num_segments, block, False, save, config.walk_warps,
            config.walk_stages)
    return out
