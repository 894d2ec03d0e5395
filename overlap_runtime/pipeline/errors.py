"""Errors of a pipeline step, each naming where it happened (:class:`ActionSite`).

=====================  ==========================================================================
error                  raised when
=====================  ==========================================================================
PipelineTimeout        a pipeline point-to-point wait (RECV_F/RECV_B, a pending send, the
                       metadata exchange) passed the schedule's ``timeout_s``
PipelinePeerFailed     such a wait failed before its timeout: the peer died or closed the pair
                       (gloo reports a dead peer at once, an earlier timeout closes the pair)
PipelineActionError    anything else raised inside an action (the stage's forward or backward,
                       a CP or EP collective inside it, the coordinator of an OVERLAP_B_F step,
                       a callback); the original exception is ``__cause__``
=====================  ==========================================================================

All three are :class:`PipelineError`: ``site`` says which rank (global and pipeline-group),
which position of the rank's lowered program (``step_index``), which action was running in
which thread (the sub-action and side of a compound step such as ``OVERLAP_B_F``), the stage
and the microbatch; ``peer`` is the global rank the failed wait was for (None when unknown) and
``waited_for`` the point-to-point action it waited for. An error is wrapped once, at the
innermost action boundary (:meth:`ActionContext.run`): a ``PipelineError`` raised inside an
action passes through the outer boundaries unchanged.

This module is pure Python (no torch): the trainer reads the site of a failure from here.
"""

from __future__ import annotations

from dataclasses import dataclass

_BACKWARD_KINDS = frozenset({"B", "I", "W"})


@dataclass(frozen=True)
class ActionSite:
    """Where a pipeline step was when an error hit it.

    Attributes:
        rank: global rank.  group_rank: rank in the pipeline group.
        step_index: position in the rank's lowered program (``-1``: the one-time metadata
            exchange; ``program_length``: after the program, waiting the sends).
        program_length: number of actions in the rank's lowered program.
        action: the action running in this thread (a compute action, a compound step's
            sub-action, or the SEND/RECV the executor was at).
        program_action: the program's action at ``step_index`` (the compound step when
            ``action`` is one of its sub-actions); equals ``action`` otherwise.
        stage, microbatch: of ``action`` (None for the metadata exchange).
        side: ``forward`` or ``backward`` for a sub-action of a compound step, else None.
        thread: the Python thread's name.
    """

    rank: int
    group_rank: int
    step_index: int
    program_length: int
    action: str
    program_action: str
    stage: int | None
    microbatch: int | None
    side: str | None
    thread: str

    @property
    def compound(self) -> str | None:
        """The compound step ``action`` belongs to, or None."""
        return self.program_action if self.program_action != self.action else None

    def where(self) -> str:
        """``stage 3, action 3F1 in (3B0;3F1)OVERLAP_B_F (forward side, thread 'MainThread'),
        schedule step 9 of 35``."""
        parts = []
        if self.stage is not None:
            parts.append(f"stage {self.stage}")
        act = f"action {self.action}"
        if self.compound is not None:
            act += f" in {self.compound}"
        thread = f"thread {self.thread!r}"
        parts.append(f"{act} ({self.side + ' side, ' if self.side else ''}{thread})")
        if self.step_index < 0:
            parts.append("metadata exchange")
        elif self.step_index >= self.program_length:
            parts.append(f"end of step (after the {self.program_length} actions of the program)")
        else:
            parts.append(f"schedule step {self.step_index} of {self.program_length}")
        return ", ".join(parts)

    def who(self) -> str:
        """``rank 2 (pipeline rank 1)``."""
        return f"rank {self.rank} (pipeline rank {self.group_rank})"

    def __str__(self) -> str:
        return f"{self.who()}, {self.where()}"


def side_of(kind: str) -> str:
    """``backward`` for B/I/W, else ``forward``."""
    return "backward" if kind in _BACKWARD_KINDS else "forward"


class PipelineError(RuntimeError):
    """Base of the pipeline step errors (see the module doc).

    Attributes: ``site`` (:class:`ActionSite`), ``peer`` (global rank of the other end of the
    failed wait, or None), ``waited_for`` (the SEND/RECV waited, or None); ``rank``,
    ``step_index`` and ``action`` are the site's.
    """

    def __init__(self, message: str, site: ActionSite, peer: int | None = None,
                 waited_for: str | None = None) -> None:
        super().__init__(message)
        self.site = site
        self.peer = peer
        self.waited_for = waited_for

    @property
    def rank(self) -> int:
        return self.site.rank

    @property
    def step_index(self) -> int:
        return self.site.step_index

    @property
    def action(self) -> str:
        return self.site.action

    def waiting(self) -> str:
        """``, waiting for 0RECV_B0 from rank 2`` (empty when the error was not in a wait)."""
        if self.waited_for is None:
            return ""
        peer = f" {'from' if 'RECV' in self.waited_for else 'to'} rank {self.peer}" if (
            self.peer is not None) else ""
        return f", waiting for {self.waited_for}{peer}"


class PipelineTimeout(PipelineError, TimeoutError):
    """A pipeline point-to-point wait passed the schedule's timeout (``peer`` never answered)."""


class PipelinePeerFailed(PipelineError):
    """A pipeline point-to-point wait failed before its timeout: the peer is gone (or the pair
    was closed by an earlier timeout)."""


class PipelineActionError(PipelineError):
    """An action raised; ``__cause__`` (also ``cause``) is the original exception."""

    def __init__(self, site: ActionSite, cause: BaseException) -> None:
        super().__init__(f"{site.who()}: {site.where()} raised {type(cause).__name__}: "
                         f"{first_line(cause)}", site)
        self.cause = cause


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)`` (the rest is in the traceback)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not s for s in seen):
        seen.append(cur)
        cur = cur.__cause__ if cur.__cause__ is not None else (
            None if cur.__suppress_context__ else cur.__context__)
    return seen


def pipeline_error_in(exc: BaseException) -> PipelineError | None:
    """The first :class:`PipelineError` in ``exc``'s cause chain (``exc`` included), or None."""
    return next((e for e in _chain(exc) if isinstance(e, PipelineError)), None)


def root_cause(exc: BaseException) -> BaseException:
    """What went wrong underneath: the first exception of the chain below every
    :class:`PipelineActionError` (e.g. the ``ValueError`` a stage raised, the ``CommTimeoutError``
    of a CP receive, or the :class:`PipelineTimeout` itself)."""
    for e in _chain(exc):
        if not isinstance(e, PipelineActionError):
            return e
    return exc
