"""``ScheduleSpec``: the validated description of a pipeline schedule.

Invalid combinations fail at construction with a ``pydantic.ValidationError`` that names the
field values and the rule they break. The set of kinds is open: a later schedule (zero bubble,
DualPipeV) calls :func:`register_schedule_kind` with its constraints and
:func:`overlap_runtime.schedules.builders.register_builder` with its builder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ScheduleKindInfo",
    "ScheduleSpec",
    "register_schedule_kind",
    "schedule_kinds",
    "stage_to_rank",
]

Placement = Literal["loop", "v"]


@dataclass(frozen=True)
class ScheduleKindInfo:
    """Constraints that a schedule kind puts on a spec.

    ``min_virtual`` / ``max_virtual`` bound ``virtual_stages`` (``None``: unbounded);
    ``placements`` lists the stage placements the builder handles; ``overlap_b_f`` says whether
    the kind has a 1F1B steady state where backward i and forward i+1 can be paired.
    ``check(spec)``, if given, enforces the kind's own rules (raise ``ValueError`` naming the
    values and the rule); it runs after the virtual-stage and placement rules.
    """

    name: str
    min_virtual: int = 1
    max_virtual: int | None = None
    placements: tuple[str, ...] = ("loop",)
    overlap_b_f: bool = True
    split_backward: bool = True
    description: str = ""
    check: Callable[["ScheduleSpec"], None] | None = None


_KINDS: dict[str, ScheduleKindInfo] = {}


def register_schedule_kind(info: ScheduleKindInfo) -> ScheduleKindInfo:
    """Make ``info.name`` a valid ``ScheduleSpec.kind`` (re-registering replaces)."""
    _KINDS[info.name] = info
    return info


def schedule_kinds() -> dict[str, ScheduleKindInfo]:
    """The registered kinds, by name (the built-in ones included)."""
    _load_builtin_kinds()
    return dict(_KINDS)


def _load_builtin_kinds() -> None:
    """Import the builder modules, which register the kinds defined outside this file
    (``zero_bubble``, ``dualpipev``). Lazy so that importing the spec stays light; importing
    ``builders`` imports them at its end."""
    from . import builders  # noqa: F401


register_schedule_kind(
    ScheduleKindInfo(
        "gpipe", max_virtual=1, overlap_b_f=False,
        description="all forwards, then all backwards (Huang et al. 2019)",
    )
)
register_schedule_kind(
    ScheduleKindInfo(
        "1f1b", max_virtual=1,
        description="one forward one backward (PipeDream-Flush; Narayanan et al. 2021)",
    )
)
register_schedule_kind(
    ScheduleKindInfo(
        "interleaved_1f1b", min_virtual=1,
        description="1F1B over v model chunks per rank, depth first (Narayanan et al. 2021)",
    )
)


def stage_to_rank(stage: int, pp_size: int, placement: str = "loop") -> int:
    """Rank that holds global ``stage``.

    ``loop``: stage s on rank ``s % pp`` (chunk c of rank r is stage ``c * pp + r``).
    ``v``: chunks zig-zag, so chunk 0 runs down the ranks and chunk 1 back up
    (stage ``pp - 1`` and stage ``pp`` both sit on the last rank).
    """
    chunk, pos = divmod(stage, pp_size)
    if placement == "loop":
        return pos
    if placement == "v":
        return pos if chunk % 2 == 0 else pp_size - 1 - pos
    raise ValueError(f"unknown stage placement {placement!r}; expected 'loop' or 'v'")


class ScheduleSpec(BaseModel):
    """What to build: kind, sizes and flags.

    - ``kind``: a registered kind (``gpipe``, ``1f1b``, ``interleaved_1f1b``; more later).
    - ``pp_size``: pipeline ranks; ``virtual_stages``: model chunks (stages) per rank, so the
      model has ``pp_size * virtual_stages`` stages.
    - ``num_microbatches``: microbatches per step.
    - ``overlap_b_f``: pair steady-state backward i with the next forward into one
      ``OVERLAP_B_F`` step that runs on two threads (seed 001 section 2.2).
    - ``overlap_p2p``: run SEND/RECV on a comm lane beside compute (else they block compute).
    - ``split_backward``: replace each B by I (input grad) then W (weight grad).
    - ``placement``: ``loop`` or ``v`` (see :func:`stage_to_rank`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    pp_size: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    virtual_stages: int = Field(default=1, ge=1)
    overlap_b_f: bool = False
    overlap_p2p: bool = True
    split_backward: bool = False
    placement: Placement = "loop"

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in _KINDS:
            _load_builtin_kinds()
        if kind not in _KINDS:
            raise ValueError(
                f"kind {kind!r} is not a registered schedule kind; known: {sorted(_KINDS)} "
                "(register new kinds with register_schedule_kind)"
            )
        return kind

    @model_validator(mode="after")
    def _rules(self) -> "ScheduleSpec":
        info = _KINDS[self.kind]
        v = self.virtual_stages
        if v < info.min_virtual or (info.max_virtual is not None and v > info.max_virtual):
            hi = "inf" if info.max_virtual is None else info.max_virtual
            raise ValueError(
                f"virtual_stages={v} is out of range for kind={self.kind!r}: "
                f"rule {info.min_virtual} <= virtual_stages <= {hi}"
            )
        if self.placement not in info.placements:
            raise ValueError(
                f"placement={self.placement!r} is not supported by kind={self.kind!r}: "
                f"rule placement in {list(info.placements)}"
            )
        if self.placement == "v" and v % 2 != 0:
            raise ValueError(
                f"placement='v' needs an even virtual_stages (chunks go down and back up), "
                f"got virtual_stages={v}"
            )
        if info.check is not None:
            info.check(self)
        if self.overlap_b_f and not info.overlap_b_f:
            raise ValueError(
                f"overlap_b_f=True needs a 1F1B steady state, which kind={self.kind!r} lacks: "
                "rule overlap_b_f only with 1f1b-style kinds"
            )
        if self.split_backward and not info.split_backward:
            raise ValueError(f"split_backward=True is not supported by kind={self.kind!r}")
        if self.overlap_b_f and self.split_backward:
            raise ValueError(
                "overlap_b_f=True and split_backward=True cannot be combined yet: rule "
                "OVERLAP_B_F pairs a full backward B with a forward F"
            )
        if self.kind == "interleaved_1f1b":
            rounds = max(1, self.num_microbatches // self.pp_size)
            if self.num_microbatches % rounds != 0:
                raise ValueError(
                    f"num_microbatches={self.num_microbatches} must be a multiple of the number "
                    f"of rounds max(1, num_microbatches // pp_size)={rounds} for "
                    f"kind='interleaved_1f1b' (pp_size={self.pp_size})"
                )
        return self

    # -- derived -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Global stages: ``pp_size * virtual_stages``."""
        return self.pp_size * self.virtual_stages

    def stage_to_rank(self, stage: int) -> int:
        """Rank that holds ``stage`` under this spec's placement."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        return stage_to_rank(stage, self.pp_size, self.placement)

    def stage_mapping(self) -> dict[int, int]:
        """``{stage: rank}`` for every stage."""
        return {s: stage_to_rank(s, self.pp_size, self.placement) for s in range(self.num_stages)}

    # -- files ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScheduleSpec":
        """Validate a mapping; a top-level ``schedule:`` key is unwrapped."""
        if set(data) == {"schedule"} and isinstance(data["schedule"], dict):
            data = data["schedule"]
        return cls.model_validate(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "ScheduleSpec":
        """Load from ``.yaml`` / ``.yml`` or ``.json``."""
        path = os.fspath(path)
        if not path.endswith((".yaml", ".yml", ".json")):
            raise ValueError(f"schedule spec file {path!r} must end in .yaml, .yml or .json")
        with open(path) as f:
            text = f.read()
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"schedule spec file {path!r} must hold a mapping, got {type(data)}")
        return cls.from_dict(data)

    @classmethod
    def from_yaml(cls, text: str) -> "ScheduleSpec":
        import yaml

        return cls.from_dict(yaml.safe_load(text))

    @classmethod
    def from_json(cls, text: str) -> "ScheduleSpec":
        return cls.from_dict(json.loads(text))
