"""CommComputeOverlap: run a forward chunk and a backward chunk at once, comm hidden by compute.

``run(fwd_fn, bwd_fn)`` runs ``fwd_fn`` in the calling thread (the *forward* side) and ``bwd_fn``
in a persistent worker thread (the *backward* side) while their sync hooks hand the comm token
back and forth through the :class:`HookCoordinator`. It is what a pipeline schedule's OVERLAP_B_F
callback calls::

    overlap = CommComputeOverlap(HookCoordinator(timeout_s=120), device)
    def overlap_b_f(action, ctx):
        overlap.run(lambda: stage.forward_one_chunk(mb_f), lambda: stage.backward_one_chunk(mb_b))

Failure semantics:

* an exception in either function is recorded in the coordinator (``fail``), which wakes the
  other side: it raises CoordinatorAborted at its next hook or group-lock wait;
* a wait that passes ``timeout_s`` raises CoordinatorTimeout in that thread and, at its next
  hook, in the other;
* ``run`` waits for the worker (at most ``join_timeout_s``), then re-raises the run's *first*
  exception object in the caller, original traceback intact, with a note naming the thread it
  came from (and the other side's error, if it was not just the induced abort). Both sides'
  exceptions stay in :attr:`last_errors`;
* a worker still running after ``join_timeout_s`` makes ``run`` raise CoordinatorTimeout; the run
  stays failed (the worker raises at its next hook) until the worker finishes and ends it; the
  next ``run`` waits (bounded) for that before starting.

The worker calls :func:`overlap_runtime.platform.set_device` when it starts and before every job:
the current device is per thread, and a worker on the wrong device deadlocks NCCL/HCCL. With the
coordinator disabled, ``run`` executes ``fwd_fn`` then ``bwd_fn`` in the calling thread (the
serial baseline). Use ``close()`` or ``with CommComputeOverlap(...) as overlap:``; an overlap
dropped without either stops its worker from a ``weakref.finalize`` when it is collected (the
worker never references it, see :class:`_WorkerState`).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from overlap_runtime.coordinator.coordinator import HookCoordinator, Side
from overlap_runtime.coordinator.errors import (
    CoordinatorAborted,
    CoordinatorError,
    CoordinatorProtocolError,
    CoordinatorTimeout,
    WaitSite,
)
from overlap_runtime.platform import resolve_device, set_device

_IDLE_POLL_S = 1.0


@dataclass
class _Job:
    bwd_fn: Callable[[], Any]
    run: int
    coordinator: HookCoordinator  # held by the worker only while it runs this job
    done: bool = False
    abandoned: bool = False  # the caller stopped waiting; the worker ends the run itself
    result: Any = None
    error: BaseException | None = None


@dataclass
class _WorkerState:
    """Everything the worker thread touches between jobs.

    The thread must never reach the overlap object, or dropping the object would not stop the
    thread (its finaliser would never run): a failed run's exceptions hold tracebacks whose
    frames hold the overlap (and the caller's locals). So the idle worker holds only this state;
    the coordinator (which records the run's failure) and the job (whose error does too) are
    reachable from the thread only while a job runs.
    """

    device: torch.device
    cond: threading.Condition = field(default_factory=threading.Condition)
    job: _Job | None = None
    closed: bool = False
    worker_device: torch.device | None = None
    worker_ident: int | None = None

    def shut(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _worker_loop(state: _WorkerState) -> None:
    state.worker_ident = threading.get_ident()
    while _serve_one_job(state):
        pass


def _serve_one_job(state: _WorkerState) -> bool:
    """Wait (bounded polls) for a job and run it; False once the state is closed.

    A function of its own so that nothing of the job (its error, its traceback's frames) stays
    referenced from the thread's frame while it idles.
    """
    with state.cond:
        while not state.closed and (state.job is None or state.job.done):
            state.cond.wait(_IDLE_POLL_S)  # bounded: rechecks ``closed`` every poll
        if state.closed:
            return False
        job = state.job
    assert job is not None
    coordinator = job.coordinator
    try:
        state.worker_device = set_device(state.device)
        job.result = job.bwd_fn()
    except BaseException as exc:  # noqa: BLE001 - every error goes back to the caller
        job.error = exc
        coordinator.fail(Side.BACKWARD, exc)
    finally:
        coordinator.depart(Side.BACKWARD)
        with state.cond:
            job.done = True
            abandoned = job.abandoned
            state.cond.notify_all()
        if abandoned:  # the failure stayed visible to this thread's hooks until now
            coordinator.end_run()
        with state.cond:
            state.job = None
            state.cond.notify_all()
    return True


def _in_chain(err: BaseException, cls: type[BaseException]) -> bool:
    """``err`` is a ``cls``, or wraps one through ``__cause__`` (e.g. a pipeline action error)."""
    seen = 0
    cur: BaseException | None = err
    while cur is not None and seen < 16:
        if isinstance(cur, cls):
            return True
        cur, seen = cur.__cause__, seen + 1
    return False


def _is_abort(err: BaseException) -> bool:
    """``err`` is (or wraps) the induced CoordinatorAborted."""
    return _in_chain(err, CoordinatorAborted)


class CommComputeOverlap:
    """Two-thread FWD/BWD overlap driven by a :class:`HookCoordinator` (see the module doc).

    Args:
        coordinator: shared with the model's sync hooks.
        device: the device this rank computes on; the worker makes it current for itself.
        join_timeout_s: how long ``run`` waits for the backward side after the forward side is
            done (default: the coordinator's ``timeout_s``).
    """

    def __init__(self, coordinator: HookCoordinator, device: str | torch.device = "cpu", *,
                 join_timeout_s: float | None = None) -> None:
        self.coordinator = coordinator
        self.device = resolve_device(device)
        self.join_timeout_s = float(join_timeout_s or coordinator.timeout_s)
        if not self.join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be > 0, got {join_timeout_s}")
        self._state = _WorkerState(self.device)
        self._thread: threading.Thread | None = None
        self._workers_started = 0
        self._run_lock = threading.Lock()
        self.last_errors: dict[str, BaseException] = {}
        self.runs = 0
        self._finalizer = weakref.finalize(self, self._state.shut)

    # ------------------------------------------------------------------ worker
    @property
    def worker_thread(self) -> threading.Thread | None:
        """The persistent backward worker (None before the first overlapped run)."""
        return self._thread

    @property
    def worker_device(self) -> torch.device | None:
        """The device the worker made current for itself (set_device's result)."""
        return self._state.worker_device

    def _ensure_worker(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._workers_started += 1
        self._thread = threading.Thread(target=_worker_loop, args=(self._state,),
                                        name=f"overlap-bwd-{self._workers_started}", daemon=True)
        self._thread.start()

    def _site(self, what: str) -> WaitSite:
        return WaitSite("forward", threading.current_thread().name, None, -1, 0,
                        self.coordinator.run_id)

    def _wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        st = self._state
        deadline = time.monotonic() + timeout_s
        with st.cond:
            while not ready():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                st.cond.wait(remaining)
            return True

    # ------------------------------------------------------------------ run
    def run(self, fwd_fn: Callable[[], Any], bwd_fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Run ``fwd_fn`` here and ``bwd_fn`` on the worker; return ``(fwd_result, bwd_result)``.

        Re-raises the first failure of either side (see the module doc for the semantics).
        """
        if self._state.closed:
            raise CoordinatorProtocolError("CommComputeOverlap.run after close()")
        if threading.get_ident() == self._state.worker_ident:
            raise CoordinatorProtocolError("CommComputeOverlap.run called from its own worker")
        if not self._run_lock.acquire(blocking=False):
            raise CoordinatorProtocolError("CommComputeOverlap.run: another run is in progress")
        try:
            self.runs += 1
            self.last_errors = {}
            if not self.coordinator.enabled:
                return fwd_fn(), bwd_fn()
            return self._run_overlapped(fwd_fn, bwd_fn)
        finally:
            self._run_lock.release()

    def _run_overlapped(self, fwd_fn: Callable[[], Any],
                        bwd_fn: Callable[[], Any]) -> tuple[Any, Any]:
        st, coord = self._state, self.coordinator
        self._ensure_worker()
        assert self._thread is not None
        if not self._wait_until(lambda: st.job is None, self.join_timeout_s):
            raise CoordinatorTimeout(
                self._site("start"), f"the backward worker {self._thread.name!r} to finish an "
                f"earlier run it is still executing", self.join_timeout_s, coord.recent_events())
        run = coord.start_run(threading.get_ident(), self._thread.name)
        job = _Job(bwd_fn, run, coord)
        with st.cond:
            st.job = job
            st.cond.notify_all()
        fwd_result, fwd_error = None, None
        try:
            fwd_result = fwd_fn()
        except BaseException as exc:  # noqa: BLE001
            fwd_error = exc
            coord.fail(Side.FORWARD, exc)
        finally:
            coord.depart(Side.FORWARD)
        try:
            self._wait_until(lambda: job.done, self.join_timeout_s)
        except BaseException as exc:  # e.g. KeyboardInterrupt: stop the worker at its next hook
            coord.fail(Side.FORWARD, exc)
            self._abandon(job)
            raise
        if self._abandon(job):
            err = CoordinatorTimeout(
                self._site("join"), f"the backward thread {self._thread.name!r} to finish run "
                f"{run} (it is still running; the next run waits for it)", self.join_timeout_s,
                coord.recent_events())
            with coord.condition:
                coord.record_timeout(err)  # its next hook raises; it ends the run when done
                failure = coord.failure
            if fwd_error is None:
                fwd_error = err
        else:
            failure = coord.failure  # read before end_run, which forgets it
            coord.end_run()
        if fwd_error is not None:
            self.last_errors["forward"] = fwd_error
        if job.error is not None:
            self.last_errors["backward"] = job.error
        if not self.last_errors:
            return fwd_result, job.result
        raise self._primary_error(run, failure)

    def _abandon(self, job: _Job) -> bool:
        """Hand the end of the run to the worker if it is still busy; True when it is."""
        with self._state.cond:
            if job.done:
                return False
            job.abandoned = True
            return True

    def _primary_error(self, run: int,
                       failure: tuple[str, BaseException] | None) -> BaseException:
        errors = self.last_errors
        if failure is not None and failure[1] in errors.values():
            side, primary = failure
        else:  # e.g. the join timeout, recorded after the run's first failure
            side, primary = next(iter(errors.items()))
        if _in_chain(primary, CoordinatorTimeout):
            # A side that ran out of time waiting for the token or a hand-over waited for the
            # other side; if that side failed on its own (e.g. a receive or an all-to-all that
            # timed out), its error is the cause, whichever of the two deadlines passed first.
            for other_side, err in errors.items():
                if err is not primary and not _in_chain(err, CoordinatorError):
                    side, primary = other_side, err
                    break
        thread = (threading.current_thread().name if side == "forward"
                  else (self._thread.name if self._thread else "?"))
        primary.add_note(f"[overlap_runtime] raised in the {side} thread {thread!r} of "
                         f"CommComputeOverlap run {run}")
        for other_side, err in errors.items():
            if err is primary or _is_abort(err):
                continue
            primary.add_note(f"[overlap_runtime] the {other_side} thread also raised "
                             f"{type(err).__name__}: {str(err).splitlines()[0]}")
        return primary

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout_s: float | None = None) -> None:
        """Stop the worker and join it (bounded); raises CoordinatorTimeout if it is stuck."""
        self._state.shut()
        t = self._thread
        if t is None:
            return
        limit = self.join_timeout_s if timeout_s is None else timeout_s
        t.join(limit)
        if t.is_alive():
            raise CoordinatorTimeout(self._site("close"), f"the backward worker {t.name!r} to exit",
                                     limit, self.coordinator.recent_events())
        self._thread = None

    def __enter__(self) -> "CommComputeOverlap":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except CoordinatorTimeout as err:
            if exc_type is None:
                raise
            warnings.warn(f"CommComputeOverlap.close during an exception: {err}", stacklevel=2)

    def __repr__(self) -> str:
        return (f"CommComputeOverlap(device={self.device}, runs={self.runs}, worker="
                f"{self._thread.name if self._thread else None})")
