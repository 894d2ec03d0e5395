"""Pipeline schedule IR: actions, their text form and CSV files.

An :class:`Action` is one step of one rank: ``Action(stage, kind, microbatch)``. A schedule is a
``dict[rank, list[Action | None]]`` where ``None`` is a deliberate bubble. The text form is the
one ``torch.distributed.pipelining`` prints and parses, so schedules move between the projects::

    2F0                 forward of stage 2, microbatch 0
    1B3                 full backward of stage 1, microbatch 3
    1I3 / 1W3           backward input / backward weight (split backward)
    0SEND_F1            stage 0 sends the activation of microbatch 1 to stage 1
    1RECV_F1            stage 1 receives it
    (1B3;0F4)OVERLAP_B_F  compound step: two sub-actions on two threads of one rank

A compound action (``OVERLAP_B_F`` / ``OVERLAP_F_B``) carries no stage or microbatch of its own
(``stage == -1``, ``microbatch is None``), exactly as in torch; its sub-actions carry them.

CSV files follow torch's ``_dump_csv`` / ``_load_csv``: one row per rank in rank order, one cell
per step, an empty cell for a bubble.
"""

from __future__ import annotations

import csv
import enum
import io
import os
import re
from typing import Iterable, NamedTuple, TextIO, Union


class ActionKind(str, enum.Enum):
    """What an action does; the value is the text torch uses."""

    F = "F"  #: forward
    B = "B"  #: full backward (input and weight gradients)
    I = "I"  #: backward for the input gradient only  # noqa: E741
    W = "W"  #: backward for the weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OVERLAP_B_F = "OVERLAP_B_F"  #: backward of mb i with forward of mb i+1, on two threads
    OVERLAP_F_B = "OVERLAP_F_B"  #: forward with backward (torch / DualPipeV order)

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
COMM_KINDS = frozenset(
    {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
)
COMPOUND_KINDS = frozenset({ActionKind.OVERLAP_B_F, ActionKind.OVERLAP_F_B})

# Longest alternatives first so that "SEND_F" is not read as stage + "S"...
_SIMPLE_RE = re.compile(
    r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d*)$"
)
_COMPOUND_RE = re.compile(r"^\((.*)\)(OVERLAP_B_F|OVERLAP_F_B)$")


class _ActionFields(NamedTuple):
    stage: int
    kind: ActionKind
    microbatch: int | None
    sub_actions: tuple["Action", ...]


class Action(_ActionFields):
    """One step of one rank: ``Action(stage, kind, microbatch, sub_actions=())``.

    ``stage`` is the global stage index (``-1`` for a compound action), ``microbatch`` the
    microbatch index (``None`` for a compound action), ``sub_actions`` the parts of a compound
    action (empty otherwise). ``str(action)`` gives the torch text form. Immutable and hashable
    (a named tuple: schedules hold hundreds of thousands of them); the constructor checks the
    fields.
    """

    __slots__ = ()

    def __new__(
        cls,
        stage: int,
        kind: ActionKind,
        microbatch: int | None = None,
        sub_actions: tuple["Action", ...] = (),
    ) -> "Action":
        kind = ActionKind(kind)
        sub_actions = tuple(sub_actions)
        if kind in COMPOUND_KINDS:
            if stage != -1 or microbatch is not None:
                raise ValueError(
                    f"compound action {kind.value} takes stage=-1 and microbatch=None "
                    f"(got stage={stage}, microbatch={microbatch}); its sub-actions carry them"
                )
            if not sub_actions:
                raise ValueError(f"compound action {kind.value} needs sub-actions, got none")
            for sub in sub_actions:
                if not isinstance(sub, Action) or sub.kind not in COMPUTE_KINDS:
                    raise ValueError(
                        f"sub-action {sub!r} of {kind.value} must be a compute action "
                        "(F, B, I, W)"
                    )
        else:
            if sub_actions:
                raise ValueError(
                    f"only OVERLAP_B_F / OVERLAP_F_B take sub-actions, got {kind.value} "
                    f"with {len(sub_actions)}"
                )
            if not isinstance(stage, int) or stage < 0:
                raise ValueError(f"stage must be an int >= 0 for {kind.value}, got {stage!r}")
            if not isinstance(microbatch, int) or microbatch < 0:
                raise ValueError(
                    f"microbatch must be an int >= 0 for {kind.value} at stage {stage}, "
                    f"got {microbatch!r}"
                )
        return tuple.__new__(cls, (stage, kind, microbatch, sub_actions))

    @classmethod
    def _trusted(cls, stage: int, kind: ActionKind, microbatch: int) -> "Action":
        """Build a simple action without checks (for passes that derive it from checked ones)."""
        return tuple.__new__(cls, (stage, kind, microbatch, ()))

    @staticmethod
    def compound(kind: ActionKind, *sub_actions: "Action") -> "Action":
        """Build ``(a;b)KIND`` from its sub-actions."""
        return Action(-1, ActionKind(kind), None, tuple(sub_actions))

    @property
    def is_compound(self) -> bool:
        return self.kind in COMPOUND_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_compute(self) -> bool:
        """True for F, B, I, W and the compound kinds (torch's ``is_compute_op``)."""
        return self.kind in COMPUTE_KINDS or self.kind in COMPOUND_KINDS

    def leaves(self) -> tuple["Action", ...]:
        """The sub-actions of a compound action, else ``(self,)``."""
        return self.sub_actions if self.sub_actions else (self,)

    def __str__(self) -> str:
        if self.sub_actions:
            return "(" + ";".join(str(a) for a in self.sub_actions) + ")" + self.kind.value
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @staticmethod
    def parse(text: str) -> "Action | None":
        """Inverse of ``str``; see :func:`parse_action`."""
        return parse_action(text)


def parse_action(text: str) -> Action | None:
    """Parse the torch text form (``2F0``, ``0SEND_F1``, ``(1B3;0F4)OVERLAP_B_F``).

    An empty or blank string is a bubble and gives ``None``. Raises ``ValueError`` naming the
    text and the expected format otherwise.
    """
    text = text.strip()
    if not text:
        return None
    m = _COMPOUND_RE.match(text)
    if m is not None:
        parts = [p for p in m.group(1).split(";") if p.strip()]
        subs = []
        for part in parts:
            sub = parse_action(part)
            if sub is None or sub.is_compound:
                raise ValueError(f"invalid sub-action {part!r} in {text!r}")
            subs.append(sub)
        return Action.compound(ActionKind(m.group(2)), *subs)
    m = _SIMPLE_RE.match(text)
    if m is None:
        raise ValueError(
            f"invalid action {text!r}: expected [stage][kind][microbatch] such as '2F0', "
            "'0SEND_F1' or '(1B3;0F4)OVERLAP_B_F'"
        )
    stage, kind, mb = m.groups()
    if not mb:
        raise ValueError(f"invalid action {text!r}: kind {kind} needs a microbatch index")
    return Action(int(stage), ActionKind(kind), int(mb))


Schedule = dict[int, list[Union[Action, None]]]
"""rank -> steps; ``None`` is a deliberate bubble."""


def parse_compute_action(text: str) -> tuple[int, str, int] | None:
    """``'1F3'`` -> ``(1, 'F', 3)`` for a plain F / B / I / W action; None for anything else
    (a trace span's name, a send, a compound step), never an error."""
    try:
        a = parse_action(text)
    except ValueError:
        return None
    if a is None or a.is_compound or a.kind not in COMPUTE_KINDS:
        return None
    return a.stage, a.kind.value, a.microbatch


def schedule_to_rows(schedule: Schedule) -> list[list[str]]:
    """Rows of text cells, one per rank in rank order (ranks must be 0..n-1)."""
    ranks = sorted(schedule)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"schedule ranks must be 0..{len(ranks) - 1}, got {ranks}")
    return [["" if a is None else str(a) for a in schedule[r]] for r in ranks]


def schedule_from_rows(rows: Iterable[Iterable[str]]) -> Schedule:
    """Inverse of :func:`schedule_to_rows`."""
    return {rank: [parse_action(cell) for cell in row] for rank, row in enumerate(rows)}


def dump_csv(schedule: Schedule, target: str | os.PathLike[str] | TextIO | None = None) -> str:
    """Write ``schedule`` as torch's CSV (one row per rank); returns the CSV text.

    ``target`` may be a path, an open text file or ``None`` (only return the text).
    """
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in schedule_to_rows(schedule):
        writer.writerow(row)
    text = buf.getvalue()
    if target is None:
        return text
    if hasattr(target, "write"):
        target.write(text)  # type: ignore[union-attr]
    else:
        with open(target, "w", newline="") as f:  # type: ignore[arg-type]
            f.write(text)
    return text


def load_csv(source: str | os.PathLike[str] | TextIO) -> Schedule:
    """Read a schedule written by :func:`dump_csv` or by torch's ``_dump_csv``.

    ``source`` is a path or an open text file.
    """
    if hasattr(source, "read"):
        return schedule_from_rows(csv.reader(source))  # type: ignore[arg-type]
    with open(source, newline="") as f:  # type: ignore[arg-type]
        return schedule_from_rows(csv.reader(f))
