"""ActionContext: the per-step state of one rank and the one API that runs actions, shared by
the built-in executor (``PipelineSchedule.step``) and user callbacks.

A function registered with ``PipelineSchedule.register_custom_function(kind, fn)`` is called as
``fn(action, ctx)``; the executor itself drives the step through the same public methods, so a
callback can do anything the built-in path does:

compute (each waits its input: a received buffer, a local hand-off, or the user's batch)
    ``ctx.run(action)``          F/B/I/W or a compound step, through its registered function
    ``ctx.run_default(action)``  the same, ignoring registered functions
    ``ctx.forward(action)``      F
    ``ctx.backward(action, defer_w=False)``  B or I; ``defer_w=True`` (B only) leaves the
                                 weight gradients of deferred layers in the stage's W queue
    ``ctx.backward_weight(action)``  W
point-to-point (bounded by the schedule's timeout; a stall raises :class:`PipelineTimeout`)
    ``ctx.peer(action)``         group rank at the other end of a SEND/RECV
    ``ctx.post_recv(action)``    post a RECV_F/RECV_B (not waited)
    ``ctx.wait_recv(kind, stage, mb)``  its buffer, waited
    ``ctx.recv_completed(kind, stage, mb)``  poll: True / False (in flight) / None (not posted)
    ``ctx.input_recv(action)``   the receive a compute action consumes, or None
    ``ctx.send(action, wait=False)``  send SEND_F/SEND_B's tensor(s); ``wait_sends()`` waits all
tracing, position and failures
    ``ctx.span(name, cat)``, ``ctx.step_index``, ``ctx.current_action``
    ``ctx.site(action=None)``     where this thread is (:class:`~.errors.ActionSite`)
    ``ctx.action_error(exc, action=None)``  ``exc`` as a :class:`~.errors.PipelineActionError`
    ``ctx.comm_error(exc, action, peer)``  a failed SEND/RECV as a timeout or peer failure

Data: ``ctx.stages`` (this rank's stages by index), ``ctx.inputs[m]`` / ``ctx.kwinputs[m]`` /
``ctx.targets[m]`` (microbatch inputs, keyword inputs of the first stage, targets),
``ctx.loss_kwargs``, ``ctx.losses`` / ``ctx.outputs`` (last stage, by microbatch).

Tuples across a boundary: a stage output that is a tuple travels as **one message per tensor**
(the tensor's index ``i`` offsets the message tag, :func:`_message_tag`), and its backward as one
message per tensor that carries a gradient (:mod:`.tensor_meta`'s rule; none for an integer
tensor or a detached float). Chosen over one flat buffer with a header because it keeps the
bare-tensor boundary byte-for-byte what it was (one message, the same tag, no copy), needs no
pack/unpack copy of each activation and gradient, and mixes dtypes (a float activation beside
int64 positions) without reinterpreting bytes; the cost is a few extra small messages for a
tuple, posted together and waited as one group with one deadline (:class:`_HandleGroup`). A
tuple's receive buffer and ``wait_recv`` value is a tuple (None in the slots of a backward that
carry no gradient), and so is what ``send`` takes from the stage.

Per-step state (received buffers, pending sends, local hand-offs) lives here, created fresh for
every step; nothing per call is kept on the schedule or the stages beyond each stage's
per-microbatch autograd state. ``ctx.run`` may be called from a second thread (a compound
step's other side); the bookkeeping dicts are guarded by a lock.

Failures name their place (:mod:`.errors`): a pipeline wait that runs out raises
:class:`PipelineTimeout`, one that fails early (the peer died) :class:`PipelinePeerFailed`, and
anything else raised inside ``ctx.run(action)`` leaves it as a :class:`PipelineActionError` whose
site is that action (the innermost one: a compound step's sub-action, with its side and thread),
with the original exception chained. The action running in each thread is kept in a
thread-local of the step's context, never on a module.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from overlap_runtime.ops import comm
from overlap_runtime.ops.comm import AsyncHandle, CommFailedError, CommTimeoutError
from overlap_runtime.ops.profile_range import profile_range
from overlap_runtime.ops.step_record import task_scope
from overlap_runtime.schedules.ir import Action, ActionKind

from .errors import (ActionSite, PipelineActionError, PipelineError, PipelinePeerFailed,
                     PipelineTimeout, side_of)
from .exec_trace import ExecutionTrace
from .stage import PipelineStage
from .tensor_meta import BoundaryMeta, TensorMeta, boundary_metas, describe_boundary

if TYPE_CHECKING:
    from .schedule import PipelineSchedule

# PipelineTimeout lives in .errors (with the other step errors); re-exported here as before.

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_RECV = (ActionKind.RECV_F, ActionKind.RECV_B)
_SEND = (ActionKind.SEND_F, ActionKind.SEND_B)


META_TAG = 2**30 - 1  # the one-time metadata headers


def _range_name(action: Action, prefix: str = "pp.") -> str:
    """The profiler range of ``action``, named after the action as torch prints it: ``pp.1F3``,
    ``pp.0SEND_F1``, ``pp.(1B3;0F4)OVERLAP_B_F`` (a compound step; its sub-actions get their
    own ranges); waits use the prefix ``pp.wait `` (``pp.wait 1RECV_B3``)."""
    return f"{prefix}{action}"


def _message_tag(kind: ActionKind, stage: int, microbatch: int, num_stages: int,
                num_microbatches: int, index: int = 0) -> int:
    """A tag unique per message of a step, the same on both ends: keyed by the direction and
    the *sending* stage (RECV_F at stage s receives from s-1, RECV_B from s+1), and by the
    tensor's ``index`` in a tuple boundary (0: a bare tensor or a tuple's first, the same tag
    a bare tensor always had). Raises ``ValueError`` when the tag would reach :data:`META_TAG`."""
    direction = 0 if kind in (ActionKind.SEND_F, ActionKind.RECV_F) else 1
    sender = stage - 1 if kind is ActionKind.RECV_F else stage + 1 if kind is ActionKind.RECV_B else stage
    tag = 1 + (direction * num_stages + sender) * num_microbatches + microbatch
    if index:
        tag += index * 2 * num_stages * num_microbatches
        if tag >= META_TAG - 1:
            raise ValueError(f"message tag {tag} of tensor {index} of {stage}{kind.value}"
                             f"{microbatch} reaches the metadata tags ({META_TAG - 1}); too many "
                             f"tensors in a tuple boundary for {num_stages} stages x "
                             f"{num_microbatches} microbatches")
    return tag


class _HandleGroup:
    """The handles of one tuple message (one per tensor), waited as one: one deadline of
    ``timeout_s`` for all of them (each wait gets what is left), so the bound is the one
    timeout, not one per tensor. Empty for a backward that carries no gradient."""

    def __init__(self, handles: list[AsyncHandle], timeout_s: float) -> None:
        self.handles = handles
        self.timeout_s = timeout_s

    @property
    def completed(self) -> bool:
        return all(h.completed for h in self.handles)

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)

    def wait(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for h in self.handles:
            h.wait(max(deadline - time.monotonic(), 1e-3))


@dataclass
class _Slot:
    buffer: "torch.Tensor | tuple[torch.Tensor | None, ...] | None"  # a tuple for a tuple boundary
    handle: "AsyncHandle | _HandleGroup"
    peer: int
    action: Action


@dataclass
class ActionContext:
    """Per-step state and the action API (see the module doc for the method list).

    Built by ``PipelineSchedule.step``; a callback never constructs one.
    """

    schedule: "PipelineSchedule"
    rank: int
    stages: dict[int, PipelineStage]
    inputs: list[tuple[torch.Tensor, ...]]
    targets: list[Any]
    losses: dict[int, torch.Tensor]
    trace: ExecutionTrace | None
    outputs: dict[int, Any] = field(default_factory=dict)  # last-stage outputs (tensor or tuple) by mb
    kwinputs: list[dict[str, Any]] = field(default_factory=list)  # first stage's kwargs by mb
    loss_kwargs: dict[str, Any] = field(default_factory=dict)  # extra loss_fn keywords
    step_index: int = -1
    current_action: Action | None = None
    # outputs and input gradients by (stage, mb): a tensor, or a tuple for a tuple boundary
    _acts: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)
    _grads: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)
    _slots: dict[tuple[ActionKind, int, int], _Slot] = field(default_factory=dict, repr=False)
    _sends: list[tuple["AsyncHandle | _HandleGroup", Action, int]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # the action ``run`` is executing in each thread (for the site of an error)
    _running: threading.local = field(default_factory=threading.local, repr=False)
    # (kind, stage, mb) of every F/B/I/W started this step: a custom function must run its own
    _ran: set[tuple[ActionKind, int, int]] = field(default_factory=set, repr=False)

    # ------------------------------------------------------------------ tracing
    def span(self, name: "str | Action", cat: str) -> Any:
        """``with ctx.span(name, cat):`` records the block as an interval of the step's
        execution trace (``name``: a string, or an action formatted only when tracing; ``cat``:
        ``compute``, ``compound`` or ``comm``). A no-op without a trace."""
        if self.trace is None:
            return _NULL_SPAN
        return self.trace.span(str(name), cat)

    # ------------------------------------------------------------------ compute
    def run(self, action: Action) -> None:
        """Run a compute action (F/B/I/W, or a compound step) through the function registered
        for its kind, else the standard way (:meth:`run_default`). Thread-safe.

        An exception other than a :class:`PipelineError` leaves as a
        :class:`PipelineActionError` naming ``action`` (its site: rank, program step, stage,
        microbatch, compound step and side, thread), the original chained as ``__cause__``.
        """
        prev = getattr(self._running, "action", None)
        self._running.action = action
        try:
            with profile_range(lambda: _range_name(action)), task_scope(action):
                fn = self.schedule.custom_functions.get(action.kind)
                if fn is not None:
                    fn(action, self)
                    self._check_ran(action, fn)
                else:
                    self.run_default(action)
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - wrapped with its site, cause chained
            raise self.action_error(exc, action) from exc
        finally:
            self._running.action = prev

    def run_default(self, action: Action) -> None:
        """The built-in behaviour, ignoring registered functions: a compound step runs its
        sub-actions in order (each through :meth:`run`), F/B/I/W run inside a ``compute``
        span."""
        if action.is_compound:
            with self.span(action, "compound"):
                for sub in action.sub_actions:
                    self.run(sub)
            return
        with self.span(action, "compute"):
            kind = action.kind
            if kind is _F:
                self.forward(action)
            elif kind is _B or kind is _I:
                self.backward(action)
            elif kind is _W:
                self.backward_weight(action)
            else:
                raise ValueError(f"rank {self.rank}: run_default({action}): not a compute "
                                 "action (F, B, I, W or a compound step)")

    def forward(self, action: Action) -> None:
        """F of ``action.stage`` on ``action.microbatch``: takes the user's microbatch (first
        stage), the previous stage's output (same rank) or the received activation (waited),
        runs the stage and keeps the output for the next stage or its SEND_F. On the last
        stage the output goes to ``ctx.outputs`` and the detached loss to ``ctx.losses``."""
        s, m = self._compute_key(action, (_F,))
        stage = self.stages[s]
        if stage.is_first:
            ins: tuple[torch.Tensor, ...] = self.inputs[m]
        else:
            if (s - 1) in self.stages:  # local hand-off
                x = self._take(self._acts, (s - 1, m), action, "the previous stage's output")
            else:
                x = self.wait_recv(ActionKind.RECV_F, s, m)
            ins = x if isinstance(x, tuple) else (x,)
        out = stage.forward(m, ins, self.schedule.loss_fn,
                            self.targets[m] if self.targets else None, self.schedule.loss_scale,
                            kwargs=self.kwinputs[m] if stage.is_first and self.kwinputs else None,
                            loss_kwargs=self.loss_kwargs)
        if stage.is_last:
            self.outputs[m] = out
            loss = stage.microbatches[m].loss
            if loss is not None:
                self.losses[m] = loss.detach()
        else:
            with self._lock:
                self._acts[(s, m)] = out

    def backward(self, action: Action, *, defer_w: bool = False) -> None:
        """B (full backward) or I (input gradient) of ``action``: takes the output gradient
        (none on the last stage; the next stage's on this rank; else the received one, waited),
        runs the stage's backward and keeps the input gradient for the previous stage or its
        SEND_B.

        ``defer_w=True`` (B only): the stage's deferred layers push their weight gradients to
        the stage's :class:`~overlap_runtime.pipeline.deferred_w.DeferredWQueue` instead of
        computing them; they run in a later flush, at the end of the step at the latest. An I
        already leaves them in the queue when the stage has one, so ``defer_w`` with an I
        raises, as does ``defer_w`` on a stage without a queue.
        """
        s, m = self._compute_key(action, (_B, _I))
        if defer_w and action.kind is _I:
            raise ValueError(f"rank {self.rank}: backward({action}, defer_w=True): defer_w is for "
                             "a full backward B; an I defers through its stage's queue already")
        stage = self.stages[s]
        if defer_w and stage.deferred_w is None:
            raise ValueError(f"rank {self.rank}: backward({action}, defer_w=True): stage {s} has "
                             "no DeferredWQueue (give its module DeferredLinear layers or pass "
                             "PipelineStage(deferred_w=queue))")
        if stage.is_last:
            grad = None
        elif (s + 1) in self.stages:
            grad = self._take(self._grads, (s + 1, m), action, "the next stage's input gradient")
        else:
            grad = self.wait_recv(ActionKind.RECV_B, s, m)
        if action.kind is _I:
            g = stage.backward_input(m, grad)
        else:
            g = stage.backward(m, grad, defer_w=defer_w)
        if not stage.is_first:
            with self._lock:
                self._grads[(s, m)] = g

    def backward_weight(self, action: Action) -> None:
        """W of ``action``: the weight gradients of a microbatch whose I ran (its queued tasks,
        or a second autograd walk without a queue)."""
        s, m = self._compute_key(action, (_W,))
        self.stages[s].backward_weight(m)

    # ------------------------------------------------------------------ point-to-point
    def peer(self, action: Action) -> int:
        """Pipeline-group rank at the other end of a SEND_F/SEND_B/RECV_F/RECV_B."""
        k, s = action.kind, action.stage
        if k not in _SEND and k not in _RECV:
            raise ValueError(f"rank {self.rank}: peer({action}): not a SEND/RECV action")
        other = s + 1 if k in (ActionKind.SEND_F, ActionKind.RECV_B) else s - 1
        return self.schedule.spec.stage_to_rank(other)

    def input_recv(self, action: Action) -> tuple[ActionKind, int, int] | None:
        """``(RECV_F|RECV_B, stage, microbatch)`` that compute ``action`` consumes, or None when
        its input is not received (first/last stage, a local hand-off, a W)."""
        s, m = action.stage, action.microbatch
        if action.kind is _F:
            if self.stages[s].is_first or (s - 1) in self.stages:
                return None
            return ActionKind.RECV_F, s, m  # type: ignore[return-value]
        if action.kind is _B or action.kind is _I:
            if self.stages[s].is_last or (s + 1) in self.stages:
                return None
            return ActionKind.RECV_B, s, m  # type: ignore[return-value]
        return None

    def post_recv(self, action: Action) -> None:
        """Allocate the buffer(s) of a RECV_F/RECV_B (shapes from the stage's metadata) and post
        the receive(s), not waited: one per tensor of a tuple boundary, and for RECV_B one per
        tensor that carries a gradient. Posting one twice raises."""
        if action.kind not in _RECV:
            raise ValueError(f"rank {self.rank}: post_recv({action}): not a RECV_F/RECV_B")
        s, m = action.stage, action.microbatch
        key = (action.kind, s, m)
        stage = self.stages[s]
        meta = stage.input_meta if action.kind is ActionKind.RECV_F else stage.output_meta
        if meta is None:
            raise RuntimeError(f"rank {self.rank}: no shape known for {action} "
                               f"(metadata exchange did not run)")
        peer = self.peer(action)
        with self._lock:
            if key in self._slots:
                raise RuntimeError(f"rank {self.rank}: {action} was posted twice in one step")
        grads = action.kind is ActionKind.RECV_B
        bufs: list[torch.Tensor | None] = []
        handles: list[AsyncHandle] = []
        try:
            with profile_range(lambda: _range_name(action)):
                for i, tm in enumerate(boundary_metas(meta)):
                    if grads and not tm.requires_grad:
                        bufs.append(None)  # no gradient crosses for this tensor
                        continue
                    buf = torch.empty(tm.shape, dtype=tm.dtype, device=stage.device)
                    bufs.append(buf)
                    handles.append(comm.irecv(buf, peer, self.schedule.group,
                                              tag=self._tag(action, i),
                                              timeout_s=self.schedule.timeout_s,
                                              what=str(action) if not i else f"{action}[{i}]"))
        except RuntimeError as exc:  # gloo refuses to post on a pair a dead peer closed
            raise self.comm_error(exc, action, peer) from exc
        if isinstance(meta, tuple):
            slot = _Slot(tuple(bufs), _HandleGroup(handles, self.schedule.timeout_s), peer, action)
        else:  # a bare tensor: its one receive, as always
            slot = _Slot(bufs[0], handles[0] if handles else
                         _HandleGroup(handles, self.schedule.timeout_s), peer, action)
        with self._lock:
            self._slots[key] = slot

    def recv_completed(self, kind: ActionKind, stage: int, microbatch: int) -> bool | None:
        """Poll the receive ``{stage}{kind}{microbatch}`` without waiting: True when its data
        is here, False while in flight, None when it was not posted (yet). Used to fill a
        communication window with other work (deferred W tasks)."""
        with self._lock:
            slot = self._slots.get((ActionKind(kind), stage, microbatch))
        if slot is None:
            return None
        return slot.handle.is_completed()

    def wait_recv(self, kind: ActionKind, stage: int, microbatch: int) -> Any:
        """The buffer of the posted receive ``{stage}{kind}{microbatch}``, waited (bounded by
        the schedule's timeout; the wait is recorded in the trace): a tensor, or for a tuple
        boundary a tuple of tensors (None where a backward carries no gradient)."""
        key = (ActionKind(kind), stage, microbatch)
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            raise RuntimeError(f"rank {self.rank}: {stage}{key[0].value}{microbatch} was never "
                               f"posted (the lowered schedule has no such receive before its use)")
        t0 = time.time_ns()
        self._wait(slot.handle, slot.action, slot.peer)
        if self.trace is not None:
            self.trace.record(f"wait {slot.action}", "comm", t0, time.time_ns())
        return slot.buffer

    def send(self, action: Action, *, wait: bool = False) -> "AsyncHandle | _HandleGroup":
        """Send the activation (SEND_F) or input gradient (SEND_B) named by ``action`` to its
        peer: one message, or one per tensor of a tuple boundary (per tensor that carries a
        gradient for SEND_B). ``wait=False``: the send stays pending until :meth:`wait_sends`
        (its buffer is kept alive); ``wait=True``: waited here (bounded). Returns the handle
        (a group of handles, waited as one, for a tuple)."""
        if action.kind not in _SEND:
            raise ValueError(f"rank {self.rank}: send({action}): not a SEND_F/SEND_B")
        s, m = action.stage, action.microbatch
        expect: BoundaryMeta | None
        if action.kind is ActionKind.SEND_F:
            value = self._take(self._acts, (s, m), action, f"the output of {s}F{m}")
            expect = self.stages[s].output_meta
        else:
            value = self._take(self._grads, (s, m), action, f"the input gradient of stage {s}")
            expect = self.stages[s].input_meta
        peer = self.peer(action)
        if isinstance(value, tuple) or isinstance(expect, tuple):
            return self._send_tuple(action, value, expect, peer, wait)
        if value is None and action.kind is ActionKind.SEND_B:
            if isinstance(expect, TensorMeta) and not expect.requires_grad:
                return _HandleGroup([], self.schedule.timeout_s)  # no gradient crosses
            raise RuntimeError(f"rank {self.rank}: {action}: stage {s} produced no input gradient")
        tensor = value
        if expect is not None and not expect.matches(tensor):
            raise ValueError(f"rank {self.rank}: {action} would send {TensorMeta.of(tensor)} but "
                             f"the receiver expects {expect}")
        # The handle keeps the sent payload alive until waited (``AsyncHandle.keep_alive``).
        try:
            with profile_range(lambda: _range_name(action)):
                handle = comm.isend(tensor, peer, self.schedule.group, tag=self._tag(action),
                                    timeout_s=self.schedule.timeout_s, what=str(action))
        except RuntimeError as exc:  # gloo refuses to post on a pair a dead peer closed
            raise self.comm_error(exc, action, peer) from exc
        if wait:
            self._wait(handle, action, peer)
        else:
            with self._lock:
                self._sends.append((handle, action, peer))
        return handle

    def _send_tuple(self, action: Action, value: Any, expect: BoundaryMeta | None, peer: int,
                    wait: bool) -> _HandleGroup:
        """:meth:`send` of a tuple boundary: one isend per tensor (per gradient for SEND_B)."""
        grads = action.kind is ActionKind.SEND_B
        what = "input gradient" if grads else "output"
        if not isinstance(value, tuple) or not isinstance(expect, tuple) \
                or len(value) != len(expect):
            got = f"{len(value)} tensors" if isinstance(value, tuple) else type(value).__name__
            want = describe_boundary(expect) if expect is not None else "(metadata unknown)"
            raise ValueError(f"rank {self.rank}: {action}: the {what} is {got} but the boundary "
                             f"carries {want}")
        sends: list[tuple[int, torch.Tensor]] = []
        for i, (t, tm) in enumerate(zip(value, expect)):
            if grads and not tm.requires_grad:
                if t is not None:
                    raise ValueError(f"rank {self.rank}: {action}: input {i} ({tm}) carries no "
                                     "gradient but the stage produced one")
                continue
            if t is None:
                raise RuntimeError(f"rank {self.rank}: {action}: stage {action.stage} produced "
                                   f"no {what} for tensor {i} ({tm})")
            if not tm.matches(t):
                raise ValueError(f"rank {self.rank}: {action} would send {TensorMeta.of(t)} as "
                                 f"tensor {i} but the receiver expects {tm}")
            sends.append((i, t))
        handles: list[AsyncHandle] = []
        try:
            with profile_range(lambda: _range_name(action)):
                for i, t in sends:
                    handles.append(comm.isend(t, peer, self.schedule.group,
                                              tag=self._tag(action, i),
                                              timeout_s=self.schedule.timeout_s,
                                              what=f"{action}[{i}]" if i else str(action)))
        except RuntimeError as exc:  # gloo refuses to post on a pair a dead peer closed
            raise self.comm_error(exc, action, peer) from exc
        group = _HandleGroup(handles, self.schedule.timeout_s)
        if wait:
            self._wait(group, action, peer)
        else:
            with self._lock:
                self._sends.append((group, action, peer))
        return group

    def wait_sends(self) -> None:
        """Wait every pending send of the step (bounded; each wait is traced)."""
        with self._lock:
            sends, self._sends = self._sends, []
        for handle, action, peer in sends:
            t0 = time.time_ns()
            self._wait(handle, action, peer)
            if self.trace is not None:
                self.trace.record(f"wait {action}", "comm", t0, time.time_ns())

    # ------------------------------------------------------------------ failures
    def site(self, action: Action | None = None) -> ActionSite:
        """Where this thread is in the step: ``action`` (default: the action :meth:`run` is
        executing in this thread, else the program's current action), the program position,
        the compound step and side, the thread."""
        program_action = self.current_action
        act = action if action is not None else getattr(self._running, "action", None)
        if act is None:
            act = program_action
        side = None
        if program_action is not None and program_action.is_compound and act is not None \
                and act != program_action:
            side = side_of(act.kind.value)
        name = str(act) if act is not None else "(no action)"
        return ActionSite(
            rank=self.schedule.global_rank, group_rank=self.rank, step_index=self.step_index,
            program_length=len(self.schedule.program), action=name,
            program_action=str(program_action) if program_action is not None else name,
            stage=act.stage if act is not None else None,
            microbatch=act.microbatch if act is not None else None,
            side=side, thread=threading.current_thread().name)

    def action_error(self, exc: BaseException, action: Action | None = None) -> PipelineActionError:
        """``exc`` as a :class:`PipelineActionError` at :meth:`site` (``raise ... from exc``)."""
        return PipelineActionError(self.site(action), exc)

    def comm_error(self, exc: BaseException, waited: Action, peer: int) -> PipelineError:
        """A failed post or wait of ``waited`` (a SEND/RECV with group rank ``peer``) as a
        :class:`PipelineTimeout` (``exc`` a CommTimeoutError) or :class:`PipelinePeerFailed`."""
        site = self.site()
        gpeer = comm.global_rank(self.schedule.group, peer)
        at = f"{site.who()}: {site.where()}, waiting for {waited} " \
             f"{'from' if waited.kind in _RECV else 'to'} rank {gpeer}"
        if isinstance(exc, CommTimeoutError):
            mark = (self.rank, min(self.step_index, len(self.schedule.program) - 1))
            return PipelineTimeout(f"pipeline timeout after {self.schedule.timeout_s:.1f}s on "
                                   f"{at} ({exc})\n{self.schedule.grid(mark)}",
                                   site, gpeer, str(waited))
        return PipelinePeerFailed(f"pipeline peer failed: {at}: {exc}", site, gpeer, str(waited))

    # ------------------------------------------------------------------ internals
    def _compute_key(self, action: Action, kinds: tuple[ActionKind, ...]) -> tuple[int, int]:
        if action.kind not in kinds:
            raise ValueError(f"rank {self.rank}: {action} is not a "
                             f"{'/'.join(k.value for k in kinds)} action")
        if action.stage not in self.stages:
            raise ValueError(f"rank {self.rank}: {action}: stage {action.stage} is not on this "
                             f"rank (stages here: {sorted(self.stages)})")
        with self._lock:
            self._ran.add((action.kind, action.stage, action.microbatch))  # type: ignore[arg-type]
        return action.stage, action.microbatch  # type: ignore[return-value]

    def _check_ran(self, action: Action, fn: Any) -> None:
        """Raise naming the registered ``fn`` when it returned without running every leaf of
        ``action`` (a compound step's sub-actions, or the F/B/I/W itself)."""
        with self._lock:
            skipped = [x for x in action.leaves()
                       if (x.kind, x.stage, x.microbatch) not in self._ran]
        if skipped:
            name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
            raise RuntimeError(
                f"rank {self.rank}: the function registered for {action.kind.value} ({name}) "
                f"returned from {action} without running {', '.join(map(str, skipped))}: a custom "
                "function must run each of its action's sub-actions once (ctx.run(sub), "
                "ctx.forward / ctx.backward / ctx.backward_weight, or ctx.run_default(action))")

    def _take(self, store: dict[tuple[int, int], Any], key: tuple[int, int], action: Action,
              what: str) -> Any:
        with self._lock:
            if key not in store:
                raise RuntimeError(f"rank {self.rank}: {action} needs {what}, which is not here "
                                   "(its producer has not run on this rank, or it was taken)")
            return store.pop(key)

    def _tag(self, action: Action, index: int = 0) -> int:
        spec = self.schedule.spec
        return _message_tag(action.kind, action.stage, action.microbatch,  # type: ignore[arg-type]
                           spec.num_stages, spec.num_microbatches, index)

    def _wait(self, handle: "AsyncHandle | _HandleGroup", action: Action, peer: int) -> None:
        try:
            with profile_range(lambda: _range_name(action, "pp.wait ")):
                handle.wait()
        except (CommTimeoutError, CommFailedError) as exc:
            raise self.comm_error(exc, action, peer) from exc


class _NullSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()

ActionFn = Callable[[Action, ActionContext], None]
"""``fn(action, ctx)``: a custom function for ``PipelineSchedule.register_custom_function``."""
