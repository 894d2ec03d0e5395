"""``Layout``: the parallel degrees of a run, their rules and derived dimensions (pure data).

::

    world = pp x dp_replicate x dp_shard x cp            (rank order: pp outermost, cp innermost)
    expert view (pp, dp_replicate, efsdp, ep)             efsdp x ep == dp_shard x cp

``ep`` is borrowed from ``dp_shard x cp`` (``trainer.parallel_dims`` explains why and builds one
DeviceMesh per dimension from a ``Layout``). :meth:`Layout.layout_problems` lists every rule the
degrees break with no process group, so the YAML loader reports them at load time, naming the
fields; :func:`split_layers` is the pipeline's split of the decoder layers into stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

def _resolve_dp_shard(world_size: int, dp_shard: int, cp: int, pp: int, dp_replicate: int) -> int:
    """``dp_shard``, or for -1 what ``pp x dp_replicate x cp`` leave of the world (when whole)."""
    if dp_shard != -1:
        return dp_shard
    rest = pp * dp_replicate * cp
    if rest >= 1 and world_size % rest == 0:
        return world_size // rest
    return dp_shard


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one training run (see the module docstring); no process group.

    Args:
        world_size: ranks in the job; must equal ``pp * dp_replicate * dp_shard * cp``.
        dp_shard: FSDP2 shard degree; ``-1`` takes what is left of the world (like torchtitan).
        cp, pp, ep, dp_replicate: the other degrees (1 = off).
        cp_a2a: the inner (all-to-all) degree of hierarchical attention CP, or None (no such
            layer): the trainer's ``ParallelDims`` then also builds the 2-D ``"cp_hierarchical"``
            mesh ``("cp_ring", "cp_a2a")`` of the cp dimension (``cp / cp_a2a`` x ``cp_a2a``).
    """

    world_size: int
    dp_shard: int = -1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    cp_a2a: int | None = None

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


def split_layers(num_layers: int, num_stages: int,
                 layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Decoder-layer index ranges of each stage (see the module docstring for the rule).

    Raises:
        ValueError: more stages than layers, or ``layers_per_stage`` that does not have
            ``num_stages`` positive entries summing to ``num_layers``.
    """
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages for {num_layers} decoder layers: every "
                         f"stage must hold at least one layer (1 <= stages <= layers)")
    if layers_per_stage is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"layers_per_stage={counts} must have {num_stages} entries, each "
                             f">= 1, summing to {num_layers}")
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out
