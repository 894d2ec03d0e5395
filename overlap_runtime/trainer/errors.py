"""What a failed training step raises: :class:`TrainStepError`, naming rank, step, stage, action.

The training loop runs each step's forward/backward and gradient norm inside
:func:`step_context`; any exception leaves it as a :class:`TrainStepError` with the original
chained (``__cause__``)::

    rank 2, training step 2, pipeline stage 3, action 3F1 in (3B0;3F1)OVERLAP_B_F (forward side,
    thread 'MainThread'), schedule step 9 of 35: ValueError: injected forward failure

    rank 0, training step 2, pipeline stage 0, action 0B2 (thread 'MainThread'), schedule step 29
    of 37, waiting for 0RECV_B2 from rank 2: PipelinePeerFailed: 0RECV_B2 failed after 0.00s of
    its 10.0s bound: ... Connection closed by peer

The pipeline part comes from the :class:`~overlap_runtime.pipeline.errors.PipelineError` in the
cause chain (its :class:`~overlap_runtime.pipeline.errors.ActionSite`); a failure outside a
pipeline step (``pp == 1``, the gradient-norm all-reduce) names rank and step only. The notes of
the chain (e.g. the coordinator's "all-to-all ... on group ... (global ranks [2, 3]) in flight")
follow on the next lines.

The errors a user fixes rather than debugs derive from :class:`UserFacingError`:
:class:`CheckpointError` (a checkpoint cannot be saved, verified or resumed) and
:class:`DataError` (a data file cannot be read, naming the file and line). The command line
prints them as one line and exits 2 (``overlap_runtime.failure``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from overlap_runtime.pipeline.errors import (
    ActionSite,
    PipelineError,
    first_line,
    pipeline_error_in,
    root_cause,
)


class UserFacingError(RuntimeError):
    """An error whose message alone says what to fix (a file, a field, a path and the rule)."""


class CheckpointError(UserFacingError):
    """A checkpoint cannot be saved, verified or resumed; the message names the path and the
    rule."""


class DataError(UserFacingError, ValueError):
    """A data file cannot be read; the message names the file and, where known, the line or
    row."""


def _notes(exc: BaseException) -> list[str]:
    out: list[str] = []
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not s for s in seen):
        seen.append(cur)
        for note in getattr(cur, "__notes__", ()):
            if note not in out:
                out.append(note)
        cur = cur.__cause__ if cur.__cause__ is not None else (
            None if cur.__suppress_context__ else cur.__context__)
    return out


class TrainStepError(RuntimeError):
    """Training step ``step`` (1-based) failed on global rank ``rank``.

    Attributes:
        rank, step: where.  cause: the exception (also ``__cause__``).
        site: the :class:`ActionSite` of the pipeline action that failed, or None outside a
            pipeline step; ``stage``, ``action``, ``thread`` read it.
        peer: global rank a failed pipeline wait was for (None when not a wait, or unknown).
        waited_for: that wait's SEND/RECV action.
    """

    def __init__(self, rank: int, step: int, cause: BaseException) -> None:
        self.rank, self.step, self.cause = rank, step, cause
        pe = pipeline_error_in(cause)
        self.site: ActionSite | None = pe.site if pe is not None else None
        self.peer = pe.peer if pe is not None else None
        self.waited_for = pe.waited_for if pe is not None else None
        head = f"rank {rank}, training step {step}"
        if pe is not None:
            head += f", pipeline {pe.site.where()}{pe.waiting()}"
        root = root_cause(cause)
        detail = root.__cause__ if isinstance(root, PipelineError) and root.__cause__ else root
        tail = f"{type(root).__name__}: {first_line(detail)}"
        lines = [f"{head}: {tail}", *_notes(cause)]
        super().__init__("\n".join(lines))

    @property
    def stage(self) -> int | None:
        return self.site.stage if self.site is not None else None

    @property
    def action(self) -> str | None:
        return self.site.action if self.site is not None else None

    @property
    def thread(self) -> str | None:
        return self.site.thread if self.site is not None else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextmanager
def step_context(step: int) -> Iterator[None]:
    """``with step_context(step):`` turns any exception of the block into a
    :class:`TrainStepError` for training step ``step`` (1-based) on this rank, cause chained."""
    try:
        yield
    except TrainStepError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with rank and step, cause chained
        raise TrainStepError(_rank(), step, exc) from exc
