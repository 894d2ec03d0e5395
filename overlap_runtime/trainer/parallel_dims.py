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
``"fsdp"`` / ``"expert_fsdp"``: the (1-D, or 2-D for HSDP) meshes ``fully_shard`` takes.
A size-1 dimension still gets its mesh, so code never branches on "is this dimension used".

Validation (:meth:`ParallelDims.problems`) needs no process group, so the YAML loader reports every
broken rule at load time, naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParallelDims"]

_WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp")
_EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one training run (see the module docstring).

    Args:
        world_size: ranks in the job; must equal ``pp * dp_replicate * dp_shard * cp``.
        dp_shard: FSDP2 shard degree; ``-1`` takes what is left of the world (like torchtitan).
        cp, pp, ep, dp_replicate: the other degrees (1 = off).
    """

    world_size: int
    dp_shard: int = -1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.cp
            if rest >= 1 and self.world_size % rest == 0:
                object.__setattr__(self, "dp_shard", self.world_size // rest)
        problems = self.problems()
        if problems:
            raise ValueError("invalid parallel layout:\n  " + "\n  ".join(problems))

    # -- validation ---------------------------------------------------------------------------
    def problems(self, prefix: str = "") -> list[str]:
        """Every rule the degrees break, one message each (empty: valid).

        ``prefix`` is prepended to field names (``"train.accelerator."`` in the trainer).
        """
        p = prefix
        out: list[str] = []
        for name in ("world_size", "dp_shard", "cp", "pp", "ep", "dp_replicate"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                out.append(f"{p}{name}={value!r} must be a positive integer"
                           + (" (or -1: the rest of the world)" if name == "dp_shard" else ""))
        if out:
            return out
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp
        if product != self.world_size:
            out.append(f"{p}pp={self.pp} x {p}dp_replicate={self.dp_replicate} x "
                       f"{p}dp_shard={self.dp_shard} x {p}cp={self.cp} = {product} must equal "
                       f"{p}world_size={self.world_size}")
        if (self.dp_shard * self.cp) % self.ep:
            out.append(f"{p}ep={self.ep} must divide {p}dp_shard x {p}cp = "
                       f"{self.dp_shard} x {self.cp} = {self.dp_shard * self.cp} (expert "
                       f"parallelism borrows its ranks from the data/context dimensions)")
        return out

    # -- derived degrees -------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree (different data rows): ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Shard degree of the routed experts: ``dp_shard * cp / ep``."""
        return self.dp_shard * self.cp // self.ep

    @property
    def world_shape(self) -> tuple[int, int, int, int]:
        """``(pp, dp_replicate, dp_shard, cp)``."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinates of global ``rank`` on every named dimension (no process group)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        cp = rank % self.cp
        rest = rank // self.cp
        dp_shard = rest % self.dp_shard
        rest //= self.dp_shard
        dp_replicate = rest % self.dp_replicate
        pp = rest // self.dp_replicate
        block = dp_shard * self.cp + cp  # position in the dp_shard x cp block
        return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp,
                "dp": dp_replicate * self.dp_shard + dp_shard, "ep": block % self.ep,
                "efsdp": block // self.ep}

    def describe(self) -> str:
        """``pp2 x dp_shard2 x cp1 (ep2)``-style summary."""
        parts = [f"pp{self.pp}", f"dp_replicate{self.dp_replicate}", f"dp_shard{self.dp_shard}",
                 f"cp{self.cp}"]
        return " x ".join(parts) + f" (ep{self.ep} over dp_shard x cp)"

    # -- meshes ----------------------------------------------------------------------------
    def build_meshes(self, device_type: str) -> None:
        """Create every DeviceMesh (a collective call: every rank of the world calls it once)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
