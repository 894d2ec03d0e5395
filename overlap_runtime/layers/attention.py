"""Full (softmax) attention layers: the Qwen3.5-style one and a minimal reference.

:class:`Qwen3_5Attention`: GQA, q/k RMSNorm, partial RoPE, output gate.

::

    x [B, S, hidden]
      |-- q_proj --> [B, S, H, 2D] --split per head--> q [B, S, H, D], gate [B, S, H, D]
      |-- k_proj --> k [B, S, Hkv, D]      v_proj --> v [B, S, Hkv, D]
      q, k <- RMSNorm over D (q_norm, k_norm), then RoPE on the first rotary_dim channels
      o = core_attention(q, k, v, causal=True)                        [B, S, H, D]
      o = o * sigmoid(gate)          (attn_output_gate, as Qwen3.5's full-attention layers)
      out = o_proj(o.reshape(B, S, H*D))                              [B, S, hidden]

:class:`ReferenceAttention`: the smallest layer that follows the protocol (q/k/v/o projections,
GQA, full RoPE), used to test context parallelism on its own.

Both follow the attention-core protocol (``layers.core_attention``): every step except
``core_attention`` is token-wise, and ``core_attention`` is a
:class:`~overlap_runtime.layers.core_attention.CoreAttention` that
``context_parallel.ContextParallel(...).apply(module, cp_mesh)`` swaps for the distributed
version. Under CP ``x`` and ``position_ids`` are this rank's shard (split by one rule) and so is
the output.
"""

from __future__ import annotations

import torch
from torch import nn

from overlap_runtime.layers.core_attention import CoreAttention
from overlap_runtime.layers.elementwise import sigmoid_gate
from overlap_runtime.layers.norm import RMSNorm
from overlap_runtime.layers.rope import apply_partial_rotary, apply_rotary, rotary_dim_for
from overlap_runtime.layers.segments import apply_per_segment
from overlap_runtime.layers.shared_input import shared_input_linear
from overlap_runtime.ops.attention import Backend
from overlap_runtime.ops.comm_stats import CommStats


class Qwen3_5Attention(nn.Module):
    """Gated grouped-query attention (see the module docstring).

    Args:
        hidden_size: model width.
        num_heads: H query heads; num_kv_heads: Hkv (H % Hkv == 0).
        head_dim: D.
        rope_theta: RoPE base; partial_rotary_factor: share of D that is rotated.
        output_gate: multiply the attention output by ``sigmoid(gate)`` (q_proj then emits 2D
            per head).
        norm_eps: epsilon of the q/k RMSNorms.
        backend: kernel of the single-device core attention (``"math"``, ``"flash"``,
            ``"cudnn"``; see ``ops.attention``).
        norm_zero_centered: the q/k norms store ``scale - 1`` (``layers.norm.RMSNorm``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float = 10000.0,
        partial_rotary_factor: float = 1.0,
        output_gate: bool = True,
        norm_eps: float = 1e-6,
        backend: Backend = "math",
        norm_zero_centered: bool = False,
    ) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rotary_dim = rotary_dim_for(head_dim, partial_rotary_factor)
        self.output_gate = output_gate
        q_width = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps, norm_zero_centered)
        self.k_norm = RMSNorm(head_dim, norm_eps, norm_zero_centered)
        self.core_attention: nn.Module = CoreAttention(softmax_scale=None, backend=backend)
        self.gate_fn = sigmoid_gate  # compiled by layers.compile under train.compile

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, stats: CommStats | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, S, hidden]``, ``position_ids [S] or [B, S]`` int64 -> ``[B, S, hidden]``.

        ``stats``: an optional per-call communication record passed to the CP core attention.
        ``cu_seqlens``: packed documents (``layers.segments``): attention is causal within each
        document only (single device: the core per segment; a context-parallel core takes the
        global ``cu_seqlens`` itself). RoPE follows
        ``position_ids``, so pass per-document positions to restart them too.
        """
        b, s, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q_all, k, v = shared_input_linear(x, self.q_proj, self.k_proj, self.v_proj)
        q_all = q_all.view(b, s, h, -1)
        if self.output_gate:
            q, gate = q_all.split(d, dim=-1)                      # each [B, S, H, D]
        else:
            q, gate = q_all, None
        k = k.view(b, s, self.num_kv_heads, d)
        v = v.view(b, s, self.num_kv_heads, d)
        q = apply_partial_rotary(self.q_norm(q), position_ids, self.rotary_dim, self.rope_theta)
        k = apply_partial_rotary(self.k_norm(k), position_ids, self.rotary_dim, self.rope_theta)
        if cu_seqlens is None:
            o = self.core_attention(q, k, v, causal=True, stats=stats)  # [B, S, H, D]
        else:
            if getattr(self.core_attention, "supports_packed", False):  # a CP core: global cu_seqlens
                o = self.core_attention(q, k, v, causal=True, stats=stats, cu_seqlens=cu_seqlens)
            elif type(self.core_attention) is CoreAttention:
                o = apply_per_segment(
                    lambda qs, ks, vs: self.core_attention(qs, ks, vs, causal=True),
                    (q, k, v), cu_seqlens)
            else:
                raise NotImplementedError(
                    f"Qwen3_5Attention with cu_seqlens (reset at document boundaries) needs "
                    f"CoreAttention or a core with supports_packed=True; got "
                    f"{type(self.core_attention).__name__}")
        if gate is not None:
            o = self.gate_fn(o, gate)
        return self.o_proj(o.reshape(b, s, h * d))


class ReferenceAttention(nn.Module):
    """Minimal attention layer following the protocol: projections, RoPE, ``core_attention``.

    ``forward(x [B, S, hidden], position_ids [S] or [B, S]) -> [B, S, hidden]``. Under context
    parallelism ``x`` and ``position_ids`` are this rank's shards (same rule) and so is the result.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_base: float = 10000.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden // num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"ReferenceAttention: num_heads {num_heads} must be a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        self.rope_base = rope_base
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)
        self.core_attention: nn.Module = CoreAttention()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, causal: bool = True,
                stats: CommStats | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, position_ids, self.rope_base)
        k = apply_rotary(k, position_ids, self.rope_base)
        out = self.core_attention(q, k, v, causal=causal, stats=stats)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))
