"""ExpertParallel and OverlapExpertParallel: put MoE layers on an EP group.

``ExpertParallel().apply(module, ep_mesh)`` works on a :class:`MoE` or on any module that
contains MoE layers (a pipeline chunk): each MoE keeps the experts of its EP rank
(``E / ep_size`` consecutive ones) and gets an :class:`AllToAllTokenDispatcher` over the EP
group. Everything else (router, shared expert) stays replicated.

``OverlapExpertParallel(coordinator).apply(chunk, ep_mesh)`` does the same and adds the sync
hooks of the HookCoordinator around each layer's all-to-alls::

    A  dispatch(counts, tokens)  B    experts    C  combine  D   (D_LAST on the chunk's last MoE)

so that a :class:`CommComputeOverlap` run can interleave the all-to-alls of a forward chunk and
a backward chunk on one rank. Every all-to-all then goes through the coordinator's serializer
(one in flight per EP group, launches logged in debug mode).

``is_last_layer`` is inferred from the chunk structure by default: the MoE layers of the
module given to ``apply`` are numbered in registration order (``module.modules()``), which is
their execution order for sequential chunks, and the last one closes with ``D_LAST``. Passing
``is_last_layer=True/False`` sets it by hand for a single MoE layer (``layer`` gives its index).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.pipeline.deferred_w import DeferredWQueue

from .dispatcher import AllToAllTokenDispatcher, OverlapHooks, SpanSink
from .layer import MoE


def ep_group_of(ep_mesh: Any) -> dist.ProcessGroup:
    """The EP process group of ``ep_mesh``: a 1-D DeviceMesh, a mesh with an ``"ep"`` dim, or a
    ProcessGroup."""
    if isinstance(ep_mesh, dist.ProcessGroup):
        return ep_mesh
    names = getattr(ep_mesh, "mesh_dim_names", None)
    ndim = getattr(ep_mesh, "ndim", None)
    if ndim is None:
        raise TypeError(f"ep_mesh must be a DeviceMesh or a ProcessGroup, got "
                        f"{type(ep_mesh).__name__}")
    if ndim == 1:
        return ep_mesh.get_group()
    if names and "ep" in names:
        return ep_mesh["ep"].get_group()
    raise ValueError(f"ep_mesh has {ndim} dims {names}; give a 1-D mesh or one with an 'ep' dim")


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers inside ``module`` (itself included), in registration order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def infer_last_layer_flags(module: nn.Module) -> list[bool]:
    """``is_last_layer`` of each MoE layer of ``module`` as ``OverlapExpertParallel`` infers it."""
    layers = moe_layers(module)
    return [i == len(layers) - 1 for i in range(len(layers))]


class ExpertParallel:
    """Shard MoE experts over an EP group (see the module doc).

    Args:
        tag_prefix: prefix of the all-to-all tags (e.g. ``"S2."`` for stage 2); must be the
            same on every EP rank for the same layer.
        trace: span sink for all-to-all (and hook) spans, e.g. an ``ExecutionTrace``.
        timeout_s: bound of every communication wait.
        deferred_w: the rank's ``DeferredWQueue``: every layer's experts defer their weight
            gradients to it while it captures and its dispatcher flushes it in the all-to-all
            windows (``MoE.defer_weight_gradients``). None: immediate gradients.
    """

    def __init__(self, *, tag_prefix: str = "", trace: SpanSink | None = None,
                 timeout_s: float | None = None, deferred_w: DeferredWQueue | None = None) -> None:
        self.tag_prefix = tag_prefix
        self.trace = trace
        self.timeout_s = timeout_s
        self.deferred_w = deferred_w

    def apply(self, module: nn.Module, ep_mesh: Any) -> nn.Module:
        """Shard every MoE layer of ``module`` over ``ep_mesh``'s group; returns ``module``."""
        layers = moe_layers(module)
        if not layers:
            raise ValueError(f"{type(self).__name__}.apply: {type(module).__name__} contains no "
                             f"MoE layer")
        group = ep_group_of(ep_mesh)
        ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
        for i, moe in enumerate(layers):
            if moe.dispatcher.group is not None:
                raise RuntimeError(f"{type(self).__name__}.apply: MoE layer {i} is already "
                                   f"expert-parallel ({moe.dispatcher})")
            moe.experts.shard_(ep_rank, ep_size)
            moe.dispatcher = AllToAllTokenDispatcher(
                moe.num_experts, group, tag=f"{self.tag_prefix}L{self._index(i)}", hooks=self._hooks(i, layers),
                trace=self.trace, timeout_s=self.timeout_s)
            if self.deferred_w is not None:
                moe.defer_weight_gradients(self.deferred_w)
        return module

    def _hooks(self, index: int, layers: list[MoE]) -> OverlapHooks | None:
        return None

    def _index(self, index: int) -> int:
        return index


class OverlapExpertParallel(ExpertParallel):
    """ExpertParallel plus the A/B/C/D(/D_LAST) sync hooks of a :class:`HookCoordinator`.

    Args:
        coordinator: the run's HookCoordinator, or the CommComputeOverlap that owns it.
        is_last_layer: None (default) infers it from the chunk; True/False sets it for a
            single MoE layer (``apply`` on a module with several MoE layers then raises).
        layer: index of a single MoE layer in its chunk when set by hand (hooks and messages).
    """

    def __init__(self, coordinator: HookCoordinator | CommComputeOverlap,
                 is_last_layer: bool | None = None, *, layer: int | None = None,
                 tag_prefix: str = "", trace: SpanSink | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__(tag_prefix=tag_prefix, trace=trace, timeout_s=timeout_s)
        if isinstance(coordinator, CommComputeOverlap):
            coordinator = coordinator.coordinator
        if not isinstance(coordinator, HookCoordinator):
            raise TypeError(f"OverlapExpertParallel: expected a HookCoordinator or "
                            f"CommComputeOverlap, got {type(coordinator).__name__}")
        self.coordinator = coordinator
        self.is_last_layer = is_last_layer
        self.layer = layer

    def apply(self, module: nn.Module, ep_mesh: Any) -> nn.Module:
        n = len(moe_layers(module))
        if self.is_last_layer is not None and n != 1:
            raise ValueError(f"OverlapExpertParallel(is_last_layer={self.is_last_layer}) is for "
                             f"one MoE layer, but {type(module).__name__} contains {n}; leave "
                             f"is_last_layer=None to infer it from the chunk")
        if self.layer is not None and n != 1:
            raise ValueError(f"OverlapExpertParallel(layer={self.layer}) is for one MoE layer, "
                             f"but {type(module).__name__} contains {n}")
        if self.layer is not None and self.is_last_layer is None:
            raise ValueError("OverlapExpertParallel(layer=...) on a single layer needs "
                             "is_last_layer=True/False too (nothing to infer it from)")
        return super().apply(module, ep_mesh)

    def _hooks(self, index: int, layers: list[MoE]) -> OverlapHooks:
        last = self.is_last_layer if self.is_last_layer is not None else index == len(layers) - 1
        return OverlapHooks(self.coordinator, self._index(index), bool(last))

    def _index(self, index: int) -> int:
        return self.layer if self.layer is not None else index

    def __repr__(self) -> str:
        return (f"OverlapExpertParallel(is_last_layer={self.is_last_layer}, layer={self.layer}, "
                f"tag_prefix={self.tag_prefix!r})")
