"""ActionContext: everything one ``step`` needs, handed to default and custom action functions.

A custom function registered with ``PipelineSchedule.register_custom_function(kind, fn)`` is
called as ``fn(action, ctx)``. Through ``ctx`` it can:

- run any F/B/I/W the standard way: ``ctx.run(sub_action)`` (also from another thread);
- reach the stages on this rank (``ctx.stages[stage_index]``), the microbatch inputs and targets
  (``ctx.inputs[m]``, ``ctx.targets[m]``), the losses by microbatch (``ctx.losses``);
- wait for a received activation or gradient: ``ctx.wait_recv(kind, stage, microbatch)``
  (``kind`` is ``RECV_F`` or ``RECV_B``), bounded by the schedule's timeout;
- record trace spans: ``with ctx.span(name, cat):``.

Per-step state (received buffers, pending sends, local hand-offs) lives here, created fresh for
every step; nothing per call is kept on the schedule or the stages beyond each stage's
per-microbatch autograd state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from overlap_runtime.ops.comm import AsyncHandle, CommTimeoutError

from .exec_trace import ExecutionTrace
from .ir import Action, ActionKind
from .stage import PipelineStage, TensorMeta

if TYPE_CHECKING:
    from .runtime import PipelineSchedule

__all__ = ["ActionContext", "PipelineTimeout", "message_tag", "META_TAG"]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


class PipelineTimeout(TimeoutError):
    """A pipeline wait passed its timeout; names rank, step, action and peer, with the grid."""

    def __init__(self, message: str, rank: int, step_index: int, action: str, peer: int | None):
        super().__init__(message)
        self.rank, self.step_index, self.action, self.peer = rank, step_index, action, peer


META_TAG = 2**30 - 1  # the one-time metadata headers


def message_tag(kind: ActionKind, stage: int, microbatch: int, num_stages: int,
                num_microbatches: int) -> int:
    """A tag unique per message of a step, the same on both ends: keyed by the direction and
    the *sending* stage (RECV_F at stage s receives from s-1, RECV_B from s+1)."""
    direction = 0 if kind in (ActionKind.SEND_F, ActionKind.RECV_F) else 1
    sender = stage - 1 if kind is ActionKind.RECV_F else stage + 1 if kind is ActionKind.RECV_B else stage
    return 1 + (direction * num_stages + sender) * num_microbatches + microbatch


@dataclass
class _Slot:
    buffer: torch.Tensor
    handle: AsyncHandle | None
    peer: int
    action: Action


@dataclass
class ActionContext:
    """Per-step state and services for action functions (see module doc)."""

    schedule: "PipelineSchedule"
    rank: int
    stages: dict[int, PipelineStage]
    inputs: list[tuple[torch.Tensor, ...]]
    targets: list[Any]
    losses: dict[int, torch.Tensor]
    trace: ExecutionTrace | None
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # last-stage outputs by mb
    step_index: int = -1
    current_action: Action | None = None
    _acts: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _grads: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    _slots: dict[tuple[ActionKind, int, int], _Slot] = field(default_factory=dict)
    _sends: list[tuple[AsyncHandle, Action, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ services
    def span(self, name: "str | Action", cat: str) -> Any:
        """Record ``name`` (a string, or an action formatted only when tracing) as an interval."""
        if self.trace is None:
            return _NULL_SPAN
        return self.trace.span(str(name), cat)

    def run(self, action: Action) -> None:
        """Run ``action`` (F/B/I/W, or a compound step's sub-actions in order) the standard way,
        or through the function registered for its kind."""
        fn = self.schedule.custom_functions.get(action.kind)
        if fn is not None:
            fn(action, self)
        else:
            self.run_default(action)

    def run_default(self, action: Action) -> None:
        """The built-in behaviour, ignoring registered functions."""
        if action.is_compound:
            with self.span(action, "compound"):
                for sub in action.sub_actions:
                    self.run(sub)
            return
        with self.span(action, "compute"):
            if action.kind is _F:
                self._forward(action.stage, action.microbatch)
            elif action.kind is _B:
                self._backward(action.stage, action.microbatch, split=False)
            elif action.kind is _I:
                self._backward(action.stage, action.microbatch, split=True)
            elif action.kind is _W:
                self.stages[action.stage].backward_weight(action.microbatch)
            else:
                raise ValueError(f"run_default: {action} is not a compute action")

    def recv_completed(self, kind: ActionKind, stage: int, microbatch: int) -> bool | None:
        """Poll the receive ``{stage}{kind}{microbatch}`` without waiting: True when its data
        is here, False while in flight, None when it was not posted (yet). Used to fill a
        communication window with other work (deferred W tasks)."""
        with self._lock:
            slot = self._slots.get((ActionKind(kind), stage, microbatch))
        if slot is None:
            return None
        return slot.handle is None or slot.handle.is_completed()

    def wait_recv(self, kind: ActionKind, stage: int, microbatch: int) -> torch.Tensor:
        """The buffer of the receive ``{stage}{kind}{microbatch}``, waited (bounded)."""
        key = (ActionKind(kind), stage, microbatch)
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            raise RuntimeError(f"rank {self.rank}: {stage}{kind.value}{microbatch} was never posted "
                               f"(the lowered schedule has no such receive before its use)")
        if slot.handle is not None:
            t0 = time.time_ns()
            self._wait(slot.handle, slot.action, slot.peer)
            if self.trace is not None:
                self.trace.record(f"wait {slot.action}", "comm", t0, time.time_ns())
        return slot.buffer

    # ------------------------------------------------------------------ compute
    def _forward(self, s: int, m: int) -> None:
        stage = self.stages[s]
        if stage.is_first:
            ins: tuple[torch.Tensor, ...] = self.inputs[m]
        elif (s - 1) in self.stages:  # local hand-off
            ins = (self._acts.pop((s - 1, m)),)
        else:
            ins = (self.wait_recv(ActionKind.RECV_F, s, m),)
        out = stage.forward(m, ins, self.schedule.loss_fn, self.targets[m] if self.targets else None,
                            self.schedule.loss_scale)
        if stage.is_last:
            self.outputs[m] = out
            loss = stage.microbatches[m].loss
            if loss is not None:
                self.losses[m] = loss.detach()
        else:
            self._acts[(s, m)] = out

    def _backward(self, s: int, m: int, split: bool, defer_w: bool = False) -> None:
        stage = self.stages[s]
        if stage.is_last:
            grad = None
        elif (s + 1) in self.stages:
            grad = self._grads.pop((s + 1, m))
        else:
            grad = self.wait_recv(ActionKind.RECV_B, s, m)
        if split:
            g = stage.backward_input(m, grad)
        else:
            g = stage.backward(m, grad, defer_w=True) if defer_w else stage.backward(m, grad)
        if not stage.is_first:
            self._grads[(s, m)] = g

    # ------------------------------------------------------------------ comm
    def _peer(self, action: Action) -> int:
        k, s = action.kind, action.stage
        other = s + 1 if k in (ActionKind.SEND_F, ActionKind.RECV_B) else s - 1
        return self.schedule.spec.stage_to_rank(other)

    def _global(self, group_rank: int) -> int:
        group = self.schedule.group
        if group is None or group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(group, group_rank)

    def post_recv(self, action: Action) -> None:
        """Allocate the buffer of a RECV_F/RECV_B and post the receive (not waited)."""
        s, m = action.stage, action.microbatch
        stage = self.stages[s]
        meta = stage.input_meta if action.kind is ActionKind.RECV_F else stage.output_meta
        if meta is None:
            raise RuntimeError(f"rank {self.rank}: no shape known for {action} "
                               f"(metadata exchange did not run)")
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=stage.device)
        peer = self._peer(action)
        tag = message_tag(action.kind, s, m, self.schedule.spec.num_stages,
                          self.schedule.spec.num_microbatches)
        work = dist.irecv(buf, self._global(peer), group=self.schedule.group, tag=tag)
        handle = AsyncHandle([work], f"{action} from rank {peer}", self.schedule.timeout_s,
                             device=buf.device)
        with self._lock:
            self._slots[(action.kind, s, m)] = _Slot(buf, handle, peer, action)

    def post_send(self, action: Action) -> AsyncHandle:
        """Send the activation (SEND_F) or input gradient (SEND_B) named by ``action``."""
        s, m = action.stage, action.microbatch
        if action.kind is ActionKind.SEND_F:
            tensor = self._acts.pop((s, m))
            expect = self.stages[s].output_meta
        else:
            tensor = self._grads.pop((s, m))
            expect = self.stages[s].input_meta
            if tensor is None:
                raise RuntimeError(f"rank {self.rank}: {action}: stage {s} produced no input gradient")
        if expect is not None and TensorMeta.of(tensor) != expect:
            raise ValueError(f"rank {self.rank}: {action} would send {TensorMeta.of(tensor)} but "
                             f"the receiver expects {expect}")
        peer = self._peer(action)
        tag = message_tag(action.kind, s, m, self.schedule.spec.num_stages,
                          self.schedule.spec.num_microbatches)
        payload = tensor.detach().contiguous()
        work = dist.isend(payload, self._global(peer), group=self.schedule.group, tag=tag)
        handle = AsyncHandle([work], f"{action} to rank {peer}", self.schedule.timeout_s,
                             device=payload.device)
        handle.payload = payload  # type: ignore[attr-defined]  # alive until waited
        self._sends.append((handle, action, peer))
        return handle

    def _wait(self, handle: AsyncHandle, action: Action, peer: int | None) -> None:
        try:
            handle.wait()
        except CommTimeoutError as exc:
            raise self.schedule.timeout_error(self.rank, self.step_index, action, peer, exc) from exc

    def wait_sends(self) -> None:
        """Wait every send of the step (bounded); called at the end of the step."""
        for handle, action, peer in self._sends:
            t0 = time.time_ns()
            self._wait(handle, action, peer)
            if self.trace is not None:
                self.trace.record(f"wait {action}", "comm", t0, time.time_ns())
        self._sends.clear()


class _NullSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()

ActionFn = Callable[[Action, ActionContext], None]
