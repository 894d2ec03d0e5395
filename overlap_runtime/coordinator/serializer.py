"""CommSerializer: at most one all-to-all in flight per process group, across both threads.

Launching two all-to-alls on one group from two threads at once corrupts data on HCCL and
mismatches collectives on gloo/NCCL when ranks interleave them differently. The serializer owns
one lock per group; :meth:`CommSerializer.all_to_all_single` takes it before the launch and gives
it back when the all-to-all completes (at once for a synchronous call, at ``handle.wait()`` for an
async one). The backward all-to-all is bracketed the same way by two identity autograd nodes::

    forward:   acquire(group) -> launch -> [wait] -> release
    backward:  _AcquireOnBackward.backward (acquire, log) -> reverse all-to-all (waited)
               -> _ReleaseOnBackward.backward (release)

The lock gives mutual exclusion; the *order* of launches is fixed by the HookCoordinator's comm
token, which hands comm regions to the two threads in an order that depends only on program
order. Debug mode records every launch (tag and direction) per group; :meth:`check_launch_order`
gathers the logs of all ranks of a group (bounded collectives) and raises
:class:`LaunchOrderMismatch` naming the first launch that differs.

Every lock wait is a ``Condition.wait(remaining)`` loop on the guard's condition (the owning
coordinator's), rechecking its failure flag: a failure in the other thread wakes it at once.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.coordinator.errors import (
    CoordinatorProtocolError,
    CoordinatorTimeout,
    LaunchOrderMismatch,
    WaitSite,
)
from overlap_runtime.ops import comm


class WaitGuard(Protocol):
    """What the serializer needs from its owner: a shared condition and the failure flag."""

    condition: threading.Condition

    def raise_if_failed(self, site: WaitSite) -> None: ...

    def record_timeout(self, err: CoordinatorTimeout) -> None: ...

    def current_site(self) -> WaitSite: ...

    def recent(self) -> list[Any]: ...


class _StandaloneGuard:
    """Guard of a serializer used without a coordinator: no failure flag, its own condition."""

    def __init__(self) -> None:
        self.condition = threading.Condition()

    def raise_if_failed(self, site: WaitSite) -> None:
        return None

    def record_timeout(self, err: CoordinatorTimeout) -> None:
        return None

    def current_site(self) -> WaitSite:
        return WaitSite("caller", threading.current_thread().name, None, -1, 0, 0)

    def recent(self) -> list[Any]:
        return []


@dataclass(frozen=True)
class LaunchRecord:
    """One all-to-all launch on a group: ``index`` (0-based), ``tag``, autograd ``direction``,
    the coordinator ``side`` and Python ``thread`` that launched it (not compared across ranks).
    """

    index: int
    tag: str
    direction: str
    side: str
    thread: str

    def key(self) -> tuple[str, str]:
        """What must match across ranks: ``(tag, direction)``."""
        return (self.tag, self.direction)

    def __str__(self) -> str:
        return f"#{self.index} {self.tag} ({self.direction}, {self.side} side, {self.thread})"


@dataclass
class _Ticket:
    key: Any
    label: str
    tag: str
    direction: str
    thread_ident: int
    site: WaitSite

    def __str__(self) -> str:
        return f"{self.tag!r} ({self.direction}) from {self.site}"


def _group_key(group: dist.ProcessGroup | None) -> Any:
    if group is None or group is dist.GroupMember.WORLD:
        return "default"
    return group


def _group_label(group: dist.ProcessGroup | None) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "default"
    return str(getattr(group, "group_name", None) or f"group@{id(group):x}")


def _group_ranks(key: Any) -> str:
    """The global ranks of a group key, for error messages (``?`` when unknown)."""
    try:
        if key == "default":
            return str(list(range(dist.get_world_size())))
        return str(dist.get_process_group_ranks(key))
    except Exception:  # noqa: BLE001 - only a message; the group may be gone
        return "?"


def _describe_launch(ticket: _Ticket) -> str:
    """``all-to-all 'S3.L1.combine' (backward) on group '2' (global ranks [2, 3])``."""
    return (f"all-to-all {ticket.tag!r} ({ticket.direction}) on group {ticket.label!r} "
            f"(global ranks {_group_ranks(ticket.key)})")


class CommSerializer:
    """Per-group launch lock and (in debug mode) launch log; see the module doc.

    Args:
        timeout_s: bound of every lock wait and of the collectives it launches, seconds.
        debug: record launches for :meth:`launch_log` and :meth:`check_launch_order`.
        guard: the owner (a HookCoordinator) whose condition and failure flag waits use.
    """

    def __init__(self, timeout_s: float = 300.0, *, debug: bool = False,
                 guard: WaitGuard | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"CommSerializer: timeout_s must be > 0, got {timeout_s}")
        self._timeout_s = float(timeout_s)
        self._debug = debug
        self._guard: WaitGuard = guard if guard is not None else _StandaloneGuard()
        self._holders: dict[Any, _Ticket] = {}
        self._logs: dict[str, list[LaunchRecord]] = {}

    # ------------------------------------------------------------------ lock
    def acquire(self, group: dist.ProcessGroup | None, tag: str, direction: str) -> _Ticket:
        """Take ``group``'s launch lock (bounded); log the launch in debug mode."""
        key, label = _group_key(group), _group_label(group)
        cond = self._guard.condition
        me = threading.get_ident()
        with cond:
            site = self._guard.current_site()
            held = self._holders.get(key)
            if held is not None and held.thread_ident == me:
                raise CoordinatorProtocolError(
                    f"all-to-all {tag!r} ({direction}) on group {label!r}: this thread still has "
                    f"{held} in flight; at most one all-to-all per group may be in flight, wait "
                    f"its handle first")
            deadline = time.monotonic() + self._timeout_s
            while True:
                self._guard.raise_if_failed(site)
                held = self._holders.get(key)
                if held is None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    err = CoordinatorTimeout(
                        site, f"the launch lock of group {label!r} for {tag!r} (held by {held})",
                        self._timeout_s, self._guard.recent())
                    self._guard.record_timeout(err)
                    raise err
                cond.wait(remaining)
            ticket = _Ticket(key, label, tag, direction, me, site)
            self._holders[key] = ticket
            if self._debug:
                log = self._logs.setdefault(label, [])
                log.append(LaunchRecord(len(log), tag, direction, site.side,
                                        threading.current_thread().name))
            return ticket

    def release(self, ticket: _Ticket | None) -> None:
        """Give the lock back (idempotent) and wake waiters."""
        if ticket is None:
            return
        with self._guard.condition:
            if self._holders.get(ticket.key) is ticket:
                del self._holders[ticket.key]
                self._guard.condition.notify_all()

    def reset_locks(self) -> None:
        """Drop every lock (a new run starts after the threads of the last one stopped)."""
        with self._guard.condition:
            self._holders.clear()
            self._guard.condition.notify_all()

    def held_by(self, thread_ident: int) -> list[str]:
        """Descriptions of the launches whose lock ``thread_ident`` holds (in flight, or failed
        before their release: a reverse all-to-all that raised never reaches it)."""
        with self._guard.condition:
            tickets = [t for t in self._holders.values() if t.thread_ident == thread_ident]
        return [_describe_launch(t) for t in tickets]

    def in_flight(self, group: dist.ProcessGroup | None = None) -> str | None:
        """Description of the launch holding ``group``'s lock, or None."""
        with self._guard.condition:
            t = self._holders.get(_group_key(group))
            return None if t is None else str(t)

    # ------------------------------------------------------------------ log
    def launch_log(self, group: dist.ProcessGroup | None = None) -> list[LaunchRecord]:
        """Launches on ``group`` since construction or :meth:`clear_log` (debug mode)."""
        if not self._debug:
            raise CoordinatorProtocolError("launch_log() needs debug=True")
        with self._guard.condition:
            return list(self._logs.get(_group_label(group), []))

    def clear_log(self) -> None:
        with self._guard.condition:
            self._logs.clear()

    def check_launch_order(self, group: dist.ProcessGroup | None = None,
                           timeout_s: float | None = None) -> int:
        """Collective over ``group``: compare every rank's launch log; return its length.

        Call it on every rank of ``group`` from one thread while no run is active. Raises
        :class:`LaunchOrderMismatch` on every rank when the logs differ.
        """
        mine = [list(r.key()) for r in self.launch_log(group)]
        payload = torch.tensor(list(json.dumps(mine).encode()), dtype=torch.uint8)
        t = self._timeout_s if timeout_s is None else timeout_s
        sizes = comm.all_gather(torch.tensor([payload.numel()], dtype=torch.int64), 0, group, t)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = comm.all_gather(padded, 0, group, t).view(-1, longest)
        logs = {}
        for r in range(gathered.shape[0]):
            raw = bytes(gathered[r, : int(sizes[r])].tolist())
            logs[r] = [tuple(e) for e in json.loads(raw.decode())]
        return compare_launch_logs(logs, _group_label(group))

    # ------------------------------------------------------------------ the collective
    def all_to_all_single(
        self,
        x: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        tag: str,
        async_op: bool = False,
        timeout_s: float | None = None,
    ) -> torch.Tensor | tuple["SerializedHandle", torch.Tensor]:
        """:func:`overlap_runtime.ops.comm.all_to_all_single` under ``group``'s launch lock.

        Same arguments and results (``[sum(output_splits), *rest]``, x's dtype) plus ``tag``, the
        name logged and compared across ranks (e.g. ``"L3.dispatch"``). With ``async_op`` the lock
        is held until the returned handle's ``wait``; the backward all-to-all holds it too.
        """
        t = self._timeout_s if timeout_s is None else float(timeout_s)
        ticket = self.acquire(group, tag, "forward")
        box: list[_Ticket] = []
        try:
            x_in = _ReleaseOnBackward.apply(x, self, box) if x.requires_grad else x
            handle, out = comm.all_to_all_single(x_in, output_splits, input_splits, group,
                                                 async_op=True, timeout_s=t, what=tag)
            if out.requires_grad:
                out = _AcquireOnBackward.apply(out, self, group, tag, box)
        except BaseException:
            self.release(ticket)
            raise
        wrapped = SerializedHandle(handle, self, ticket)
        if async_op:
            return wrapped, out
        wrapped.wait()
        return out


class SerializedHandle:
    """An async all-to-all's handle that releases the group lock when waited (idempotent)."""

    def __init__(self, handle: comm.AsyncHandle, serializer: CommSerializer,
                 ticket: _Ticket) -> None:
        self._handle = handle
        self._serializer = serializer
        self._ticket: _Ticket | None = ticket

    @property
    def completed(self) -> bool:
        return self._handle.completed

    def wait(self, timeout_s: float | None = None) -> None:
        """Complete the all-to-all (bounded) and release the lock, even if the wait raises (a
        failed wait's message names the launch: its tag, direction, group and global ranks)."""
        try:
            self._handle.wait(timeout_s)
        except (comm.CommTimeoutError, comm.CommFailedError) as exc:
            if self._ticket is not None and exc.args:
                # in the message itself, not a note: str(exc) is what logs and rank reports show
                exc.args = (f"{_describe_launch(self._ticket)}: {exc.args[0]}", *exc.args[1:])
            raise
        finally:
            ticket, self._ticket = self._ticket, None
            self._serializer.release(ticket)

    def __repr__(self) -> str:
        return f"SerializedHandle({self._handle!r})"


class _AcquireOnBackward(torch.autograd.Function):
    """Identity; its backward takes the group lock before the reverse all-to-all runs."""

    @staticmethod
    def forward(ctx: FunctionCtx, out: torch.Tensor, serializer: CommSerializer,
                group: dist.ProcessGroup | None, tag: str, box: list[_Ticket]) -> torch.Tensor:
        ctx.serializer, ctx.group, ctx.tag, ctx.box = serializer, group, tag, box
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.box.append(ctx.serializer.acquire(ctx.group, ctx.tag, "backward"))
        return grad, None, None, None, None


class _ReleaseOnBackward(torch.autograd.Function):
    """Identity; its backward releases the lock once the reverse all-to-all has completed."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, serializer: CommSerializer,
                box: list[_Ticket]) -> torch.Tensor:
        ctx.serializer, ctx.box = serializer, box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        while ctx.box:
            ctx.serializer.release(ctx.box.pop())
        return grad, None, None


def compare_launch_logs(logs: Mapping[int, Sequence[Any]], group: str = "default") -> int:
    """Compare per-rank launch logs (LaunchRecords or ``(tag, direction)`` tuples).

    Returns the common length; raises :class:`LaunchOrderMismatch` at the first index where any
    rank differs (including a rank that has fewer launches).
    """
    keys = {r: [e.key() if isinstance(e, LaunchRecord) else tuple(e) for e in log]
            for r, log in logs.items()}
    longest = max((len(v) for v in keys.values()), default=0)
    for i in range(longest):
        at = {r: (v[i] if i < len(v) else None) for r, v in keys.items()}
        if len(set(at.values())) > 1:
            raise LaunchOrderMismatch(group, i, at)
    return longest
