"""The elementwise pieces of the Qwen3.5-style layers as pure functions, and their compiled form.

On one H200 at 32K tokens these pieces, run eagerly, took about 40% of a training step of the
4-layer hybrid (model_breakdown.py, docs/benchmarks_history.md): every one is a few passes
over ``[B, T, C]`` activations with fp32 round trips. ``layers.compile.compile_elementwise`` puts
``torch.compile`` (regional compilation, as torchtitan compiles each block) on exactly these
pieces, so each becomes one or two fused kernels forward and backward, while the GDN and
attention cores (Triton / SDPA, opaque to the compiler) and every collective stay outside the
compiled regions; it is what ``train.compile: true`` applies.

- :func:`causal_conv_silu`: SiLU of the causal depthwise conv of the GDN layer (``F.conv1d``,
  the eager form); :func:`causal_conv_silu_shifted`: the same as a sum of ``K`` shifted
  products in the ``[B, T, C]`` layout, accumulated in fp32, which the compiler fuses into one
  kernel (4.3 ms fwd+bwd at 32K x 8192 channels on an H200 vs 11.9 ms for cuDNN's depthwise
  conv). The third form is ``ops.causal_conv.causal_conv_silu_triton``, Triton kernels with the
  same arguments (x ``[B, T, C]`` C innermost, bf16/fp16/fp32; weight ``[C, K]``, K <= 8;
  ``left`` halo; dilation): forward one pass over x accumulated in fp32 and rounded once,
  backward dx (SiLU derivative recomputed from x), dweight (fp32 per-program partial sums, one
  deterministic reduction) and d_left. Which one a ``GatedDeltaNet`` uses is explicit:
  ``conv_backend="torch"`` (``model.conv_backend``, the default) runs this module's
  ``F.conv1d`` form eagerly and the compiled shifted sum under ``train.compile``; the
  context-parallel halo conv (p2p, all_gather, prefix_scan) keeps ``F.conv1d`` then, so under
  ``train.compile`` with those modes the single-device and CP convs differ by bf16 rounding.
  ``conv_backend="triton"`` runs the Triton kernels whatever ``train.compile`` says, and the CP
  halo conv (``context_parallel.gdn.common``) runs the same kernels with the previous rank's
  halo as ``left``: single-device and CP share the arithmetic. The packed-document CP conv
  (``context_parallel.gdn.varlen``) stays in torch either way. Benchmark:
  ``benchmarks/causal_conv.py``. Packed documents: all three take ``doc_positions`` ``[B, T]``
  (each token's position in its document) and drop the taps that reach before a document start
  (``F.conv1d`` cannot, so :func:`causal_conv_silu` hands them to the shifted sum).
- :func:`gdn_gates`: ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.
- :func:`sigmoid_gate`: the attention layer's output gate ``o * sigmoid(gate)``.
- ``RMSNorm`` / ``RMSNormGated`` modules: compiled in place (``nn.Module.compile``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                     dilation: int = 1, doc_positions: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``SiLU(causal depthwise conv)`` over the sequence, with ``F.conv1d`` (the eager form: the
    same arithmetic as the context-parallel halo conv of ``context_parallel.gdn.common``).

    Args:
        x: ``[B, T, C]`` input, any float dtype.
        weight: ``[C, K]`` one filter per channel (``conv1d.weight[:, 0, :]``).
        left: ``[B, (K - 1) * dilation, C]`` the positions just before ``x`` (a CP halo), or
            None for causal zero padding.
        dilation: the conv's dilation.
        doc_positions: ``[B, T]`` int position of each token in its packed document, or None:
            the conv restarts at every document start (:func:`causal_conv_silu_shifted`, which
            runs it: ``F.conv1d`` cannot drop taps per token).

    Returns:
        ``[B, T, C]`` in x's dtype.
    """
    if doc_positions is not None:
        return causal_conv_silu_shifted(x, weight, left, dilation, doc_positions)
    halo = (weight.shape[-1] - 1) * dilation
    xt = x.transpose(1, 2)  # [B, C, T]
    if left is None:
        xt = F.pad(xt, (halo, 0))
    else:
        xt = torch.cat([left.to(x.dtype).transpose(1, 2), xt], dim=2)
    out = F.conv1d(xt, weight.unsqueeze(1), None, 1, 0, dilation, weight.shape[0])
    return F.silu(out).transpose(1, 2)


def causal_conv_silu_shifted(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                             dilation: int = 1, doc_positions: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """:func:`causal_conv_silu` as a sum of ``K`` shifted products in the ``[B, T, C]`` layout
    (no transposes), accumulated in fp32 (float64 stays float64) and rounded once: the form
    ``torch.compile`` fuses into one kernel forward and one backward (the compiled
    ``train.compile`` path). Same arguments and result; equal to fp32 rounding in fp32, and
    more exact than the bf16 ``F.conv1d`` in bf16 (one rounding instead of one per op).

    Packed documents: with ``doc_positions`` ``[B, T]`` (int, each token's position in its
    document, ``layers.segments.document_positions``) tap ``j``, which reaches
    ``lag = (K - 1 - j) * dilation`` positions back, is kept only where ``lag <= position``
    (a select, so a NaN before the document start stays out): the conv restarts at every
    document start exactly as the conv of the document alone with zero padding does."""
    k, t = weight.shape[-1], x.shape[1]
    halo = (k - 1) * dilation
    xp = F.pad(x, (0, 0, halo, 0)) if left is None else torch.cat([left.to(x.dtype), x], 1)
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute)
    pos = None if doc_positions is None else doc_positions.to(x.device).unsqueeze(-1)
    acc = None
    for j in range(k):
        s = j * dilation
        tap = xp[:, s:s + t].to(compute)
        if pos is not None and halo - s > 0:  # the tap reaches halo - s positions back
            tap = torch.where(pos >= halo - s, tap, 0.0)
        acc = tap * w[:, j] if acc is None else acc + tap * w[:, j]
    return F.silu(acc).to(x.dtype)


def causal_conv_silu_parts(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...],
                           left: torch.Tensor | None = None, dilation: int = 1,
                           doc_positions: torch.Tensor | None = None, *,
                           conv: Callable[..., torch.Tensor] = causal_conv_silu_shifted
                           ) -> tuple[torch.Tensor, ...]:
    """``conv`` (a conv of this module's signature) on each channel group of ``x``: the GDN
    layer's q, k, v as separate contiguous ``[B, T, size]`` tensors, in x's dtype.

    The conv is depthwise, so each group's output is that of the whole conv's channels (the same
    per-channel arithmetic). Why: the GDN op needs q, k, v contiguous; slicing them out of one
    ``[B, T, C]`` conv output gives strided views that the op copies (``B*T*C`` elements), and
    ``split``'s backward concatenates their gradients (another ``B*T*C``). Here each group's conv
    writes its own contiguous output (the compiled shifted sum,
    :func:`causal_conv_silu_shifted_parts`, fuses the slicing and, in backward, the
    concatenation of the groups' dx into its kernels; the Triton conv has its own autograd
    Function for the groups, ``ops.causal_conv.causal_conv_silu_triton_parts``, whose kernels
    read each slice of x in place and write each group's dx into one gradient). Measured by
    ``benchmarks/layer_copies.py``.

    Args:
        x: ``[B, T, C]``, ``C = sum(sizes)``; weight ``[C, K]``; left ``[B, halo, C]`` or None;
            dilation, doc_positions: as :func:`causal_conv_silu`.
        sizes: channels of each group (q, k, v: ``(h*K, h*K, hv*V)``).
        conv: the conv run on each group.
    """
    xs = x.split(sizes, -1)
    ws = weight.split(sizes, 0)
    ls = (None,) * len(sizes) if left is None else left.split(sizes, -1)
    extra = () if doc_positions is None else (doc_positions,)
    return tuple(conv(xi, wi, li, dilation, *extra) for xi, wi, li in zip(xs, ws, ls))


def causal_conv_silu_shifted_parts(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...],
                                   left: torch.Tensor | None = None, dilation: int = 1,
                                   doc_positions: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, ...]:
    """:func:`causal_conv_silu_parts` of :func:`causal_conv_silu_shifted`: the function
    ``layers.compile.compile_elementwise`` compiles (one graph for all groups, so the
    concatenation of the groups' dx in backward is fused too)."""
    return causal_conv_silu_parts(x, weight, sizes, left, dilation, doc_positions,
                                  conv=causal_conv_silu_shifted)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32 (float64 stays) and
    ``beta = sigmoid(b)`` in b's dtype; a, b ``[B, T, hv]``, a_log, dt_bias ``[hv]``."""
    gate_dtype = torch.promote_types(a.dtype, torch.float32)  # g is never half precision
    g = -a_log.to(gate_dtype).exp() * F.softplus(a.to(gate_dtype) + dt_bias.to(gate_dtype))
    return g, torch.sigmoid(b)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(gate)``: the attention layer's output gate (o, gate ``[B, S, H, D]``, one
    dtype; gate may be a strided view); compiled, one kernel forward and one backward instead of
    a sigmoid, a product and their backward's four passes over ``[B, S, H, D]``."""
    return o * torch.sigmoid(gate)
