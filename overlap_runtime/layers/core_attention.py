"""The attention-core strategy: the one piece of an attention layer that reads other tokens.

The protocol
------------
An attention layer (:class:`~overlap_runtime.layers.attention.Qwen3_5Attention`,
:class:`~overlap_runtime.layers.attention.ReferenceAttention`) holds its core as the submodule
``core_attention``, called as::

    core_attention(q, k, v, causal=True, stats=None) -> out

with ``q`` ``[B, S, Hq, D]``, ``k``, ``v`` ``[B, S, Hkv, D]`` (after projection, norms and RoPE;
``Hq % Hkv == 0``) and ``out`` ``[B, S, Hq, D]`` in q's dtype, and ``softmax_scale`` on it
(None: ``D ** -0.5``). Everything else in the layer is token-wise, so swapping the core is all
it takes to run the layer on a sequence shard: ``context_parallel.ContextParallel.apply``
replaces :class:`CoreAttention` by a core over the CP group, and the caller hands the layer the
shard's position ids.

``stats`` is an optional per-call :class:`~overlap_runtime.ops.comm_stats.CommStats` the caller
passes through the layer's forward (the single-device core ignores it); no core keeps per-call
state.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from overlap_runtime.ops.attention import Backend, attention
from overlap_runtime.ops.comm_stats import CommStats


@runtime_checkable
class HasCoreAttention(Protocol):
    """An attention layer whose core can be swapped (``ContextParallel.apply`` needs this)."""

    core_attention: nn.Module


class CoreAttention(nn.Module):
    """Single-device core attention: ``(q, k, v, causal, stats) -> out`` (``ops.attention``).

    Args:
        softmax_scale: None for ``D ** -0.5``.
        backend: ``"math"``, ``"flash"`` or ``"cudnn"`` (see ``ops.attention``).
    """

    def __init__(self, softmax_scale: float | None = None, backend: Backend = "math") -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                stats: CommStats | None = None) -> torch.Tensor:
        """q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` -> ``[B, S, Hq, D]`` (q's dtype)."""
        return attention(q, k, v, causal, self.softmax_scale, self.backend)
