"""``ContextParallel``: make an attention layer's core attention work on local sequence shards.

The attention-core protocol (``overlap_runtime.layers.core_attention``): a layer takes part if it
exposes ``core_attention``, a submodule called as ``core_attention(q, k, v, causal=True,
stats=None)`` with ``q`` ``[B, S, Hq, D]``, ``k``, ``v`` ``[B, S, Hkv, D]`` (after projection and
RoPE) returning ``[B, S, Hq, D]`` in q's dtype, with ``softmax_scale`` on it (None:
``D ** -0.5``). Everything else in the layer (projections, RoPE, output projection) is
token-wise, so it runs unchanged on a shard as long as the caller hands it the shard's
**position ids** (split by the same rule as the tokens: :meth:`ContextParallel.shard` and
:meth:`ContextParallel.position_ids` use the rule the wrapper was built with).

``ContextParallel(mode, load_balance).apply(layer, cp_mesh)`` replaces the layer's single-device
``core_attention`` (``layers.CoreAttention``) with a :class:`ContextParallelCoreAttention` bound
to ``cp_mesh``'s group; from then on the layer's forward takes local shards ``[B, S/P, hidden]``
and returns local shards. ``layers.ReferenceAttention`` is the minimal layer to try it on.

``stats`` is a per-call :class:`CommStats` the *caller* passes through the layer's forward;
neither core keeps per-call state.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.context_parallel.all_gather_kv import all_gather_kv_attention
from overlap_runtime.context_parallel.hierarchical import hierarchical_attention, mesh_groups
from overlap_runtime.context_parallel.ring import ring_attention
from overlap_runtime.context_parallel.sharding import (
    LoadBalance,
    check_load_balance,
    check_sequence_length,
    shard_positions,
    shard_sequence,
)
from overlap_runtime.context_parallel.ulysses import ulysses_attention
from overlap_runtime.ops.attention import Backend
from overlap_runtime.ops.comm_stats import CommStats
from .packed import PackedLayout
from .varlen_attention import packed_ring_attention, packed_ulysses_attention

Mode = Literal["ulysses", "ring", "all_gather_kv", "hierarchical"]
MODES: tuple[str, ...] = ("ulysses", "ring", "all_gather_kv", "hierarchical")

_CP_FUNCS = {"ulysses": ulysses_attention, "ring": ring_attention,
             "all_gather_kv": all_gather_kv_attention}


class ContextParallelCoreAttention(nn.Module):
    """Core attention over local shards of a sequence split across ``group``.

    Holds configuration only (mode, load balance, group, scale, timeout); each call's
    communication record goes to the ``stats`` the caller passes. ``group``: the CP process
    group, or for ``mode="hierarchical"`` the pair ``(a2a_group, ring_group)``.
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

    #: Accepts ``cu_seqlens`` (packed documents); layers check this flag.
    supports_packed = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                stats: CommStats | None = None, cu_seqlens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Local shards q ``[B, S/P, Hq, D]``, k/v ``[B, S/P, Hkv, D]`` -> ``[B, S/P, Hq, D]``.

        ``cu_seqlens``: packed documents over the ``B * S`` tokens of the whole rows (global,
        the same on every rank): causal within each document, tokens dealt by this wrapper's
        rule as a :class:`~.packed.PackedLayout` (``load_balance=None`` -> ``contiguous``,
        ``"zigzag"`` -> ``zigzag``); ring and ulysses only (``varlen_attention.py``).
        """
        if cu_seqlens is not None:
            return self._packed(q, k, v, causal, cu_seqlens)
        if self.mode == "hierarchical":
            a2a_group, ring_group = self.group
            return hierarchical_attention(q, k, v, a2a_group, ring_group, causal=causal,
                                          load_balance=self.load_balance,
                                          scale=self.softmax_scale, timeout_s=self.timeout_s,
                                          stats=stats, backend=self.backend)
        fn = _CP_FUNCS[self.mode]
        return fn(q, k, v, group=self.group, causal=causal, load_balance=self.load_balance,
                  scale=self.softmax_scale, timeout_s=self.timeout_s, stats=stats,
                  backend=self.backend)

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.mode not in ("ring", "ulysses") or not causal:
            raise NotImplementedError(
                f"ContextParallel(mode={self.mode!r}) with cu_seqlens (packed documents, "
                f"causal={causal}): packed batches run causal attention in modes 'ring' and "
                f"'ulysses' only")
        world = dist.get_world_size(self.group)
        layout = PackedLayout.from_cu_seqlens(
            cu_seqlens, q.shape[0], q.shape[1] * world, world,
            "contiguous" if self.load_balance is None else "zigzag")
        fn = packed_ring_attention if self.mode == "ring" else packed_ulysses_attention
        return fn(q, k, v, layout, self.group, self.softmax_scale, self.timeout_s)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, load_balance={self.load_balance!r}"


class ContextParallel:
    """Context parallelism for full attention: ``ContextParallel(mode, load_balance).apply(m, mesh)``.

    Args:
        mode: ``"ulysses"`` (heads % cp == 0), ``"ring"`` (P2P ring, online softmax),
            ``"all_gather_kv"`` or ``"hierarchical"`` (Ulysses inside, ring across:
            ``hierarchical.py``; :meth:`apply` then takes the 2-D ``("cp_ring", "cp_a2a")``
            mesh of ``hierarchical.hierarchical_cp_mesh``, and :meth:`shard` /
            :meth:`position_ids` split by the flat rule over its ``R x A`` ranks).
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

    def _check_mesh(self, cp_mesh: DeviceMesh) -> tuple[int, int]:
        """``(cp size, this rank's flat CP rank)``; raises on a mesh of the wrong shape."""
        if not isinstance(cp_mesh, DeviceMesh):
            raise TypeError(f"cp_mesh must be a torch.distributed DeviceMesh, got "
                            f"{type(cp_mesh).__name__}")
        if self.mode == "hierarchical":
            if cp_mesh.ndim != 2:
                raise ValueError(
                    f"ContextParallel(mode='hierarchical') needs the 2-D (ring, a2a) CP mesh "
                    f"(hierarchical.hierarchical_cp_mesh(mesh['cp'], a2a)), got a "
                    f"{cp_mesh.ndim}-D mesh of shape {tuple(cp_mesh.shape)}")
            ring_rank, a2a_rank = cp_mesh.get_local_rank(0), cp_mesh.get_local_rank(1)
            return cp_mesh.size(), ring_rank * cp_mesh.size(1) + a2a_rank
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be 1-D (the CP dimension alone), got a {cp_mesh.ndim}-D "
                             f"mesh of shape {tuple(cp_mesh.shape)}; pass mesh['cp']")
        return cp_mesh.size(), cp_mesh.get_local_rank()

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
        group = mesh_groups(cp_mesh) if self.mode == "hierarchical" else cp_mesh.get_group()
        attention_module.core_attention = ContextParallelCoreAttention(
            self.mode, self.load_balance, group,
            getattr(core, "softmax_scale", None), self.timeout_s, self.backend)
        return attention_module

    def shard(self, x: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence tensor, by this wrapper's rule."""
        size, rank = self._check_mesh(cp_mesh)
        return shard_sequence(x, size, rank, seq_dim, self.load_balance)

    def position_ids(self, seq_len: int, cp_mesh: DeviceMesh,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """Position ids ``[seq_len / P]`` (int64) of this rank's tokens, by this wrapper's rule."""
        size, rank = self._check_mesh(cp_mesh)
        check_sequence_length(seq_len, size, self.load_balance)
        return shard_positions(seq_len, size, rank, self.load_balance, device)
