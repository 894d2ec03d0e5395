"""``ScheduleSpec``: the validated description of a pipeline schedule.

Invalid combinations fail at construction with a ``pydantic.ValidationError`` that names the
field values and the rule they break. The rules that hold for every kind live here; a kind's
own rules live in its file under :mod:`overlap_runtime.schedules.kinds` (``ScheduleKind.check``),
looked up by name in :mod:`overlap_runtime.schedules.registry`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from .registry import get_schedule_kind

Placement = Literal["loop", "v"]

MAX_SCHEDULE_ACTIONS = 1_000_000
"""The most compute actions a :class:`ScheduleSpec` may describe: ``pp_size * virtual_stages *
num_microbatches`` times 2 (F, B) or 3 (F, I, W with ``split_backward``). Lowering adds up to
two SEND/RECV actions per compute action, and compiling, proving and simulating cost time and
memory linear in all of them: about a minute and several GB at this limit on a CI-class CPU
(pp=250, m=400, 200K compute actions: about 10-20 s, 0.8 GB). Past it a spec is refused at
construction, before any work, with :class:`ScheduleTooLargeError` (inside pydantic's
``ValidationError``)."""


class ScheduleTooLargeError(ValueError):
    """A spec whose schedule would hold more than :data:`MAX_SCHEDULE_ACTIONS` compute actions."""


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

    - ``kind``: a registered kind: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``,
      ``dualpipev`` (:func:`~overlap_runtime.schedules.registry.schedule_kinds`), or one added
      with :func:`~overlap_runtime.schedules.registry.register_schedule_kind`.
    - ``pp_size``: pipeline ranks; ``virtual_stages``: model chunks (stages) per rank, so the
      model has ``pp_size * virtual_stages`` stages.
    - ``num_microbatches``: microbatches per step (torch's name ``n_microbatches`` is accepted
      as input).
    - ``overlap_b_f``: pair steady-state backward i with the next forward into one
      ``OVERLAP_B_F`` step that runs on two threads.
    - ``overlap_p2p`` (default True, as in every ``Schedule*`` constructor of
      :mod:`overlap_runtime.pipeline`): SEND/RECV on a comm lane beside compute; the runtime
      posts receives early and waits them just before their consumer. False: they block
      compute where the program lists them.
    - ``split_backward``: replace each B by I (input grad) then W (weight grad).
    - ``placement``: ``loop`` or ``v`` (see :func:`stage_to_rank`).

    Size: at most :data:`MAX_SCHEDULE_ACTIONS` compute actions (``num_actions``); a larger spec
    (``pp_size=10**6``, say) fails at construction with :class:`ScheduleTooLargeError`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    pp_size: int = Field(ge=1)
    num_microbatches: int = Field(ge=1, validation_alias=AliasChoices("num_microbatches",
                                                                    "n_microbatches"))
    virtual_stages: int = Field(default=1, ge=1)
    overlap_b_f: bool = False
    overlap_p2p: bool = True
    split_backward: bool = False
    placement: Placement = "loop"

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        get_schedule_kind(kind)  # raises naming the known kinds
        return kind

    @model_validator(mode="after")
    def _rules(self) -> "ScheduleSpec":
        if self.num_actions > MAX_SCHEDULE_ACTIONS:
            per = "3 (F, I, W)" if self.split_backward else "2 (F, B)"
            raise ScheduleTooLargeError(
                f"ScheduleTooLargeError: pp_size={self.pp_size} x virtual_stages="
                f"{self.virtual_stages} x num_microbatches={self.num_microbatches} x {per} = "
                f"{self.num_actions:,} compute actions, above MAX_SCHEDULE_ACTIONS = "
                f"{MAX_SCHEDULE_ACTIONS:,} (rule: a schedule is compiled, proved and simulated "
                "action by action; at this size that takes minutes and many GB)"
            )
        info = get_schedule_kind(self.kind)
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
        return self

    # -- derived -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Global stages: ``pp_size * virtual_stages``."""
        return self.pp_size * self.virtual_stages

    @property
    def num_actions(self) -> int:
        """Compute actions (F, B or F, I, W per stage and microbatch) of the schedule."""
        return self.num_stages * self.num_microbatches * (3 if self.split_backward else 2)

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
