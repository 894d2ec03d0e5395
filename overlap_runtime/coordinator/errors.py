"""Errors raised by the hook coordinator, its comm serializer and CommComputeOverlap.

Every error that comes out of a wait names where it happened: the side (``forward`` or
``backward``), the Python thread, the hook letter, the MoE layer index, the hook sequence number
and the last events the coordinator saw (its ring buffer), so a failure in a two-thread overlap
can be read without a debugger.

=======================  =====================================================================
error                    raised when
=======================  =====================================================================
CoordinatorTimeout       a bounded wait ran out (this thread's, or the peer's: then both raise)
CoordinatorAborted       the peer thread failed; this thread stops at its next hook or wait
CoordinatorProtocolError misuse: hook letters out of order, a second all-to-all in flight on a
                         group from one thread, a run started while another is active
LaunchOrderMismatch      the debug check found ranks that launched different collectives
=======================  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class WaitSite:
    """Where a thread was when an error hit it: side, thread, hook letter, layer, sequence number.

    ``letter`` is ``None`` (and ``layer`` -1) for waits outside a hook, e.g. a group lock taken by
    the comm serializer or the worker's join.
    """

    side: str
    thread: str
    letter: str | None
    layer: int
    seq: int
    run: int

    def __str__(self) -> str:
        hook = f"hook {self.letter} (layer {self.layer})" if self.letter else "no hook"
        return (f"{self.side} thread {self.thread!r} at {hook}, seq {self.seq}, run {self.run}")


def _format_events(events: Sequence[Any]) -> str:
    if not events:
        return "  (none)"
    return "\n".join(f"  {e}" for e in events)


class CoordinatorError(Exception):
    """Base class of every coordinator error."""


class CoordinatorProtocolError(CoordinatorError):
    """The hooks or the serializer were used out of order (loud misuse, never silent garbage)."""


class CoordinatorTimeout(CoordinatorError, TimeoutError):
    """A bounded wait ran out; raised in the thread that waited and in its peer.

    Attributes: ``site`` (:class:`WaitSite`), ``waiting_for`` (what the wait needed), ``timeout_s``,
    ``events`` (last events seen), ``origin`` (the site that timed out first; equals ``site`` in
    the thread that timed out itself).
    """

    def __init__(self, site: WaitSite, waiting_for: str, timeout_s: float,
                 events: Sequence[Any], origin: WaitSite | None = None) -> None:
        self.site = site
        self.waiting_for = waiting_for
        self.timeout_s = timeout_s
        self.events = tuple(events)
        self.origin = origin or site
        if origin is None or origin == site:
            head = (f"coordinator timeout: {site} waited {timeout_s:.2f}s for {waiting_for} "
                    f"without progress")
        else:
            head = (f"coordinator timeout: {site} stopped because the {origin.side} thread timed "
                    f"out ({origin} waiting for {waiting_for}, {timeout_s:.2f}s)")
        super().__init__(f"{head}\nlast events:\n{_format_events(self.events)}")

    @property
    def thread(self) -> str:
        return self.site.thread

    @property
    def letter(self) -> str | None:
        return self.site.letter

    @property
    def layer(self) -> int:
        return self.site.layer

    @property
    def seq(self) -> int:
        return self.site.seq


class CoordinatorAborted(CoordinatorError):
    """The peer thread failed; this thread stopped at its next hook (or lock wait).

    Attributes: ``site`` (where this thread stopped), ``cause_side`` and ``cause`` (the peer's
    exception), ``events``.
    """

    def __init__(self, site: WaitSite, cause_side: str, cause: BaseException,
                 events: Sequence[Any]) -> None:
        self.site = site
        self.cause_side = cause_side
        self.cause = cause
        self.events = tuple(events)
        super().__init__(
            f"coordinator aborted: {site} stopped because the {cause_side} thread failed with "
            f"{type(cause).__name__}: {cause}\nlast events:\n{_format_events(self.events)}"
        )


class LaunchOrderMismatch(CoordinatorError):
    """Ranks launched different collectives on one group; names the first launch that differs.

    Attributes: ``group`` (its label), ``index`` (0-based launch number), ``entries`` (rank ->
    that rank's launch at ``index``, or None when the rank had fewer launches).
    """

    def __init__(self, group: str, index: int, entries: dict[int, Any]) -> None:
        self.group = group
        self.index = index
        self.entries = dict(entries)
        lines = "\n".join(f"  rank {r}: {e if e is not None else '(no launch)'}"
                          for r, e in sorted(self.entries.items()))
        super().__init__(f"launch order differs across ranks on group {group!r}: first "
                         f"difference at launch #{index}:\n{lines}")
