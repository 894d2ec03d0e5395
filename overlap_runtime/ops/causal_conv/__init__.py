"""Causal depthwise conv + SiLU of the GDN layer as Triton kernels (``conv_backend="triton"``).

``causal_conv_silu_triton(x [B, T, C], weight [C, K], left [B, (K-1)*dilation, C] | None,
dilation)`` has the semantics of ``layers.elementwise.causal_conv_silu``; the autograd Function
returns the gradients of x, weight and the halo ``left`` (which context parallelism sends back to
the previous rank). ``causal_conv_silu_triton_parts`` runs it on each channel group of x (the GDN
layer's q, k, v as contiguous outputs; in backward every group writes its dx into one gradient). ``causal_conv_silu_forward`` / ``causal_conv_silu_backward`` are the same
kernels without autograd, for an autograd Function that exchanges the halo itself
(``context_parallel.gdn.common``). ``check_causal_conv_inputs`` holds the rules (no triton).

Importing this package imports no triton: the names load their module on first use, and the
kernels (``triton/kernels.py``) only at the first launch, so ``TRITON_INTERPRET`` can be set
before.

May import: torch, ``overlap_runtime._lazy`` and (in ``triton/``, lazily) triton; nothing else
of ``overlap_runtime``: no communication, no layers.
"""

from __future__ import annotations

from ..._lazy import lazy_exports

_WHERE = {
    "CausalConvSiluFunction": "function",
    "CausalConvSiluPartsFunction": "function",
    "causal_conv_silu_triton_parts": "function",
    "causal_conv_silu_backward": "function",
    "causal_conv_silu_forward": "function",
    "causal_conv_silu_triton": "function",
    "MAX_KERNEL_SIZE": "capability",
    "check_causal_conv_inputs": "capability",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
