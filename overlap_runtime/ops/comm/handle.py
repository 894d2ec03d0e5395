"""Bounded waits: :class:`AsyncHandle`, :class:`CommTimeoutError` and the default timeout.

Every wait in the runtime goes through :func:`wait_work` and is bounded by ``timeout_s``
(default :data:`DEFAULT_TIMEOUT_S`, overridable with the environment variable
``OVERLAP_RUNTIME_COMM_TIMEOUT_S``).

How a timeout is recognised (host side, gloo)
---------------------------------------------
By our own clock, never by an exception's text. ``Work.wait(timeout)`` is the only bounded host
wait gloo offers: its point-to-point works report ``is_completed() == False`` until ``wait`` has
been called, even after the data has arrived, so polling them against a deadline cannot work;
and a timed-out wait raises a plain ``RuntimeError`` (torch 2.13: ``"Timed out waiting 500ms for
recv operation to complete"``, or ``"Application timeout caused pair closure"`` for a later op on
the closed pair), the same type as any other failure. So the wait is given a whole number of
milliseconds, timed with ``time.monotonic`` (the steady clock gloo's deadline uses too), and an
exception is a :class:`CommTimeoutError` exactly when it came after that bound elapsed; an
earlier one (a peer died, the pair was closed by an earlier timeout) is a
:class:`CommFailedError`. The backend's own exception is chained either way.

Device side (cuda/npu)
----------------------
For NCCL/HCCL works on device tensors ``wait()`` orders the current stream after the work and
returns; the CPU goes on. That wait is bounded by the process group's timeout, which the
NCCL/HCCL watchdog enforces (``launch.init_from_env`` sets it). A host-side ``wait(timeout)``
there would spin until completion and turn every overlap into a host sync.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..profile_range import profile_range

DEFAULT_TIMEOUT_S = float(os.environ.get("OVERLAP_RUNTIME_COMM_TIMEOUT_S", "300"))


class CommTimeoutError(TimeoutError):
    """A collective or point-to-point wait passed its timeout (the message names the op)."""


class CommFailedError(RuntimeError):
    """A collective or point-to-point work failed before its timeout (e.g. a peer died)."""


def resolve_timeout(timeout_s: float | None) -> float:
    """``timeout_s`` as a positive float; None means :data:`DEFAULT_TIMEOUT_S`."""
    t = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if not t > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return t


def _is_device_side(device: torch.device | str | None) -> bool:
    """Whether waits for works on ``device`` are device-side (cuda, npu) rather than host waits."""
    return device is not None and torch.device(device).type in ("cuda", "npu")


def wait_work(work: Any, timeout_s: float, what: str,
              device: torch.device | str | None = None) -> None:
    """Complete one ``torch.distributed`` work within ``timeout_s`` seconds (see module doc).

    ``work`` None (a world of one rank) returns at once. ``device``: the tensors' device; on
    cuda/npu the wait is device-side. Raises :class:`CommTimeoutError` (the bound elapsed) or
    :class:`CommFailedError` (the work failed earlier), both naming ``what``.
    """
    if work is None:
        return
    if _is_device_side(device):
        work.wait()
        return
    bound_ms = max(1, math.ceil(timeout_s * 1000.0))
    start = time.monotonic()
    try:
        ok = work.wait(timeout=datetime.timedelta(milliseconds=bound_ms))
    except RuntimeError as exc:
        elapsed = time.monotonic() - start
        if elapsed * 1000.0 >= bound_ms:
            raise CommTimeoutError(f"{what}: not complete after {timeout_s:.1f}s "
                                   f"(waited {elapsed:.2f}s)") from exc
        raise CommFailedError(f"{what} failed after {elapsed:.2f}s of its {timeout_s:.1f}s "
                              f"bound: {exc}") from exc
    if ok is False:
        raise CommTimeoutError(f"{what}: not complete after {timeout_s:.1f}s")


class AsyncHandle:
    """One or more in-flight works; ``wait`` completes them (idempotent, bounded).

    Args:
        works: ``torch.distributed`` works (None entries, from one-rank groups, are dropped).
        description: names the operation (and peers) in every error.
        timeout_s: bound of one ``wait`` over all works (None: :data:`DEFAULT_TIMEOUT_S`).
        on_complete: runs once, in the waiting thread, after the works finish (e.g. a copy
            of a received buffer into place).
        device: the tensors' device; cuda/npu waits are device-side (module doc).
        keep_alive: tensors that must outlive the works, e.g. the contiguous payload of a send;
            held in :attr:`keep_alive` until ``wait`` returns, then released.

    Thread-safe: two threads may call ``wait``; the second returns when the first has finished.
    """

    def __init__(self, works: Sequence[Any], description: str, timeout_s: float | None = None,
                 on_complete: Callable[[], None] | None = None,
                 device: torch.device | str | None = None, *,
                 keep_alive: Sequence[torch.Tensor] = ()) -> None:
        self._works = [w for w in works if w is not None]
        self.description = description
        self.keep_alive: tuple[torch.Tensor, ...] = tuple(keep_alive)
        self._device = device
        self._timeout_s = resolve_timeout(timeout_s)
        self._on_complete = on_complete
        self._done = False
        self._lock = threading.Lock()

    @property
    def completed(self) -> bool:
        """True once ``wait`` has returned."""
        return self._done

    def is_completed(self) -> bool:
        """Poll without blocking: True when ``wait`` would not block.

        Conservative: gloo's point-to-point works answer False until waited, even when their
        data has arrived, so for them this is True only after ``wait``.
        """
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: float | None = None) -> None:
        """Complete every work within ``timeout_s`` in all (default: the handle's timeout).

        Later calls return at once. Raises :class:`CommTimeoutError` or
        :class:`CommFailedError` naming :attr:`description`; the buffers in
        :attr:`keep_alive` stay held after an error (the work may still be in flight).
        """
        with self._lock:
            if self._done:
                return
            t = self._timeout_s if timeout_s is None else resolve_timeout(timeout_s)
            deadline = time.monotonic() + t
            with profile_range(lambda: f"comm.wait {self.description}"):
                for w in self._works:
                    # One deadline for the handle; a work left with no time gets a 1 ms bound,
                    # so a late work still times out instead of being skipped.
                    remaining = max(deadline - time.monotonic(), 1e-3)
                    try:
                        wait_work(w, remaining, self.description, self._device)
                    except CommTimeoutError as exc:
                        raise CommTimeoutError(f"{self.description}: not complete after "
                                               f"{t:.1f}s") from exc
            if self._on_complete is not None:
                self._on_complete()
            self._done = True
            self.keep_alive = ()

    def __repr__(self) -> str:
        return f"AsyncHandle({self.description!r}, completed={self._done})"
