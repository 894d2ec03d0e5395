"""``ContextParallel``: make an attention module's core attention work on local sequence shards.

The protocol
------------
An attention module takes part if it exposes ``core_attention``: a submodule called as
``core_attention(q, k, v, causal=True, stats=None)`` with ``q`` ``[B, S, Hq, D]``, ``k``, ``v``
``[B, S, Hkv, D]`` (after projection and RoPE) returning ``[B, S, Hq, D]`` in q's dtype; and
``softmax_scale`` on it (None: ``D ** -0.5``). Everything else in the module (projections, RoPE,
output projection) is token-wise, so it runs unchanged on a shard as long as the caller hands it
the shard's **position ids** (split by the same rule as the tokens: :meth:`ContextParallel.shard`
and :meth:`ContextParallel.position_ids` use the rule the wrapper was built with).

:class:`CoreAttention` is the single-device implementation; :class:`ReferenceAttention` is a
minimal module following the protocol (q/k/v/o projections, GQA, RoPE). ``ContextParallel(mode,
load_balance).apply(module, cp_mesh)`` replaces ``module.core_attention`` with a
:class:`ContextParallelCoreAttention` bound to ``cp_mesh``'s group; from then on the module's
forward takes local shards ``[B, S/P, hidden]`` and returns local shards.

``stats`` is a per-call :class:`CommStats` the *caller* passes through the module's forward;
neither wrapper keeps per-call state.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.context_parallel.all_gather_kv import all_gather_kv_attention
from overlap_runtime.context_parallel.ring import ring_attention
from overlap_runtime.context_parallel.sharding import (
    LoadBalance,
    check_load_balance,
    check_sequence_length,
    shard_positions,
    shard_sequence,
)
from overlap_runtime.ops.comm_stats import CommStats
from overlap_runtime.context_parallel.ulysses import ulysses_attention
from overlap_runtime.ops.attention import Backend, attention

Mode = Literal["ulysses", "ring", "all_gather_kv"]
MODES: tuple[str, ...] = ("ulysses", "ring", "all_gather_kv")

__all__ = [
    "Mode",
    "MODES",
    "HasCoreAttention",
    "CoreAttention",
    "ContextParallelCoreAttention",
    "ContextParallel",
    "ReferenceAttention",
    "apply_rotary",
]

_CP_FUNCS = {"ulysses": ulysses_attention, "ring": ring_attention,
             "all_gather_kv": all_gather_kv_attention}


@runtime_checkable
class HasCoreAttention(Protocol):
    """What :meth:`ContextParallel.apply` needs from an attention module."""

    core_attention: nn.Module


class CoreAttention(nn.Module):
    """Single-device core attention: ``(q, k, v, causal, stats) -> out`` (``ops.attention``)."""

    def __init__(self, softmax_scale: float | None = None, backend: Backend = "math") -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                stats: CommStats | None = None) -> torch.Tensor:
        """q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` -> ``[B, S, Hq, D]`` (q's dtype)."""
        return attention(q, k, v, causal, self.softmax_scale, self.backend)


class ContextParallelCoreAttention(nn.Module):
    """Core attention over local shards of a sequence split across ``group``.

    Holds configuration only (mode, load balance, group, scale, timeout); each call's
    communication record goes to the ``stats`` the caller passes.
    """

    def __init__(self, mode: Mode, load_balance: LoadBalance, group: Any,
                 softmax_scale: float | None = None, timeout_s: float | None = None,
                 backend: Backend = "math") -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"ContextParallel mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.load_balance = check_load_balance(load_balance)
        self.group = group
        self.softmax_scale = softmax_scale
        self.timeout_s = timeout_s
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                stats: CommStats | None = None) -> torch.Tensor:
        """Local shards q ``[B, S/P, Hq, D]``, k/v ``[B, S/P, Hkv, D]`` -> ``[B, S/P, Hq, D]``."""
        fn = _CP_FUNCS[self.mode]
        return fn(q, k, v, group=self.group, causal=causal, load_balance=self.load_balance,
                  scale=self.softmax_scale, timeout_s=self.timeout_s, stats=stats,
                  backend=self.backend)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, load_balance={self.load_balance!r}"


class ContextParallel:
    """Context parallelism for full attention: ``ContextParallel(mode, load_balance).apply(m, mesh)``.

    Args:
        mode: ``"ulysses"`` (heads % cp == 0), ``"ring"`` (P2P ring, online softmax) or
            ``"all_gather_kv"``.
        load_balance: ``"zigzag"`` (rank r holds chunks r and 2P-1-r; seq % 2P == 0) or None
            (contiguous; seq % P == 0). Inputs must be split by the same rule
            (:meth:`shard`, :meth:`position_ids`).
        timeout_s: bound on every communication wait (default: ``comm.DEFAULT_TIMEOUT_S``).
    """

    def __init__(self, mode: Mode = "ring", load_balance: LoadBalance = "zigzag",
                 timeout_s: float | None = None, backend: Backend = "math") -> None:
        if mode not in MODES:
            raise ValueError(f"ContextParallel mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.load_balance = check_load_balance(load_balance)
        self.timeout_s = timeout_s
        self.backend = backend

    @staticmethod
    def _check_mesh(cp_mesh: DeviceMesh) -> None:
        if not isinstance(cp_mesh, DeviceMesh):
            raise TypeError(f"cp_mesh must be a torch.distributed DeviceMesh, got "
                            f"{type(cp_mesh).__name__}")
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be 1-D (the CP dimension alone), got a {cp_mesh.ndim}-D "
                             f"mesh of shape {tuple(cp_mesh.shape)}; pass mesh['cp']")

    def apply(self, attention_module: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
        """Replace ``attention_module.core_attention`` by the CP version; return the module.

        Raises if the module has no ``core_attention`` submodule or it is already context
        parallel (applying twice would split the sequence twice).
        """
        self._check_mesh(cp_mesh)
        core = getattr(attention_module, "core_attention", None)
        if not isinstance(core, nn.Module):
            raise TypeError(f"ContextParallel.apply: {type(attention_module).__name__} has no "
                            f"'core_attention' submodule (the protocol: core_attention(q, k, v, "
                            f"causal, stats) on [B, S, H, D] tensors)")
        if isinstance(core, ContextParallelCoreAttention):
            raise ValueError(f"ContextParallel.apply: {type(attention_module).__name__} is already "
                             f"context parallel ({core.extra_repr()})")
        attention_module.core_attention = ContextParallelCoreAttention(
            self.mode, self.load_balance, cp_mesh.get_group(),
            getattr(core, "softmax_scale", None), self.timeout_s, self.backend)
        return attention_module

    def shard(self, x: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence tensor, by this wrapper's rule."""
        self._check_mesh(cp_mesh)
        return shard_sequence(x, cp_mesh.size(), cp_mesh.get_local_rank(), seq_dim,
                              self.load_balance)

    def position_ids(self, seq_len: int, cp_mesh: DeviceMesh,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """Position ids ``[seq_len / P]`` (int64) of this rank's tokens, by this wrapper's rule."""
        self._check_mesh(cp_mesh)
        check_sequence_length(seq_len, cp_mesh.size(), self.load_balance)
        return shard_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(),
                               self.load_balance, device)


# --------------------------------------------------------------------------- reference module


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half form) at the given absolute positions.

    Args:
        x: ``[B, S, H, D]`` (D even); position_ids: ``[S]`` or ``[B, S]`` integer positions.

    Returns:
        x's shape and dtype; the angles are computed in float32.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"apply_rotary: head dim {d} must be even")
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    pos = position_ids.to(device=x.device, dtype=torch.float32)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    ang = pos.unsqueeze(-1) * inv_freq                                  # [B|1, S, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(2)            # [B|1, S, 1, D]
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(2)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class ReferenceAttention(nn.Module):
    """Minimal attention module following the protocol: projections, RoPE, ``core_attention``.

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
