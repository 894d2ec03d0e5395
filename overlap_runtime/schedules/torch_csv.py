"""Schedules to and from torch.distributed.pipelining's CSV files, and running a table as is.

Our text form is torch's (``2F0``, ``0SEND_F1``...) with two differences at the boundary:

* **OVERLAP_B_F.** torch's ``_ComputationType`` has ``OVERLAP_F_B`` only, so ``(1B3;0F4)
  OVERLAP_B_F`` does not load there. :func:`to_torch_csv` writes each such pair as ``(0F4;1B3)
  OVERLAP_F_B``: the same two sub-actions, forward first, which is the order torch's runtime
  runs them in when no callback is registered (ours runs the pair on two threads either way).
* **FSDP actions.** torch's lowering adds ``UNSHARD``/``RESHARD`` (``1UNSHARD``, no microbatch)
  and ``REDUCE_GRAD`` to its ``pipeline_order_with_comms``, which ``_dump_csv`` writes by
  default. Rule (:func:`load_torch_csv`, ``fsdp="skip"``): those cells are dropped, with no
  bubble left in their place. Our runtime leaves unsharding, resharding and gradient reduction
  to FSDP2's own module hooks (``fully_shard``: all-gather before a stage's forward and
  backward, reduce-scatter after its backward), which is how the trainer uses FSDP2 with the
  pipeline; explicit steps for them would run the same collectives twice. ``fsdp="error"``
  refuses such a file instead, naming the first cell.

:func:`compile_table` then treats the loaded table (compute-only or lowered) the way
:func:`~overlap_runtime.schedules.compile.compile_spec` treats a spec: pipeline rules, lowering
when the table has no SEND/RECV, task graph, deadlock proof, and returns a
:class:`~overlap_runtime.schedules.compile.CompiledSchedule` whose ``spec`` is a
:class:`TableSpec` (sizes and placement read from the table). ``PipelineSchedule`` accepts a
``CompiledSchedule`` in place of a spec, so a torch file runs in our runtime without
registering a schedule kind. Pure: no torch import.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from typing import Literal, TextIO

from ..graph._gc import gc_paused
from .compile import CompiledSchedule, _prove_deadlock_free, compile_schedule
from .ir import Action, ActionKind, Schedule, parse_action
from .ir import dump_csv
from .lowering import lower
from .rules import check_pipeline_rules
from .spec import stage_to_rank as placement_rank

FSDP_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
"""torch's FSDP steps; :func:`load_torch_csv` drops them (``fsdp="skip"``) or refuses them."""

_FSDP_RE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*$")
FsdpRule = Literal["skip", "error"]


def to_torch(schedule: Schedule) -> Schedule:
    """``schedule`` with every ``(b;f)OVERLAP_B_F`` rewritten as torch's ``(f;b)OVERLAP_F_B``
    (forward sub-actions first, then the others, each side in its original order)."""
    out: Schedule = {}
    for rank, actions in schedule.items():
        row: list[Action | None] = []
        for a in actions:
            if a is not None and a.kind is ActionKind.OVERLAP_B_F:
                fwd = [x for x in a.sub_actions if x.kind is ActionKind.F]
                rest = [x for x in a.sub_actions if x.kind is not ActionKind.F]
                a = Action.compound(ActionKind.OVERLAP_F_B, *fwd, *rest)
            row.append(a)
        out[rank] = row
    return out


def to_torch_csv(schedule: Schedule,
                 target: str | os.PathLike[str] | TextIO | None = None) -> str:
    """Write ``schedule`` as a CSV that torch's ``_PipelineScheduleRuntime._load_csv`` loads
    (see :func:`to_torch`); returns the text. ``target``: a path, an open text file or None."""
    return dump_csv(to_torch(schedule), target)


def parse_torch_rows(rows: list[list[str]], fsdp: FsdpRule = "skip") -> Schedule:
    """Rows of cells (one row per rank) as written by torch's ``_dump_csv``; FSDP cells are
    dropped (``fsdp="skip"``) or refused (``fsdp="error"``, ``ValueError`` naming the cell)."""
    if fsdp not in ("skip", "error"):
        raise ValueError(f"fsdp={fsdp!r}: expected 'skip' (drop {'/'.join(FSDP_KINDS)} cells) "
                         "or 'error'")
    out: Schedule = {}
    for rank, row in enumerate(rows):
        acts: list[Action | None] = []
        for step, cell in enumerate(row):
            text = cell.strip()
            if _FSDP_RE.match(text):
                if fsdp == "error":
                    raise ValueError(
                        f"rank {rank} step {step}: {text!r} is an FSDP action of torch's "
                        f"lowering; load with fsdp='skip' (our runtime leaves "
                        f"{'/'.join(FSDP_KINDS)} to FSDP2's module hooks)")
                continue
            try:
                acts.append(parse_action(text))
            except ValueError as exc:
                raise ValueError(f"rank {rank} step {step}: {exc}") from None
        out[rank] = acts
    return out


def load_torch_csv(source: str | os.PathLike[str] | TextIO, fsdp: FsdpRule = "skip") -> Schedule:
    """Read a schedule written by torch's ``_dump_csv`` (``compute_only`` or the default
    ``compute_comms``) or by :func:`to_torch_csv`; see :func:`parse_torch_rows` for ``fsdp``."""
    if hasattr(source, "read"):
        return parse_torch_rows(list(csv.reader(source)), fsdp)  # type: ignore[arg-type]
    with open(source, newline="") as f:  # type: ignore[arg-type]
        return parse_torch_rows(list(csv.reader(f)), fsdp)


@dataclass(frozen=True)
class TableSpec:
    """What a schedule given as a table implies: the fields of a ``ScheduleSpec`` that the
    runtime reads (``kind`` is ``"table"``), with the placement read from the table.

    ``placement`` is ``loop`` or ``v`` when the table's stage-to-rank map is that placement,
    else ``custom`` (``mapping`` holds it either way, as ``((stage, rank), ...)``).
    """

    pp_size: int
    num_microbatches: int
    virtual_stages: int
    mapping: tuple[tuple[int, int], ...]
    placement: str
    overlap_p2p: bool = True
    overlap_b_f: bool = False
    split_backward: bool = False
    kind: str = "table"

    @property
    def num_stages(self) -> int:
        return len(self.mapping)

    def stage_to_rank(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        return self.mapping[stage][1]

    def stage_mapping(self) -> dict[int, int]:
        return dict(self.mapping)


@gc_paused
def compile_table(schedule: Schedule, *, num_microbatches: int | None = None,
                  overlap_p2p: bool = True, message_bytes: float | None = None
                  ) -> CompiledSchedule:
    """Check, lower (if it has no SEND/RECV), compile and prove deadlock-free a schedule given
    as a table (for example :func:`load_torch_csv`'s).

    ``num_microbatches`` defaults to the largest microbatch index + 1. Raises
    ``ScheduleValidationError`` / ``DeadlockError`` like :func:`compile_spec`, and
    ``ValueError`` when the table's stages do not divide evenly over its ranks.
    """
    mapping, n_stages, lowered_in = check_pipeline_rules(schedule,
                                                         num_microbatches=num_microbatches)
    mbs = {x.microbatch for acts in schedule.values() for a in acts if a is not None
           for x in a.leaves()}
    m = num_microbatches if num_microbatches is not None else max(mbs) + 1
    pp = len(schedule)
    if n_stages % pp:
        raise ValueError(f"the table has {n_stages} stages on {pp} ranks: rule every rank holds "
                         "the same number of stages")
    v = n_stages // pp
    stage_map = {s: mapping[s] for s in range(n_stages)}
    placement = next((p for p in ("loop", "v") if (p != "v" or v % 2 == 0) and all(
        placement_rank(s, pp, p) == r for s, r in stage_map.items())), "custom")
    compute = {r: [a for a in acts if a is None or not a.is_comm] for r, acts in schedule.items()}
    lowered = schedule if lowered_in else lower(compute, stage_map, num_stages=n_stages)
    if not lowered_in:
        check_pipeline_rules(lowered, num_microbatches=m, num_stages=n_stages,
                             stage_to_rank=stage_map)
    leaves = [x for acts in compute.values() for a in acts if a is not None for x in a.leaves()]
    spec = TableSpec(pp_size=pp, num_microbatches=m, virtual_stages=v,
                     mapping=tuple(sorted(stage_map.items())), placement=placement,
                     overlap_p2p=overlap_p2p,
                     overlap_b_f=any(a is not None and a.is_compound
                                     for acts in compute.values() for a in acts),
                     split_backward=any(x.kind is ActionKind.I for x in leaves))
    graph = compile_schedule(lowered, stage_to_rank=stage_map, num_stages=n_stages,
                             overlap_p2p=overlap_p2p, message_bytes=message_bytes,
                             name=f"table pp={pp} m={m} v={v}")
    matching = _prove_deadlock_free(graph)
    return CompiledSchedule(spec, compute, lowered, graph, matching)  # type: ignore[arg-type]

