"""Deferred weight gradients: a per-rank W queue and a linear layer whose backward computes only
dX; the weight gradient waits in the queue until the schedule runs it (a W action, or a wait
for a receive that it fills).

A backward pass naturally has two parts: ``D`` (here ``I``), the input gradient that the previous
stage waits for, and ``W``, the weight gradient that nobody needs before the optimizer step.
Autograd computes both in one node. :class:`DeferredLinear` splits them: while its
:class:`DeferredWQueue` *captures* (``with queue.capture((stage, microbatch)):`` around an ``I``),
its backward returns only dX and pushes a task that will compute dW (and the bias gradient)
from the saved input and the output gradient::

    I  (one backward walk)           dX ──► previous stage
         └─ DeferredLinear.backward ──push──► [ W(s,m) task | holds x, dY ] ──► queue
    W  (later, or in a comm window)   queue.run((s, m)) / queue.flush(until=recv_done)
                                      dW = dY^T x accumulated into weight.grad

Outside a capture the layer behaves like ``nn.Linear`` (dW computed at once), so the same model
runs under B, under plain autograd and in a single process.

Why a custom Function and not torch's own split (``torch.autograd.grad(..., inputs=x)`` then a
second walk for the weights, what :class:`~overlap_runtime.pipeline.stage.PipelineStage` does
for modules without deferred layers): the second walk recomputes every activation gradient on
the way to the weights and keeps the whole autograd graph alive (``retain_graph``) between I and
W. With the queue, I walks the graph once and frees it; a pending W holds exactly its GEMM's
input and output gradient. No private autograd API is used.

No global state: the queue is an object passed to each layer at construction (DeepSeek's
``WeightGradStore`` is a class-level singleton; two pipelines in one process would share it).
Per call, nothing is kept on the layer: the capture key lives on the queue for the duration of
one ``I``. The capture is not thread-local on purpose (on CUDA the autograd engine runs the
backward on its device thread); two captures at once raise.

Gradient hooks (DDP/FSDP reducers) fire for deferred parameters only when their W task runs:
the task accumulates into ``param.grad`` directly, so reduce after the step (or after the W).

Who runs the tasks: the program's W actions, :class:`~overlap_runtime.pipeline.flush.
FlushWhileWaiting` in communication windows, and ``PipelineSchedule.step``'s drain at the end.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, NamedTuple

import torch
from torch import nn


@dataclass
class DeferredWTask:
    """One deferred weight-gradient computation.

    ``key``: ``(stage, microbatch)`` of the ``I`` (or deferred ``B``) that produced it;
    ``seq``: push order on its queue; ``fn()`` computes and accumulates the gradients;
    ``tensors``: what the task keeps alive (for :meth:`DeferredWQueue.held_bytes`).
    """

    key: Hashable
    seq: int
    fn: Callable[[], None]
    tensors: tuple[torch.Tensor, ...]
    what: str = ""


class WRun(NamedTuple):
    """A record of one task execution, given to the queue's listeners.

    ``reason``: ``"action"`` (the program's W of that microbatch), ``"window"`` (flushed while a
    receive was in flight), ``"drain"`` (end of the step / cool-down); ``during``: the action
    being executed (text) when it ran, if known; ``step``: its index in the rank's program.
    """

    key: Hashable
    seq: int
    reason: str
    during: str | None
    step: int | None


@dataclass
class DeferredWQueue:
    """Per-rank FIFO of deferred weight-gradient tasks.

    ``push`` (from a deferred layer's backward, only inside :meth:`capture`), ``run(key)`` (one
    microbatch's tasks: the program's W action), ``flush(until=...)`` (oldest first until a
    deadline: an event set, a receive completed), ``drain()`` (everything). Thread-safe.
    ``listeners`` are called with a :class:`WRun` after each task (tracing, tests).
    """

    name: str = "w"
    listeners: list[Callable[[WRun], None]] = field(default_factory=list)
    _tasks: deque[DeferredWTask] = field(default_factory=deque, repr=False)
    _capture_key: Hashable | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _seq: Iterator[int] = field(default_factory=itertools.count, repr=False)

    # ------------------------------------------------------------------ capture / push
    @contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Defer the weight gradients of deferred layers to this queue, tagged ``key``, for the
        duration of the block (one ``I``). Nested or concurrent captures raise."""
        with self._lock:
            if self._capture_key is not None:
                raise RuntimeError(f"DeferredWQueue {self.name!r}: capture({key!r}) while "
                                   f"capture({self._capture_key!r}) is active; one I at a time "
                                   "may defer weight gradients to a queue")
            self._capture_key = key
        try:
            yield
        finally:
            with self._lock:
                self._capture_key = None

    @property
    def capturing(self) -> Hashable | None:
        """The key of the active capture, or None."""
        return self._capture_key

    def push(self, fn: Callable[[], None], tensors: tuple[torch.Tensor, ...] = (),
             what: str = "") -> DeferredWTask:
        """Queue ``fn`` under the active capture's key (raises outside a capture)."""
        with self._lock:
            key = self._capture_key
            if key is None:
                raise RuntimeError(f"DeferredWQueue {self.name!r}: push({what!r}) outside a "
                                   "capture; wrap the backward in `with queue.capture(key):`")
            task = DeferredWTask(key, next(self._seq), fn, tuple(tensors), what)
            self._tasks.append(task)
        return task

    # ------------------------------------------------------------------ execution
    def _pop(self, key: Hashable | None) -> DeferredWTask | None:
        with self._lock:
            if key is None:
                return self._tasks.popleft() if self._tasks else None
            for i, t in enumerate(self._tasks):
                if t.key == key:
                    del self._tasks[i]
                    return t
        return None

    def _execute(self, task: DeferredWTask, reason: str, during: str | None,
                 step: int | None) -> None:
        with torch.no_grad():
            task.fn()
        run = WRun(task.key, task.seq, reason, during, step)
        for listener in self.listeners:
            listener(run)

    def run(self, key: Hashable, *, reason: str = "action", during: str | None = None,
            step: int | None = None) -> int:
        """Run every pending task of ``key`` (push order); returns how many ran."""
        n = 0
        while (task := self._pop(key)) is not None:
            self._execute(task, reason, during, step)
            n += 1
        return n

    def flush(self, until: Callable[[], bool] | threading.Event | None = None, *,
              max_tasks: int | None = None, reason: str = "window", during: str | None = None,
              step: int | None = None) -> int:
        """Run the oldest tasks until ``until`` holds (checked before each task: a callable
        returning True, or an Event that is set), ``max_tasks`` ran, or the queue is empty."""
        if isinstance(until, threading.Event):
            deadline: Callable[[], bool] = until.is_set
        else:
            deadline = until if until is not None else (lambda: False)
        n = 0
        while (max_tasks is None or n < max_tasks) and not deadline():
            task = self._pop(None)
            if task is None:
                break
            self._execute(task, reason, during, step)
            n += 1
        return n

    def drain(self, *, reason: str = "drain", during: str | None = None,
              step: int | None = None) -> int:
        """Run everything pending (oldest first)."""
        return self.flush(None, reason=reason, during=during, step=step)

    def discard(self, predicate: Callable[[Hashable], bool] | None = None) -> int:
        """Drop pending tasks (all, or those whose key matches) without running them: after a
        failed step. Returns how many were dropped."""
        with self._lock:
            keep = deque(t for t in self._tasks if predicate is not None and not predicate(t.key))
            n = len(self._tasks) - len(keep)
            self._tasks = keep
        return n

    # ------------------------------------------------------------------ inspection
    def pending(self, key: Hashable | None = None) -> int:
        with self._lock:
            if key is None:
                return len(self._tasks)
            return sum(1 for t in self._tasks if t.key == key)

    def pending_keys(self) -> list[Hashable]:
        """Keys of the pending tasks in push order (with repeats)."""
        with self._lock:
            return [t.key for t in self._tasks]

    def held_storages(self) -> dict[tuple[str, int], int]:
        """``{(device, data_ptr): nbytes}`` of the storages pending tasks keep alive."""
        with self._lock:
            tensors = [x for t in self._tasks for x in t.tensors]
        out: dict[tuple[str, int], int] = {}
        for x in tensors:
            s = x.untyped_storage()
            out[(str(x.device), s.data_ptr())] = s.nbytes()
        return out

    def held_bytes(self) -> int:
        """Bytes of activations (inputs, output gradients) held by pending tasks, each storage
        counted once."""
        return sum(self.held_storages().values())


# ---------------------------------------------------------------------- the linear layer


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (set when None), in the parameter's dtype: how a W task lands."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _linear_weight_task(x: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None) -> Callable[[], None]:
    def task() -> None:
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if weight is not None:
            accumulate_grad(weight, g2.t().matmul(x.reshape(-1, x.shape[-1])))
        if bias is not None:
            accumulate_grad(bias, g2.sum(0))

    return task


class _DeferredLinearFn(torch.autograd.Function):
    """``y = x W^T + b``; backward returns dX, and dW/db now or as a task on the queue."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                queue: DeferredWQueue) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.queue = queue
        ctx.bias = bias  # a leaf parameter (or None): holding it creates no cycle
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.bias is not None
        grad_x = grad_out.matmul(weight) if need_x else None
        queue: DeferredWQueue = ctx.queue
        if (need_w or need_b) and queue.capturing is not None:
            queue.push(_linear_weight_task(x, grad_out, weight if need_w else None,
                                           ctx.bias if need_b else None),
                       (x, grad_out), what=f"linear {tuple(weight.shape)}")
            return grad_x, None, None, None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = g2.t().matmul(x.reshape(-1, x.shape[-1])) if need_w else None
        grad_b = g2.sum(0) if need_b else None
        return grad_x, grad_w, grad_b, None


class DeferredLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient is deferred to ``queue`` while it captures.

    Shapes as ``nn.Linear``: input ``[..., in_features]``, output ``[..., out_features]``, any
    float dtype (the gradients take the parameters' dtype). The queue is the only extra state
    (a reference given at construction).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 queue: DeferredWQueue, device: Any = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if not isinstance(queue, DeferredWQueue):
            raise TypeError(f"DeferredLinear needs a DeferredWQueue, got {type(queue).__name__}")
        self.deferred_w_queue = queue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferredLinearFn.apply(x, self.weight, self.bias, self.deferred_w_queue)


def find_deferred_w_queue(module: nn.Module) -> DeferredWQueue | None:
    """The one queue the deferred layers of ``module`` share, or None if it has none.

    Raises if they reference different queues (a stage's I captures one queue).
    """
    queues = {id(m.deferred_w_queue): m.deferred_w_queue for m in module.modules()
              if isinstance(getattr(m, "deferred_w_queue", None), DeferredWQueue)}
    if len(queues) > 1:
        raise ValueError(f"the deferred layers of {type(module).__name__} use {len(queues)} "
                         "different DeferredWQueue objects; a stage needs exactly one")
    return next(iter(queues.values()), None)
