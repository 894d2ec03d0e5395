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

Validation (:meth:`ParallelDims.layout_problems`) needs no process group, so the YAML loader reports every
broken rule at load time, naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParallelDims"]

_WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp")
_EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


def _resolve_dp_shard(world_size: int, dp_shard: int, cp: int, pp: int, dp_replicate: int) -> int:
    """``dp_shard``, or for -1 what ``pp x dp_replicate x cp`` leave of the world (when whole)."""
    if dp_shard != -1:
        return dp_shard
    rest = pp * dp_replicate * cp
    if rest >= 1 and world_size % rest == 0:
        return world_size // rest
    return dp_shard


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one training run (see the module docstring).

    Args:
        world_size: ranks in the job; must equal ``pp * dp_replicate * dp_shard * cp``.
        dp_shard: FSDP2 shard degree; ``-1`` takes what is left of the world (like torchtitan).
        cp, pp, ep, dp_replicate: the other degrees (1 = off).
        cp_a2a: the inner (all-to-all) degree of hierarchical attention CP, or None (no such
            layer): then :meth:`build_meshes` also builds the 2-D ``"cp_hierarchical"`` mesh
            ``("cp_ring", "cp_a2a")`` of the cp dimension (``cp / cp_a2a`` x ``cp_a2a``).
    """

    world_size: int
    dp_shard: int = -1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    cp_a2a: int | None = None
    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp_shard", _resolve_dp_shard(
            self.world_size, self.dp_shard, self.cp, self.pp, self.dp_replicate))
        problems = self.layout_problems(self.world_size, self.dp_shard, self.cp, self.pp,
                                        self.ep, self.dp_replicate)
        if self.cp_a2a is not None and (self.cp_a2a < 1 or self.cp % self.cp_a2a):
            problems.append(f"cp_a2a={self.cp_a2a} must divide cp={self.cp}")
        if problems:
            raise ValueError("invalid parallel layout:\n  " + "\n  ".join(problems))

    # -- validation ---------------------------------------------------------------------------
    @staticmethod
    def layout_problems(world_size: int, dp_shard: int, cp: int, pp: int, ep: int,
                        dp_replicate: int, prefix: str = "") -> list[str]:
        """Every rule the degrees break, one message each (empty: valid); no process group.

        ``dp_shard = -1`` is resolved first. ``prefix`` is prepended to field names
        (``"train.accelerator."`` in the trainer's configuration).
        """
        p = prefix
        dp_shard = _resolve_dp_shard(world_size, dp_shard, cp, pp, dp_replicate)
        values = {"world_size": world_size, "dp_shard": dp_shard, "cp": cp, "pp": pp, "ep": ep,
                  "dp_replicate": dp_replicate}
        out: list[str] = []
        for name, value in values.items():
            if name == "dp_shard" and value == -1:
                continue
            if not isinstance(value, int) or value < 1:
                out.append(f"{p}{name}={value!r} must be a positive integer"
                           + (" (or -1: the rest of the world)" if name == "dp_shard" else ""))
        if out:
            return out
        if dp_shard == -1:  # -1 was not resolved: the other degrees do not divide the world
            rest = pp * dp_replicate * cp
            what = (f"{p}cp={cp}" if pp == 1 and dp_replicate == 1 else
                    f"{p}pp={pp} x {p}dp_replicate={dp_replicate} x {p}cp={cp} = {rest}")
            return [f"{what} does not divide {p}world_size={world_size} (dp_shard=-1 takes what "
                    f"the other degrees leave of the world)"]
        product = pp * dp_replicate * dp_shard * cp
        if product != world_size:
            out.append(f"{p}pp={pp} x {p}dp_replicate={dp_replicate} x {p}dp_shard={dp_shard} "
                       f"x {p}cp={cp} = {product} must equal {p}world_size={world_size}")
        if (dp_shard * cp) % ep:
            out.append(f"{p}ep={ep} must divide {p}dp_shard x {p}cp = {dp_shard} x {cp} = "
                       f"{dp_shard * cp} (expert parallelism borrows its ranks from the "
                       f"data/context dimensions)")
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
        if self.cp_a2a is not None:  # hierarchical attention CP: cp rank = ring * a2a + a
            from overlap_runtime.context_parallel.hierarchical import hierarchical_cp_mesh

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
