"""Triton kernels of the causal depthwise conv + SiLU (``ops.causal_conv``).

Notation: ``x [B, T, C]`` with C innermost (any batch / time strides), ``w [C, K]``, halo ``H = (K - 1) * D`` (D the dilation),
``left [B, H, C]`` the positions ``-H .. -1`` before x (zeros when absent). With ``xf`` the
sequence ``[left | x]`` indexed from ``-H``::

    a[t]  = sum_i w[i] * xf[t - H + i*D]               (pre-activation, fp32)
    y[t]  = a[t] * sigmoid(a[t])
    ds[t] = dy[t] * sigmoid(a[t]) * (1 + a[t] * (1 - sigmoid(a[t])))     (0 outside [0, T))
    dxf[s] = sum_m w[K-1-m] * ds[s + m*D]       for s in [-H, T): dx (s >= 0), d_left (s < 0)
    dw[c, i] = sum_{b, t} ds[b, t, c] * xf[b, t - H + i*D, c]

Forward: one program per ``[BT, BC]`` tile, K shifted loads of x (the overlap of neighbouring
taps is served by the cache, so HBM reads x about once), fp32 accumulation, one rounding.
Backward: ``ds`` is recomputed from x (``a`` and the SiLU derivative are not saved), in
overlapping tiles of BT rows that each own their first ``BT - H`` rows (the ``H`` rows after
them are computed again by the next tile); ``dx`` of the own rows is formed from the tile's
``ds`` shifted on chip (``tl.gather``), with no scratch in memory and no block barrier;
the weight gradient is a per-program fp32 partial sum over its rows, written to
``partial [NP, K, C]`` and reduced once afterwards (deterministic, no atomics). A second small
kernel computes ``d_left`` (H rows per batch and channel block).

Packed documents (``HAS_POS``): ``pos [B, T]`` int32 is each token's position in its document
(``layers.segments.document_positions``). Tap ``i`` reaches ``lag = H - i*D`` positions back
and is kept at output ``t`` only when ``lag <= pos[t]``, so no window crosses a document start
(the conv restarts there exactly as with zero left padding)::

    a[t]  = sum_i [H - i*D <= pos[t]] * w[i] * xf[t - H + i*D]
    dxf[s] = sum_m [m*D <= pos[s + m*D]] * w[K-1-m] * ds[s + m*D]
    dw[c, i] = sum_{b, t} [H - i*D <= pos[t]] * ds[b, t, c] * xf[b, t - H + i*D, c]
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_xf(x_ptr, left_ptr, b, pos, cols, col_ok, T, C, SXB, SXT, HALO,
             HAS_LEFT: tl.constexpr):
    """``xf[b, pos, cols]`` as fp32 ``[BT, BC]``: x (strides ``SXB, SXT, 1``) for
    ``0 <= pos < T``, left (contiguous) for ``-HALO <= pos < 0`` (when given), 0 elsewhere.
    Offsets in int64."""
    in_x = (pos >= 0) & (pos < T)
    px = tl.where(in_x, pos, 0).to(tl.int64)
    offs = (b * SXB + px * SXT)[:, None] + cols[None, :]
    v = tl.load(x_ptr + offs, mask=in_x[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if HAS_LEFT:
        in_l = (pos < 0) & (pos >= -HALO)
        pl = tl.where(in_l, pos + HALO, 0).to(tl.int64)
        offs_l = (b * HALO + pl)[:, None] * C + cols[None, :]
        v += tl.load(left_ptr + offs_l, mask=in_l[:, None] & col_ok[None, :],
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def _doc_pos(pos_ptr, b, pos, T):
    """``pos_in_doc[b, pos]`` int32 ``[BT]`` (contiguous ``[B, T]``), 0 outside ``[0, T)``
    (where nothing reads it: dy is 0 there)."""
    in_x = (pos >= 0) & (pos < T)
    p = tl.where(in_x, pos, 0).to(tl.int64)
    return tl.load(pos_ptr + b * T + p, mask=in_x, other=0)


@triton.jit
def _preact(x_ptr, left_ptr, w_ptr, pos_ptr, b, pos, cols, col_ok, T, C, SXB, SXT, HALO, DIL,
            K: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_POS: tl.constexpr):
    """``a[b, pos, cols]`` fp32 ``[BT, BC]`` (module docstring; with ``HAS_POS`` the taps that
    reach before the output token's document start are dropped)."""
    acc = tl.zeros((pos.shape[0], cols.shape[0]), dtype=tl.float32)
    if HAS_POS:
        dp = _doc_pos(pos_ptr, b, pos, T)
    for i in tl.static_range(K):
        w_i = tl.load(w_ptr + cols * K + i, mask=col_ok, other=0.0).to(tl.float32)
        xv = _load_xf(x_ptr, left_ptr, b, pos + (i * DIL - HALO), cols, col_ok, T, C, SXB, SXT,
                      HALO, HAS_LEFT)
        if HAS_POS:
            xv = tl.where((dp >= HALO - i * DIL)[:, None], xv, 0.0)
        acc += w_i[None, :] * xv
    return acc


@triton.jit
def _ds(x_ptr, left_ptr, w_ptr, pos_ptr, dy_ptr, b, pos, cols, col_ok, T, C, SXB, SXT, HALO,
        DIL, K: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_POS: tl.constexpr):
    """``ds[b, pos, cols]`` fp32 ``[BT, BC]``, 0 outside ``[0, T)``, recomputed from x (dy
    contiguous)."""
    a = _preact(x_ptr, left_ptr, w_ptr, pos_ptr, b, pos, cols, col_ok, T, C, SXB, SXT, HALO,
                DIL, K, HAS_LEFT, HAS_POS)
    in_x = (pos >= 0) & (pos < T)
    pd = tl.where(in_x, pos, 0).to(tl.int64)
    dy = tl.load(dy_ptr + (b * T + pd)[:, None] * C + cols[None, :],
                 mask=in_x[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    return dy * sig * (1.0 + a * (1.0 - sig))


@triton.jit
def _add_dw(dw, ds, x_ptr, left_ptr, dp, b, rows, cols, col_ok, taps, T, C, SXB, SXT, HALO, DIL,
            K: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_POS: tl.constexpr):
    """``dw [KP, BC]`` plus this tile's weight gradient ``sum_rows ds * xf[rows - H + i*D]``
    per tap ``i`` (``dp``: the rows' positions in their documents with ``HAS_POS``, unread
    otherwise)."""
    for i in tl.static_range(K):
        xv = _load_xf(x_ptr, left_ptr, b, rows + (i * DIL - HALO), cols, col_ok, T, C, SXB, SXT,
                      HALO, HAS_LEFT)
        if HAS_POS:
            xv = tl.where((dp >= HALO - i * DIL)[:, None], xv, 0.0)
        dw += tl.where(taps[:, None] == i, tl.sum(ds * xv, axis=0)[None, :], 0.0)
    return dw


@triton.jit
def causal_conv_silu_fwd_kernel(x_ptr, left_ptr, w_ptr, pos_ptr, y_ptr, T, C, SXB, SXT, HALO,
                                DIL, K: tl.constexpr, HAS_LEFT: tl.constexpr,
                                HAS_POS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Grid ``(cdiv(T, BT), cdiv(C, BC), B)``: ``y = SiLU(a)`` of one tile, in y's dtype
    (y contiguous)."""
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_t * BT + tl.arange(0, BT)
    cols = pid_c * BC + tl.arange(0, BC)
    col_ok = cols < C
    a = _preact(x_ptr, left_ptr, w_ptr, pos_ptr, b, rows, cols, col_ok, T, C, SXB, SXT, HALO,
                DIL, K, HAS_LEFT, HAS_POS)
    y = a / (1.0 + tl.exp(-a))
    offs = (b * T + rows.to(tl.int64))[:, None] * C + cols[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty),
             mask=(rows < T)[:, None] & col_ok[None, :])


@triton.jit
def causal_conv_silu_bwd_kernel(x_ptr, left_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, partial_ptr,
                                T, C, SXB, SXT, SDB, SDT, HALO, DIL, OWN, TILES,
                                K: tl.constexpr, KP: tl.constexpr, HAS_LEFT: tl.constexpr,
                                HAS_POS: tl.constexpr, NEED_DX: tl.constexpr,
                                NEED_DW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Grid ``(NTP, cdiv(C, BC), B)``, each program ``TILES`` tiles of ``OWN = BT - HALO``
    rows: ``dx`` of its rows (batch / time strides ``SDB, SDT``, channels contiguous: a channel
    slice of a wider tensor is written in place) and its fp32 partial weight gradient
    ``partial[b * NTP + pid_t, :, c]`` (``[K, BC]``, KP = next power of two of K).

    Each tile computes ``ds`` for ``BT`` rows, its ``OWN`` rows and the ``HALO`` rows after
    them (which the next tile computes again: ``HALO / OWN`` more loads, from the cache), and
    forms ``dx`` of its own rows from ``ds`` shifted by ``m * DIL`` rows with ``tl.gather``
    (on chip; no scratch in memory, no block barrier in the kernel)."""
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cols = pid_c * BC + tl.arange(0, BC)
    col_ok = cols < C
    taps = tl.arange(0, KP)
    j = tl.arange(0, BT)
    own = j < OWN
    dw = tl.zeros((KP, BC), dtype=tl.float32)
    for tile in range(TILES):
        rows = (pid_t * TILES + tile) * OWN + j
        ds = _ds(x_ptr, left_ptr, w_ptr, pos_ptr, dy_ptr, b, rows, cols, col_ok, T, C, SXB, SXT,
                 HALO, DIL, K, HAS_LEFT, HAS_POS)
        dp = _doc_pos(pos_ptr, b, rows, T) if HAS_POS else rows
        if NEED_DW:
            dw = _add_dw(dw, tl.where(own[:, None], ds, 0.0), x_ptr, left_ptr, dp, b, rows, cols,
                         col_ok, taps, T, C, SXB, SXT, HALO, DIL, K, HAS_LEFT, HAS_POS)
        if NEED_DX:
            dx = tl.zeros((BT, BC), dtype=tl.float32)
            for m in tl.static_range(K):
                # own rows reach at most OWN - 1 + HALO = BT - 1: the clamp touches other rows
                idx = tl.minimum(j + m * DIL, BT - 1)
                v = tl.gather(ds, tl.broadcast_to(idx[:, None], (BT, BC)), 0)
                if HAS_POS:  # tap K-1-m of output rows + m*D reaches back m*D
                    v = tl.where((tl.gather(dp, idx, 0) >= m * DIL)[:, None], v, 0.0)
                w_j = tl.load(w_ptr + cols * K + (K - 1 - m), mask=col_ok,
                              other=0.0).to(tl.float32)
                dx += w_j[None, :] * v
            offs = (b * SDB + rows.to(tl.int64) * SDT)[:, None] + cols[None, :]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty),
                     mask=(own & (rows < T))[:, None] & col_ok[None, :])
    if NEED_DW:
        block = b * tl.num_programs(0) + pid_t
        offs = (block * K + taps)[:, None] * C + cols[None, :]
        tl.store(partial_ptr + offs, dw, mask=(taps < K)[:, None] & col_ok[None, :])


@triton.jit
def causal_conv_silu_bwd_left_kernel(x_ptr, left_ptr, w_ptr, pos_ptr, dy_ptr, dleft_ptr,
                                     T, C, SXB, SXT, HALO, DIL, K: tl.constexpr,
                                     HAS_POS: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr):
    """Grid ``(cdiv(C, BC), B)``: ``d_left[b, s + HALO, cols]`` for ``s in [-HALO, 0)``
    (BH = next power of two of HALO), in d_left's dtype."""
    pid_c, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols = pid_c * BC + tl.arange(0, BC)
    col_ok = cols < C
    rows = tl.arange(0, BH) - HALO  # s, negative where it is a halo position
    acc = tl.zeros((BH, BC), dtype=tl.float32)
    for m in tl.static_range(K):
        ds = _ds(x_ptr, left_ptr, w_ptr, pos_ptr, dy_ptr, b, rows + m * DIL, cols, col_ok, T, C,
                 SXB, SXT, HALO, DIL, K, True, HAS_POS)
        if HAS_POS:  # tap K-1-m of output rows + m*D reaches back m*D
            keep = _doc_pos(pos_ptr, b, rows + m * DIL, T) >= m * DIL
            ds = tl.where(keep[:, None], ds, 0.0)
        w_j = tl.load(w_ptr + cols * K + (K - 1 - m), mask=col_ok, other=0.0).to(tl.float32)
        acc += w_j[None, :] * ds
    ok = rows < 0
    pl = tl.where(ok, rows + HALO, 0).to(tl.int64)
    offs = (b * HALO + pl)[:, None] * C + cols[None, :]
    tl.store(dleft_ptr + offs, acc.to(dleft_ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])
