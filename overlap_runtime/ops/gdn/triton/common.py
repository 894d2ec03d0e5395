"""Shared pieces of the GDN Triton kernels: dot helpers, launch heuristics, layouts.

Layouts (flash-linear-attention's, no transposes anywhere): per-token tensors are
``[B, T, heads, D]`` contiguous; per-chunk states ``[B, NT, HV, K, V]``; per-chunk square
matrices (the WY inverse, its gradient) ``[B, T, HV, BT]`` (row = token, column = position in
its chunk); segment summaries ``[B * HV, NS, K, K]`` / ``[B * HV, NS, K, V]`` fp32
(``[NS, HV, ...]`` for packed variable-length sequences, B = 1: varlen.py). Every chunk kernel
takes a ``VARLEN`` constexpr and a chunk table: :func:`chunk_span` gives a chunk's first token
and the end of its rows, :func:`segment_span` a scan segment's chunks.

This module imports triton: import it only from the kernel modules (the package ``__init__``
is lazy).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import triton
import triton.language as tl

CHUNK = 64

# Gates below -GATE_FLOOR are raised to it before the fp32 in-chunk cumsum. exp(-20) = 2.1e-9 is
# 29x below half an ulp of 1 (6e-8): a decay that contains a floored gate changes what it
# multiplies by less than one fp32 rounding of the sum it enters. The floor is kept this small
# because the gaps gamma_i - gamma_j are differences of fp32 cumsums: after one floored gate
# |gamma| ~ 20 + the chunk's own gates, rounded to ~1e-6 (4x a chunk without reset), and each
# further one in the same chunk adds 20 (docs/gdn.md, "Extreme gates", has the figures).
# -inf (a state reset) and -1e38 become finite; a NaN gate stays NaN.
GATE_FLOOR = tl.constexpr(20.0)

# TRITON_INTERPRET is read by triton when a kernel is decorated, so it is fixed for the life of
# the process; the kernels read this constexpr at compile time.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# NVIDIA (3xTF32 available) unless an Ascend build of triton is installed.
IS_CUDA = tl.constexpr(not INTERPRET.value and importlib.util.find_spec("torch_npu") is None)


@triton.jit
def mm(a, b):
    """``a @ b`` with fp32 accumulation.

    The interpreter multiplies the raw bit patterns of bfloat16 operands (it does not support
    bfloat16 ``tl.dot``), so under ``TRITON_INTERPRET=1`` the operands - already
    rounded to their storage dtype - are widened to fp32 first: the same products as the
    tensor-core path, which rounds nothing further.
    """
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def mma(a, b, acc):
    """``acc + a @ b`` with the product accumulated into the fp32 ``acc`` by the matrix unit
    (no separate add; operands as in :func:`mm`)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def mm_f32x3(a, b):
    """``a @ b`` of fp32 operands to about fp32 accuracy on tensor cores (3xTF32 on NVIDIA;
    ``ieee`` fp32 elsewhere). Used for the long chains of K x K maps, where ``ieee`` products
    of 128 x 128 tiles spill registers and run ~100x slower, and for the block products of the
    WY inverse (``ieee`` runs them on the CUDA cores)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IS_CUDA:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def normalised(x, r):
    """``x * r`` per row (``x [R, D]``, ``r [R]`` fp32 1/norms), in x's dtype: the l2 norm
    kernel's own operations (l2norm.py: x widened to fp32 times its 1/norm, one rounding), so
    the same bits as the normalised copy it would have written. The kernels that read raw q, k
    with their 1/norms normalise each loaded tile with it (no normalised copy in memory)."""
    return (x.to(tl.float32) * r[:, None]).to(x.dtype)


@triton.jit
def normalised_cols(x, r):
    """:func:`normalised` of a tile loaded transposed (``x [D, R]``, ``r [R]``)."""
    return (x.to(tl.float32) * r[None, :]).to(x.dtype)


@triton.jit
def gate_floor(g):
    """``g`` (fp32) with gates below ``-GATE_FLOOR`` raised to it; NaN stays NaN (a ``where``
    on ``g < floor``, not ``maximum``, which would return the floor for a NaN)."""
    return tl.where(g < -GATE_FLOOR, -GATE_FLOOR, g)


@triton.jit
def gate_floored(g):
    """Where :func:`gate_floor` changed ``g`` (its derivative is 0 there; False for NaN)."""
    return g < -GATE_FLOOR


@triton.jit
def chunk_span(chunks, i_n, T, BT: tl.constexpr, VARLEN: tl.constexpr):
    """``(t0, eos)``: the first token of chunk ``i_n`` and the end (exclusive) of the tokens it
    may hold. Dense: ``(i_n BT, T)``, the kernels' original arithmetic. ``VARLEN``: read from the
    chunk table ``chunks [NT, 2]`` int32 (varlen.py), ``eos`` the end of the chunk's sequence,
    so a chunk never straddles two sequences and rows ``>= eos`` are masked as rows ``>= T``
    are for the last dense chunk."""
    if VARLEN:
        t0 = tl.load(chunks + 2 * i_n)
        eos = tl.load(chunks + 2 * i_n + 1)
    else:
        t0 = i_n * BT
        eos = T
    return t0, eos


@triton.jit
def segment_span(segs, i_s, i_bh, i_hv, L, NT, NS, HV: tl.constexpr, VARLEN: tl.constexpr):
    """``(n0, n1, row)``: segment ``i_s`` walks chunks ``[n0, n1)``; ``row`` indexes its
    per-segment fp32 tensors (entering/leaving states, summaries).

    Dense: ``[i_s L, min((i_s + 1) L, NT))``, rows ``[B * HV, NS]`` (``row = i_bh NS + i_s``).
    ``VARLEN`` (B = 1): ``[n0, n1)`` from the segment table ``segs [NS, 2]`` int32, rows
    ``[NS, HV]`` (``row = i_s HV + i_hv``), so that with one segment per sequence the
    ``[N, HV, K, V]`` initial and final states are those tensors themselves.
    """
    if VARLEN:
        n0 = tl.load(segs + 2 * i_s)
        n1 = tl.load(segs + 2 * i_s + 1)
        row = i_s * HV + i_hv
    else:
        n0 = i_s * L
        n1 = tl.minimum(n0 + L, NT)
        row = i_bh * NS + i_s
    return n0, n1, row


AUTOTUNE_ENV = "OVERLAP_RUNTIME_GDN_AUTOTUNE"


#: the launch configurations of the kernels with a loop over tiles (the state walks, dqkwg,
#: wy_kkt_bwd): the default list and 3 stages (they prefetch the next iteration's tiles while
#: its products run; the walks on sm_90: spill-free at 4 and 8 warps, up to 182 KB of shared
#: memory; 4 stages need up to 249 KB, over the 227 KB a block may have)
SCAN_PAIRS: tuple[tuple[int, int], ...] = ((8, 2), (2, 2), (4, 1), (4, 2), (8, 1), (4, 3),
                                           (8, 3))


def autotune_configs(pairs: tuple[tuple[int, int], ...] = ((8, 2), (2, 2), (4, 1), (4, 2), (8, 1))
                     ) -> list[triton.Config]:
    """Launch configurations ``(num_warps, num_stages)`` to try on a GPU (few: each costs a
    compile on first use); one under the interpreter (it would run each).

    ``OVERLAP_RUNTIME_GDN_AUTOTUNE`` (read when the kernels are imported): ``all`` (default)
    tries every pair; ``first`` keeps the first pair alone (no tuning: correct and compiled once,
    for GPU tests and short runs where minutes of first-use compiles cost more than tuning gains).
    Any other value raises. The first pair is the one that compiles without register spills
    for sm_90 in most kernels (``benchmarks/ptxas_report.py``: 8 warps x 2 stages; 2 x 2
    spilled up to 19 KB per thread in ``dqkwg_kernel``); the order changes nothing under
    ``all``, where the measured fastest wins."""
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    mode = os.environ.get(AUTOTUNE_ENV, "all")
    if mode not in ("all", "first"):
        raise ValueError(f"{AUTOTUNE_ENV}={mode!r}: the GDN Triton kernels take 'all' (tune "
                         f"over every launch configuration) or 'first' (the first one alone)")
    if mode == "first":
        pairs = pairs[:1]
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in pairs]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (or vector cores) of ``device``; 4 on the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "npu":  # pragma: no cover - needs torch_npu
        try:
            props = torch.npu.get_device_properties(device)  # type: ignore[attr-defined]
            return int(getattr(props, "vector_core_num", 0) or 40)
        except Exception:
            return 40
    return 4


def choose_segments(num_chunks: int, programs_per_segment: int, device: torch.device) -> int:
    """How many segments to split each sequence into for the parallel state scan.

    One segment (the plain sequential scan) when ``B * HV * value blocks`` programs already
    fill the machine; otherwise enough segments for about two programs per multiprocessor,
    each segment keeping at least 4 chunks (the summaries cost about one scan of the segment,
    so very short segments only add work). Two, not more: on an H200 (B*HV = 32, V = 128)
    (264 programs, 64 per segment) 4 segments ran forward+backward 7% faster than the 9 of a
    four-per-SM target at 16K and 64K; 2, 16 and 32 were slower (docs/benchmarks_history.md,
    the segment sweep).
    """
    target = 2 * num_sms(device)
    if programs_per_segment >= target or num_chunks < 8:
        return 1
    wanted = max(2, target // programs_per_segment)
    segments = max(1, min(wanted, num_chunks // 4))
    chunks_per_segment = -(-num_chunks // segments)
    return -(-num_chunks // chunks_per_segment)

