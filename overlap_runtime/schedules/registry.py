"""The one registry of schedule kinds, looked up by name (like torch's ``get_schedule_class``).

``_BUILTIN`` lists the kind files of :mod:`overlap_runtime.schedules.kinds`; adding a kind is a
new file there plus one entry here. :func:`register_schedule_kind` adds a kind at run time (a
user's own schedule) without touching the package. :class:`~overlap_runtime.schedules.spec.
ScheduleSpec` validates ``kind`` against this registry, and
:func:`~overlap_runtime.schedules.build.build_schedule` calls the kind's builder.
"""

from __future__ import annotations

from .kind import ScheduleKind
from .kinds import dualpipev, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble

_BUILTIN: tuple[ScheduleKind, ...] = (
    gpipe.KIND,
    one_f_one_b.KIND,
    interleaved_1f1b.KIND,
    zero_bubble.KIND,
    dualpipev.KIND,
)

_KINDS: dict[str, ScheduleKind] = {kind.name: kind for kind in _BUILTIN}


def get_schedule_kind(name: str) -> ScheduleKind:
    """The kind registered as ``name``; raises ``ValueError`` naming the known kinds."""
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(
            f"kind {name!r} is not a registered schedule kind; known: {sorted(_KINDS)} "
            "(register new kinds with register_schedule_kind)"
        )
    return kind


def schedule_kinds() -> dict[str, ScheduleKind]:
    """Every registered kind by name (a copy), the built-in ones included."""
    return dict(_KINDS)


def register_schedule_kind(kind: ScheduleKind, *, replace: bool = False) -> ScheduleKind:
    """Make ``kind.name`` a valid ``ScheduleSpec.kind`` built by ``kind.build``.

    A name already registered raises ``ValueError`` unless ``replace=True``.
    """
    if not isinstance(kind, ScheduleKind):
        raise TypeError(f"register_schedule_kind takes a ScheduleKind, got {type(kind).__name__}")
    if kind.name in _KINDS and not replace:
        raise ValueError(
            f"schedule kind {kind.name!r} is already registered; pass replace=True to replace it"
        )
    _KINDS[kind.name] = kind
    return kind


def unregister_schedule_kind(name: str) -> None:
    """Remove a kind added with :func:`register_schedule_kind` (a built-in raises ValueError)."""
    kind = get_schedule_kind(name)
    if kind in _BUILTIN:
        raise ValueError(f"the built-in schedule kind {name!r} cannot be removed")
    del _KINDS[name]
