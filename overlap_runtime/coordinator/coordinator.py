"""HookCoordinator: the comm-token state machine behind the A/B/C/D sync hooks.

Two threads run one OVERLAP_B_F step: the *forward* side (microbatch i+1, the calling thread) and
the *backward* side (microbatch i, a worker thread and, on accelerators, autograd's device
threads). Each MoE layer brackets its dispatch all-to-all with hooks A/B and its combine with C/D;
between the hooks of a pair lies a *comm region*, elsewhere a *compute region*. Every hook has a
role, COMM (a comm region starts) or COMPUTE (a comm region ends)::

    forward  (program order):  A=COMM  B=COMPUTE  C=COMM  D=COMPUTE  (D_LAST=COMPUTE, no wait)
    backward (autograd order): D=COMM  C=COMPUTE  B=COMM  A=COMPUTE  (D_LAST=COMM)

State machine (one Condition guards it all)::

    holder      which side owns the comm token; BACKWARD at run start (the backward chunk opens
                with its combine-backward all-to-all, the forward chunk with compute)
    in_comm[s]  side s is inside a comm region (then holder == s)
    acq[s]      how many comm regions side s has entered (the hand-over counter)
    active[s]   side s is still running (cleared when its function returns: "departs")
    failure     first (side, exception) of this run; every wait checks it; end_run drops it

    COMM hook on side s       wait until holder == s or the peer departed; then in_comm[s] = True,
                              acq[s] += 1 (launch your all-to-all now)
    COMPUTE hook on side s    in_comm[s] = False; holder = peer; then wait until acq[peer]
                              grows (the peer reached its next COMM hook) or the peer departed,
                              so this side's compute starts once the peer's comm is launched
    D_LAST forward            like COMPUTE but returns at once: it only hands over (nothing in the
                              forward chunk is left to hide the peer's comm behind)
    D_LAST backward           a COMM hook that never waits at the start of a backward chunk,
                              because the backward side owns the token then ("skips" the
                              rendezvous); met anywhere else it waits like D, so order holds

**Depart/drain rule.** When a side's function returns it *departs*: ``active`` is cleared, the
token passes to the peer, and from then on the peer's hooks never wait for it (the peer drains its
remaining hooks alone, still one comm region at a time). So a forward chunk with 2 MoE layers
paired with a backward chunk with 3 finishes: the last layer's hooks on the long side run solo.

The launch order this machine produces (backward first, alternating turns, the longer side
draining alone) is written once as data, ``schedules.overlap_order.comm_turns``: the step graph
chains the all-to-alls with it and the tests compare this machine's ``comm_order`` with it.

**Recompute bypass.** A forward hook running in any thread other than the run's forward thread is
an activation-checkpoint replay (torch.utils.checkpoint recomputes in the thread that runs the
backward, reentrant or not). Replay hooks never join the pairing (no hand-over waits, no change to
the letter order or to ``in_comm``); only their comm regions (A->B, C->D) take the token, so the
replayed all-to-alls still launch in one order on every rank. A replay inside a backward comm
region runs in it; a replay in a compute region takes a turn of its own (it waits for the token,
and gives it to the forward side at its release, like a COMPUTE hook that does not wait), so the
turns still alternate in an order fixed by program order. A replay cut short by checkpoint's early
stop keeps the token until the backward side's next real hook. Detection needs no private torch
API and no ``context_fn``.

Every wait is ``Condition.wait(remaining)`` in a loop that rechecks ``failure``, ``enabled`` and
the run: a failure, ``disable()`` or the run's end wakes every waiter at once; a wait that reaches
``timeout_s`` records a :class:`CoordinatorTimeout` as the run's failure, so both sides raise it.
Outside a run (see :meth:`start_run`) or when disabled, hooks are identities.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Callable, Mapping

from overlap_runtime.coordinator.errors import (
    CoordinatorAborted,
    CoordinatorProtocolError,
    CoordinatorTimeout,
    WaitSite,
)
from overlap_runtime.coordinator.serializer import CommSerializer
from overlap_runtime.ops.profile_range import profile_range


class Side(str, Enum):
    """Which thread of an OVERLAP_B_F step a hook belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"

    @property
    def peer(self) -> "Side":
        return Side.BACKWARD if self is Side.FORWARD else Side.FORWARD


class Role(str, Enum):
    """What a hook does: COMM opens a comm region, COMPUTE closes it (hands the token over)."""

    COMM = "COMM"
    COMPUTE = "COMPUTE"


HOOK_LETTERS: tuple[str, ...] = ("A", "B", "C", "D", "D_LAST")

FORWARD_ROLES: Mapping[str, Role] = MappingProxyType(
    {"A": Role.COMM, "B": Role.COMPUTE, "C": Role.COMM, "D": Role.COMPUTE, "D_LAST": Role.COMPUTE})
BACKWARD_ROLES: Mapping[str, Role] = MappingProxyType(
    {"D": Role.COMM, "D_LAST": Role.COMM, "C": Role.COMPUTE, "B": Role.COMM, "A": Role.COMPUTE})

# Letter order per side; None is the state before a side's first hook in a run.
_NEXT: dict[Side, dict[str | None, frozenset[str]]] = {
    Side.FORWARD: {None: frozenset({"A"}), "A": frozenset({"B"}), "B": frozenset({"C"}),
                   "C": frozenset({"D", "D_LAST"}), "D": frozenset({"A"}),
                   "D_LAST": frozenset({"A"})},
    Side.BACKWARD: {None: frozenset({"D", "D_LAST"}), "D": frozenset({"C"}),
                    "D_LAST": frozenset({"C"}), "C": frozenset({"B"}), "B": frozenset({"A"}),
                    "A": frozenset({"D", "D_LAST"})},
}


@dataclass(frozen=True)
class HookEvent:
    """One step of the state machine, kept in the ring buffer (and the full trace in debug)."""

    seq: int
    run: int
    side: str
    letter: str | None
    layer: int
    action: str
    detail: str = ""

    def __str__(self) -> str:
        hook = f"{self.letter}@L{self.layer}" if self.letter else "-"
        tail = f" ({self.detail})" if self.detail else ""
        return f"#{self.seq} run {self.run} {self.side:<8} {hook:<10} {self.action}{tail}"


@dataclass
class _SideState:
    active: bool = False
    in_comm: bool = False
    last_letter: str | None = None
    last_layer: int = -1
    last_seq: int = 0
    acquisitions: int = 0
    thread: str = "?"
    replay_held: bool = False
    replay_owned_before: bool = False


@dataclass
class _Failure:
    side: str
    error: BaseException
    site: WaitSite | None = None


@dataclass
class _RunState:
    run: int = 0
    running: bool = False
    forward_ident: int | None = None
    holder: Side | None = None
    sides: dict[Side, _SideState] = field(default_factory=lambda: {s: _SideState() for s in Side})
    failure: _Failure | None = None


class HookCoordinator:
    """Hands the comm token between the forward and backward threads at each sync hook.

    Args:
        timeout_s: bound of every wait (hand-over, token, group lock), seconds, > 0.
        debug: keep the full event trace (:meth:`trace`) and the serializer's launch log.
        events_kept: size of the ring buffer of recent events that errors print.

    ``serializer`` (a :class:`CommSerializer` sharing this coordinator's lock and failure flag)
    serializes the all-to-alls per process group. Drive a run with :class:`CommComputeOverlap`,
    or by hand: :meth:`start_run`, each side's :meth:`depart` (or :meth:`fail`), :meth:`end_run`.
    """

    def __init__(self, timeout_s: float = 300.0, *, debug: bool = False,
                 events_kept: int = 32) -> None:
        if not timeout_s > 0:
            raise ValueError(f"HookCoordinator: timeout_s must be > 0, got {timeout_s}")
        if events_kept < 1:
            raise ValueError(f"HookCoordinator: events_kept must be >= 1, got {events_kept}")
        self._timeout_s = float(timeout_s)
        self._debug = debug
        self.condition = threading.Condition()
        self._enabled = True
        self._state = _RunState()
        self._seq = 0
        self._events: deque[HookEvent] = deque(maxlen=events_kept)
        self._trace: list[HookEvent] = []
        self.serializer = CommSerializer(self._timeout_s, debug=debug, guard=self)

    # ------------------------------------------------------------------ configuration
    @property
    def timeout_s(self) -> float:
        """Bound of every wait, seconds."""
        return self._timeout_s

    @property
    def debug(self) -> bool:
        return self._debug

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        """Make hooks coordinate again (the next hook follows the state machine)."""
        with self.condition:
            self._enabled = True
            self._event(None, None, -1, "enable")

    def disable(self) -> None:
        """Turn every hook into an identity and release every waiter at once.

        Meant for serial runs and for bailing out; disabling in the middle of a run ends the
        one-order-on-every-rank guarantee for the rest of that run (no thread hangs, though).
        """
        with self.condition:
            self._enabled = False
            self._event(None, None, -1, "disable")
            self.condition.notify_all()

    # ------------------------------------------------------------------ run lifecycle
    @property
    def running(self) -> bool:
        return self._state.running

    @property
    def run_id(self) -> int:
        """Number of the current (or last) run, from 1."""
        return self._state.run

    def start_run(self, forward_thread: int | None = None,
                  backward_thread_name: str = "backward") -> int:
        """Begin a pairing: both sides active, token with the backward side, failure cleared.

        ``forward_thread`` is the ``threading.get_ident()`` of the thread that runs the forward
        chunk (default: the caller). Returns the run number.
        """
        with self.condition:
            st = self._state
            if st.running:
                raise CoordinatorProtocolError(
                    f"start_run: run {st.run} is still active (end_run was not called)")
            run = st.run + 1
            self._state = _RunState(run=run, running=True, holder=Side.BACKWARD,
                                    forward_ident=forward_thread or threading.get_ident())
            fwd_name = _thread_name(self._state.forward_ident)
            self._state.sides[Side.FORWARD] = _SideState(active=True, thread=fwd_name)
            self._state.sides[Side.BACKWARD] = _SideState(active=True, thread=backward_thread_name)
            self.serializer.reset_locks()
            self._event(None, None, -1, "start-run", f"forward thread {fwd_name!r}")
            self.condition.notify_all()
            return run

    def depart(self, side: Side) -> None:
        """``side`` finished its function: the peer stops waiting for it (depart/drain rule)."""
        side = Side(side)
        with self.condition:
            st = self._state
            s = st.sides[side]
            if not s.active:
                return
            s.active = False
            s.in_comm = False
            if st.holder is side and st.sides[side.peer].active:
                st.holder = side.peer
            self._event(side, None, -1, "depart")
            self.condition.notify_all()

    def fail(self, side: Side, error: BaseException) -> bool:
        """Record ``side``'s exception and wake the peer; True when it is the run's first.

        Called in the failing thread: the all-to-alls whose launch lock it still holds (a
        reverse all-to-all that raised) are added to ``error`` as notes, naming the tag and the
        group's global ranks."""
        side = Side(side)
        for launch in self.serializer.held_by(threading.get_ident()):
            error.add_note(f"[overlap_runtime] the {side.value} thread failed with {launch} "
                           f"in flight")
        with self.condition:
            first = self._state.failure is None
            if first:
                self._state.failure = _Failure(side.value, error)
            self._state.sides[side].active = False
            self._event(side, None, -1, "fail", f"{type(error).__name__}")
            self.condition.notify_all()
            return first

    def end_run(self) -> None:
        """Close the run; later hooks are identities until the next :meth:`start_run`.

        The run's failure is forgotten (:attr:`failure` becomes None): its exception's traceback
        holds the callers' frames (the overlap, tensors whose autograd nodes hold this
        coordinator), and a coordinator that kept it would keep all of that, and a dropped
        overlap's worker thread, alive in a cycle the garbage collector cannot see through.
        """
        with self.condition:
            self._state.running = False
            self._state.forward_ident = None
            self._state.failure = None
            self._event(None, None, -1, "end-run")
            self.condition.notify_all()

    @property
    def failure(self) -> tuple[str, BaseException] | None:
        """``(side, exception)`` of the running run's first failure; None when none or ended."""
        f = self._state.failure
        return None if f is None else (f.side, f.error)

    # ------------------------------------------------------------------ introspection
    def recent_events(self) -> list[HookEvent]:
        """The ring buffer: the last ``events_kept`` events, oldest first."""
        with self.condition:
            return list(self._events)

    def trace(self) -> list[HookEvent]:
        """Every event since construction or :meth:`clear_trace` (debug mode only)."""
        if not self._debug:
            raise CoordinatorProtocolError("trace() needs HookCoordinator(debug=True)")
        with self.condition:
            return list(self._trace)

    def clear_trace(self) -> None:
        with self.condition:
            self._trace.clear()

    def comm_order(self, run: int | None = None) -> list[tuple[str, str, int]]:
        """Comm regions in the order they were entered: ``(side, letter, layer)`` (debug only).

        Replayed regions (recompute) appear with the letter prefixed ``replay:``.
        """
        out = []
        for e in self.trace():
            if run is not None and e.run != run:
                continue
            if e.action == "acquire":
                out.append((e.side, e.letter or "", e.layer))
            elif e.action == "replay-acquire":
                out.append((e.side, f"replay:{e.letter}", e.layer))
        return out

    # ------------------------------------------------------------------ the hook
    def hook(self, direction: Side, letter: str, layer: int) -> None:
        """Run the state machine for one sync hook; called by :func:`sync_hook` (both passes).

        ``direction`` is the autograd pass the hook runs in (FORWARD for ``Function.forward``).
        Blocks at most ``timeout_s`` per wait; raises :class:`CoordinatorTimeout`,
        :class:`CoordinatorAborted` or :class:`CoordinatorProtocolError`.
        """
        direction = Side(direction)
        if letter not in HOOK_LETTERS:
            raise ValueError(f"sync hook letter {letter!r} is not one of {list(HOOK_LETTERS)}")
        with profile_range(lambda: f"hook {letter} {direction.value} L{layer}"):
            self._hook(direction, letter, layer)

    def _hook(self, direction: Side, letter: str, layer: int) -> None:
        with self.condition:
            st = self._state
            if not st.running or not self._enabled:
                return
            me = threading.get_ident()
            if direction is Side.FORWARD and me != st.forward_ident:
                self._replay_hook(letter, layer)
                return
            if direction is Side.BACKWARD and me == st.forward_ident:
                site = self._new_site(Side.BACKWARD, letter, layer)
                raise CoordinatorProtocolError(
                    f"{site}: a backward hook ran in the forward thread; run the backward chunk "
                    f"in the backward callable of CommComputeOverlap.run")
            side = direction
            s = st.sides[side]
            peer = st.sides[side.peer]
            site = self._new_site(side, letter, layer)
            self._raise_if_failed(site)
            s.replay_held = False  # a real hook ends any replay region cut short (early stop)
            allowed = _NEXT[side][s.last_letter]
            if letter not in allowed:
                raise CoordinatorProtocolError(
                    f"{site}: hook {letter} out of order on the {side.value} side; after "
                    f"{s.last_letter or 'the start'} expected one of {sorted(allowed)}")
            s.last_letter, s.last_layer, s.last_seq = letter, layer, site.seq
            role = (FORWARD_ROLES if side is Side.FORWARD else BACKWARD_ROLES)[letter]
            if role is Role.COMM:
                self._event(side, letter, layer, "arrive", "COMM", site.seq)
                self._wait(site, lambda: st.holder is side or not peer.active,
                           f"the comm token (held by the {st.holder.value if st.holder else '-'} "
                           f"side)")
                st.holder = side
                s.in_comm = True
                s.acquisitions += 1
                self._event(side, letter, layer, "acquire", "", site.seq)
                self.condition.notify_all()
                return
            s.in_comm = False
            if peer.active:
                st.holder = side.peer
            mark = peer.acquisitions
            self._event(side, letter, layer, "handover", "", site.seq)
            self.condition.notify_all()
            if side is Side.FORWARD and letter == "D_LAST":
                return
            self._wait(site, lambda: peer.acquisitions > mark or not peer.active,
                       f"the {side.peer.value} thread to reach its next COMM hook")
            self._event(side, letter, layer, "proceed", "", site.seq)

    def _replay_hook(self, letter: str, layer: int) -> None:
        """A forward hook during activation-checkpoint recompute (see the module doc)."""
        st = self._state
        s = st.sides[Side.BACKWARD]
        fwd = st.sides[Side.FORWARD]
        site = self._new_site(Side.BACKWARD, letter, layer)
        self._raise_if_failed(site)
        if FORWARD_ROLES[letter] is Role.COMM:
            if s.replay_held:
                return
            # Whether the replay sits inside a comm region of the backward side is a fact of its
            # own program order; ``holder`` is not (the forward may or may not have handed over
            # yet), and deciding on it made the launch order timing-dependent.
            owned = s.in_comm
            self._wait(site, lambda: st.holder is Side.BACKWARD or not fwd.active,
                       "the comm token for a recompute replay")
            st.holder = Side.BACKWARD
            s.replay_held, s.replay_owned_before = True, owned
            s.acquisitions += 1
            self._event(Side.BACKWARD, letter, layer, "replay-acquire", "", site.seq)
        else:
            if not s.replay_held:
                return
            s.replay_held = False
            if not s.replay_owned_before and fwd.active:
                st.holder = Side.FORWARD
            self._event(Side.BACKWARD, letter, layer, "replay-release", "", site.seq)
        self.condition.notify_all()

    # ------------------------------------------------------------------ waits and failures
    def _wait(self, site: WaitSite, ready: Callable[[], bool], waiting_for: str) -> None:
        """Bounded wait on the condition (held by the caller), failure- and disable-aware."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            self._raise_if_failed(site)
            if not self._enabled or not self._state.running or ready():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                err = CoordinatorTimeout(site, waiting_for, self._timeout_s, list(self._events))
                self.record_timeout(err)
                raise err
            self.condition.wait(remaining)

    def _raise_if_failed(self, site: WaitSite) -> None:
        f = self._state.failure
        if f is None or not self._state.running:  # a finished run's failure binds no one
            return
        self._event(Side(site.side), site.letter, site.layer, "stop",
                    f"{f.side} failed", site.seq)
        if isinstance(f.error, CoordinatorTimeout):
            raise CoordinatorTimeout(site, f.error.waiting_for, f.error.timeout_s,
                                     list(self._events), origin=f.error.origin)
        raise CoordinatorAborted(site, f.side, f.error, list(self._events))

    # The three methods below form the guard protocol the CommSerializer waits through.
    def raise_if_failed(self, site: WaitSite) -> None:
        """Raise the run's failure for ``site`` (call with :attr:`condition` held)."""
        self._raise_if_failed(site)

    def record_timeout(self, err: CoordinatorTimeout) -> None:
        """Make ``err`` the run's failure (if it is the first) and wake everyone; lock held."""
        if self._state.failure is None and self._state.running:
            self._state.failure = _Failure(err.site.side, err, err.site)
        self._event(Side(err.site.side) if err.site.side in ("forward", "backward") else None,
                    err.site.letter, err.site.layer, "timeout", err.waiting_for, err.site.seq)
        self.condition.notify_all()

    def current_site(self) -> WaitSite:
        """Where the calling thread stands (side, last hook), for waits outside hooks; locked."""
        st = self._state
        me = threading.get_ident()
        if not st.running:
            return WaitSite("caller", threading.current_thread().name, None, -1, self._seq, st.run)
        side = Side.FORWARD if me == st.forward_ident else Side.BACKWARD
        s = st.sides[side]
        return WaitSite(side.value, threading.current_thread().name, s.last_letter,
                        s.last_layer, s.last_seq, st.run)

    def recent(self) -> list[HookEvent]:
        """Ring-buffer contents for error messages (lock held by the caller)."""
        return list(self._events)

    # ------------------------------------------------------------------ bookkeeping
    def _new_site(self, side: Side, letter: str | None, layer: int) -> WaitSite:
        self._seq += 1
        return WaitSite(side.value, threading.current_thread().name, letter, layer, self._seq,
                        self._state.run)

    def _event(self, side: Side | None, letter: str | None, layer: int, action: str,
               detail: str = "", seq: int | None = None) -> None:
        ev = HookEvent(self._seq if seq is None else seq, self._state.run,
                       side.value if side else "-", letter, layer, action, detail)
        self._events.append(ev)
        if self._debug:
            self._trace.append(ev)

    def __repr__(self) -> str:
        st = self._state
        return (f"HookCoordinator(timeout_s={self._timeout_s}, enabled={self._enabled}, "
                f"run={st.run}, running={st.running}, holder="
                f"{st.holder.value if st.holder else None})")


def _thread_name(ident: int | None) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return str(ident)
