"""``ParallelDims``: the one owner of the trainer's parallel layout and of every DeviceMesh.

::

    world = pp x dp_replicate x dp_shard x cp            (rank order: pp outermost, cp innermost)

    world mesh  ("pp", "dp_replicate", "dp_shard", "cp")
    expert mesh ("pp", "dp_replicate", "efsdp", "ep")     efsdp x ep == dp_shard x cp

Degrees and what each dimension carries:

==============  =========================================================================
``pp``          pipeline stages: ranks with different pipeline coordinates hold different
                layers; the point-to-point activations of a schedule travel over ``pp``.
``dp_replicate`` replicas (HSDP's outer dimension): parameters replicated, gradients all-reduced.
``dp_shard``    FSDP2 shards parameters over ``dp_shard x cp`` (``"dp_shard_cp"``).
``cp``          context parallelism: the ranks of one sequence, contiguous shards.
``ep``          expert parallelism, **borrowed from dp_shard x cp** (the torchtitan rule).
==============  =========================================================================

Why EP borrows from ``dp_shard x cp``: the MoE all-to-all is token-wise, so any ranks of one
pipeline stage that hold *different tokens* can exchange them; that is every rank of the
``dp_shard x cp`` block of one ``(pp, dp_replicate)`` coordinate. Borrowing from ``pp`` is
impossible (different layers), and borrowing from ``dp_replicate`` would tie replicas that must
stay independent (HSDP replicas typically sit on different nodes). Megatron borrows the same way
(its expert-data-parallel group is what remains of ``dp x cp``). So ``ep`` must divide
``dp_shard * cp``; the routed experts' parameters are sharded over the remaining factor
``efsdp = dp_shard * cp / ep`` (their gradients are partial sums over ``efsdp`` and
``dp_replicate``), every other parameter over ``dp_shard x cp``.

Meshes by name (:meth:`ParallelDims.mesh`): ``"pp"``, ``"cp"``, ``"ep"``, ``"efsdp"``,
``"dp"`` (``dp_replicate x dp_shard``: who gets different data rows), ``"dp_shard_cp"`` (FSDP),
``"dp_cp"`` (``dp_replicate x dp_shard x cp``: the loss and token-count reduction), and
``"fsdp"`` / ``"expert_fsdp"``: the (1-D, or 2-D for HSDP) meshes ``fully_shard`` takes; with
``cp_a2a`` (hierarchical attention CP) also ``"cp_hierarchical"`` (2-D ``(cp_ring, cp_a2a)``),
``"cp_ring"`` and ``"cp_a2a"``.
A size-1 dimension still gets its mesh, so code never branches on "is this dimension used".

The degrees, their rules (:meth:`~overlap_runtime.config.layout.Layout.layout_problems`, no
process group: the YAML loader reports every broken rule at load time) and the rank coordinates
are :class:`~overlap_runtime.config.layout.Layout`'s; ``ParallelDims`` adds the meshes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlap_runtime.config.layout import Layout
from overlap_runtime.context_parallel.hierarchical import hierarchical_cp_mesh

_WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp")
_EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass(frozen=True)
class ParallelDims(Layout):
    """A :class:`~overlap_runtime.config.layout.Layout` that owns the run's DeviceMeshes (see the
    module docstring); the arguments are ``Layout``'s."""

    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, layout: Layout) -> "ParallelDims":
        """The mesh owner of ``layout`` (same degrees; :meth:`build_meshes` makes the meshes)."""
        return cls(world_size=layout.world_size, dp_shard=layout.dp_shard, cp=layout.cp,
                   pp=layout.pp, ep=layout.ep, dp_replicate=layout.dp_replicate,
                   cp_a2a=layout.cp_a2a)

    # -- meshes ----------------------------------------------------------------------------
    def build_meshes(self, device_type: str) -> None:
        """Create every DeviceMesh (a collective call: every rank of the world calls it once)."""
        world = init_device_mesh(device_type, self.world_shape, mesh_dim_names=_WORLD_DIMS)
        expert = DeviceMesh(
            device_type,
            torch.arange(self.world_size).view(self.pp, self.dp_replicate, self.efsdp, self.ep),
            mesh_dim_names=_EXPERT_DIMS,
        )
        m = self._meshes
        m.clear()
        m["world"], m["expert"] = world, expert
        for name in ("pp", "dp_replicate", "dp_shard", "cp"):
            m[name] = world[name]
        m["ep"], m["efsdp"] = expert["ep"], expert["efsdp"]
        m["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        m["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        m["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        if self.cp_a2a is not None:  # hierarchical attention CP: cp rank = ring * a2a + a
            m["cp_hierarchical"] = hierarchical_cp_mesh(m["cp"], self.cp_a2a)
            m["cp_ring"], m["cp_a2a"] = m["cp_hierarchical"]["cp_ring"], \
                m["cp_hierarchical"]["cp_a2a"]
        if self.dp_replicate > 1:  # HSDP: replicate outer, shard inner
            m["fsdp"] = world["dp_replicate", "dp_shard_cp"]
            m["expert_fsdp"] = expert["dp_replicate", "efsdp"]
        else:
            m["fsdp"] = m["dp_shard_cp"]
            m["expert_fsdp"] = m["efsdp"]

    def mesh(self, name: str) -> Any:
        """The DeviceMesh called ``name`` (see the module docstring); after :meth:`build_meshes`."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.mesh: call build_meshes(device_type) first (on every "
                               "rank of the world)")
        try:
            return self._meshes[name]
        except KeyError:
            raise KeyError(f"no mesh named {name!r}; known: {sorted(self._meshes)}") from None
