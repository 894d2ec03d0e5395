"""AllToAllTokenDispatcher: tokens to their experts' ranks and back, with a split combine.

Per-call state never lives on the dispatcher: ``dispatch`` returns a :class:`DispatchMetadata`
that ``combine`` / ``combine_start`` consume, and ``combine_start`` returns a
:class:`CombinePartialResult` that ``combine_wait`` consumes. So any number of microbatches may
be between their dispatch and their combine at once, on one thread or two (the forward of
microbatch i+1 beside the backward of microbatch i). The dispatcher itself holds configuration
only: number of experts, EP group, launch tag, optional sync hooks and span recorder.

Dispatch of ``N`` tokens, ``k`` experts each, ``E`` experts over ``P`` EP ranks (``E_l = E/P``)::

    slots      = top_indices.flatten()                  [N*k]   global expert of each slot
    slot_order = argsort(slots, stable)                  slots grouped by expert, so by rank
    permuted   = x[slot_order // k]                      [N*k, H]
    counts     = bincount(slots, E)                      [E]     what I send to each expert
    -- hook A --------------------------------------------------- comm region (EP group)
    recv       = all_to_all(counts)                      [P*E_l] what each rank sends my experts
    received   = all_to_all(permuted, in=counts by rank, out=recv by rank)   rank-major rows
    -- hook B ---------------------------------------------------
    local      = received[recv_order]                    expert-major rows, [M, H]

Combine is the reverse: ``received <- y[recv_inverse]`` (rank-major again), hook C, the reverse
all-to-all (asynchronous in ``combine_start``), then in ``combine_wait``: wait, hook D (or
D_LAST), ``slots = out[slot_inverse]`` and ``out_t = sum_k score[t, k] * slots[t, k]`` (weighted and
summed in fp32, or float64 when the scores or y are float64; result in y's dtype). The counts all-to-all is itself a bounded collective on the EP
group, inside the same comm region as the tokens' one, launched through the same serializer.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.coordinator import HookCoordinator, Side, sync_hook
from overlap_runtime.ops import comm
from overlap_runtime.ops.profile_range import profile_range
from overlap_runtime.pipeline.deferred_w import DeferredWQueue

from .router import RoutingResult

_UIDS = itertools.count(1)


class SpanSink(Protocol):
    """Where spans go: ``record(name, cat, start_ns, end_ns)`` (e.g. an ``ExecutionTrace``)."""

    def record(self, name: str, cat: str, start_ns: int, end_ns: int) -> None: ...


class CommHandle(Protocol):
    """An in-flight all-to-all: ``comm.AsyncHandle`` or the serializer's ``SerializedHandle``."""

    @property
    def completed(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> None: ...


@dataclass(frozen=True)
class OverlapHooks:
    """Sync-hook configuration of one MoE layer (set by ``OverlapExpertParallel``).

    ``layer``: index of the MoE layer in its chunk; ``is_last_layer``: the combine closes with
    ``D_LAST`` instead of ``D``.
    """

    coordinator: HookCoordinator
    layer: int
    is_last_layer: bool

    @property
    def combine_letter(self) -> str:
        return "D_LAST" if self.is_last_layer else "D"


@dataclass(frozen=True, eq=False)
class DispatchMetadata:
    """Everything ``combine`` needs from one ``dispatch`` call (never stored on a module).

    Attributes:
        input_shape: shape of the dispatched ``x``, ``[..., H]``; the combine returns it.
        top_k: experts per token.
        slot_order / slot_inverse: ``[N*k]`` int64 permutation (and inverse) of token slots
            into expert order.
        top_scores: ``[N, k]`` fp32 combine weights (float64 for a float64 router;
            differentiable).
        input_splits / output_splits: rows sent to / received from each EP rank.
        tokens_per_expert: rows per local expert after dispatch (length ``E_l``).
        recv_order / recv_inverse: ``[M]`` int64, rank-major to expert-major (None: identity).
        owner: id of the dispatcher that produced it (checked by combine).
    """

    input_shape: torch.Size
    top_k: int
    slot_order: torch.Tensor
    slot_inverse: torch.Tensor
    top_scores: torch.Tensor
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    tokens_per_expert: tuple[int, ...]
    recv_order: torch.Tensor | None
    recv_inverse: torch.Tensor | None
    owner: int

    @property
    def num_tokens(self) -> int:
        return int(self.top_scores.shape[0])

    @property
    def num_received(self) -> int:
        return sum(self.tokens_per_expert)


@dataclass(eq=False)
class CombinePartialResult:
    """State between ``combine_start`` and ``combine_wait`` of one call.

    ``received`` (``[N*k, H]``) is the all-to-all's output buffer: not readable before the
    handle is waited. Holds no reference to the dispatcher. ``consumed`` turns True in
    ``combine_wait``; a second ``combine_wait`` raises. ``bwd_span_box``: when the dispatcher
    traces, the list in which the combine's backward span start (``time.time_ns()``) travels
    from ``_BackwardSpanOpen`` (set in ``combine_wait``) to ``_BackwardSpanClose`` (set in
    ``combine_start``); None when nothing is traced or there is no EP group.
    """

    received: torch.Tensor
    metadata: DispatchMetadata
    handle: CommHandle
    started_ns: int
    consumed: bool = False
    bwd_span_box: list[int] | None = None


class _CompletedHandle:
    """The handle of a combine that needed no communication (no EP group)."""

    completed = True

    def wait(self, timeout_s: float | None = None) -> None:
        return None


# ----------------------------------------------------------------------------- autograd helpers


class _TimedHook(torch.autograd.Function):
    """``sync_hook`` that also records how long the coordinator kept it (forward and backward)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, letter: str, coordinator: HookCoordinator,
                layer: int, sink: SpanSink, name: str) -> torch.Tensor:
        ctx.args = (letter, coordinator, layer, sink, name)
        _timed_hook(Side.FORWARD, letter, coordinator, layer, sink, name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        letter, coordinator, layer, sink, name = ctx.args
        _timed_hook(Side.BACKWARD, letter, coordinator, layer, sink, name)
        return grad, None, None, None, None, None


def _timed_hook(side: Side, letter: str, coordinator: HookCoordinator, layer: int,
                sink: SpanSink, name: str) -> None:
    running = coordinator.running
    t0 = time.time_ns()
    coordinator.hook(side, letter, layer)
    if running:
        sink.record(f"{name}.{letter} {'fwd' if side is Side.FORWARD else 'bwd'}", "hook", t0,
                    time.time_ns())


class _BackwardSpanOpen(torch.autograd.Function):
    """Identity on an all-to-all's output; its backward notes when the reverse one starts."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, box: list[int]) -> torch.Tensor:
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.box.append(time.time_ns())
        return grad, None


class _BackwardSpanClose(torch.autograd.Function):
    """Identity on an all-to-all's input; its backward records the reverse all-to-all's span."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, box: list[int], sink: SpanSink,
                name: str) -> torch.Tensor:
        ctx.box, ctx.sink, ctx.name = box, sink, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.box:
            ctx.sink.record(ctx.name, "a2a", ctx.box.pop(), time.time_ns())
        return grad, None, None, None


class _WindowedAllToAll(torch.autograd.Function):
    """All-to-all whose forward and backward waits first run the queue's pending W tasks.

    ``box`` None: the forward launches, flushes and waits. ``box`` a list: the forward launches
    and appends the handle (the caller flushes and waits it, as ``combine_wait`` does). The
    backward (the reverse all-to-all) always launches, flushes, then waits.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, output_splits: list[int],
                input_splits: list[int], dispatcher: "AllToAllTokenDispatcher", where: str,
                box: list[Any] | None) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.dispatcher, ctx.where = dispatcher, where
        handle, out = comm.all_to_all_single(x, output_splits, input_splits, dispatcher.group,
                                             async_op=True, timeout_s=dispatcher.timeout_s,
                                             what=f"{dispatcher.tag}.{where}")
        ctx.handle = handle
        if box is None:
            dispatcher._flush_window(handle, f"{where} fwd")
            handle.wait()
        else:
            box.append(handle)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.handle.completed:
            raise RuntimeError(f"{ctx.dispatcher.tag}.{ctx.where}: backward reached an all-to-all "
                               f"whose forward handle was never waited")
        output_splits, input_splits = ctx.splits
        what = f"{ctx.dispatcher.tag}.{ctx.where}"
        with profile_range(lambda: f"a2a {what} bwd"):
            handle, grad_in = comm.all_to_all_single(grad.contiguous(), input_splits,
                                                     output_splits, ctx.dispatcher.group,
                                                     async_op=True,
                                                     timeout_s=ctx.dispatcher.timeout_s,
                                                     what=f"{what} (reverse)")
            ctx.dispatcher._flush_window(handle, f"{ctx.where} bwd")
            handle.wait()
        return grad_in, None, None, None, None, None


# ----------------------------------------------------------------------------- the dispatcher


def _profiled(label: str) -> Any:
    """Run the method inside the profiler range ``ep.{label} {tag}`` (free without a
    profiler: ``ops.profile_range``)."""
    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def ranged(self: "AllToAllTokenDispatcher", *args: Any, **kwargs: Any) -> Any:
            with profile_range(lambda: f"ep.{label} {self.tag}"):
                return method(self, *args, **kwargs)
        return ranged
    return wrap


class AllToAllTokenDispatcher:
    """Token dispatcher over an EP group (see the module doc).

    Args:
        num_experts: E, global number of routed experts (divisible by the EP group size).
        group: the EP process group; None means no expert parallelism (every expert is local,
            no communication, no torch.distributed needed).
        tag: prefix of the all-to-all tags the serializer logs (``"{tag}.dispatch"``...); must
            name the layer identically on every EP rank.
        hooks: sync hooks around the all-to-alls (``OverlapExpertParallel`` sets them); with
            hooks every all-to-all goes through ``hooks.coordinator.serializer``.
        trace: optional span sink: all-to-all spans (cat ``a2a``, forward and backward) and
            hook waits during coordinated runs (cat ``hook``).
        timeout_s: bound of every communication wait (default: the comm layer's).
        deferred_w_queue: run this queue's pending W tasks while the token all-to-alls are in
            flight (module doc); not with ``hooks``.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, *,
                 tag: str = "moe", hooks: OverlapHooks | None = None,
                 trace: SpanSink | None = None, timeout_s: float | None = None,
                 deferred_w_queue: DeferredWQueue | None = None) -> None:
        self.num_experts = int(num_experts)
        self.group = group
        self.ep_size = dist.get_world_size(group) if group is not None else 1
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        if self.num_experts % self.ep_size:
            raise ValueError(f"AllToAllTokenDispatcher: num_experts={num_experts} is not a "
                             f"multiple of the EP group size {self.ep_size}")
        if hooks is not None and group is None:
            raise ValueError("AllToAllTokenDispatcher: sync hooks need an EP group (group=None "
                             "means no communication to overlap)")
        self.num_local_experts = self.num_experts // self.ep_size
        self.tag = tag
        self.hooks = hooks
        self.trace = trace
        self.timeout_s = timeout_s
        self._uid = next(_UIDS)
        self.deferred_w_queue: DeferredWQueue | None = None
        if deferred_w_queue is not None:
            self.defer_weight_gradients(deferred_w_queue)

    def defer_weight_gradients(self, queue: DeferredWQueue | None) -> "AllToAllTokenDispatcher":
        """Configure (None: remove) the W queue flushed in the all-to-all windows; returns self.
        Raises with sync hooks (OVERLAP_B_F threads would run one queue's tasks concurrently)."""
        if queue is not None and not isinstance(queue, DeferredWQueue):
            raise TypeError(f"{self.tag}: defer_weight_gradients needs a DeferredWQueue, got "
                            f"{type(queue).__name__}")
        if queue is not None and self.hooks is not None:
            raise ValueError(f"{self.tag}: W-task windows with sync hooks (OVERLAP_B_F) are not "
                             f"supported: its two threads would run one queue's W tasks at once; "
                             f"use overlap_b_f=false with a deferred W queue")
        self.deferred_w_queue = queue
        return self

    def _flush_window(self, handle: Any, where: str) -> None:
        q = self.deferred_w_queue
        if q is None or self.group is None or not q.pending():
            return
        t0 = time.time_ns()
        n = q.flush(handle.is_completed, reason="window", during=f"{self.tag}.{where}")
        if n and self.trace is not None:
            self.trace.record(f"{self.tag}.W x{n} in {where}", "compute", t0, time.time_ns())

    def __repr__(self) -> str:
        hooks = (f", hooks=L{self.hooks.layer}/{self.hooks.combine_letter}"
                 if self.hooks else "")
        return (f"AllToAllTokenDispatcher(experts={self.num_experts}, ep={self.ep_size}, "
                f"tag={self.tag!r}{hooks})")

    # ------------------------------------------------------------------ helpers
    def _hook(self, x: torch.Tensor, letter: str) -> torch.Tensor:
        h = self.hooks
        if h is None:
            return x
        if h.coordinator.running and torch.is_grad_enabled() and not x.requires_grad:
            raise RuntimeError(
                f"{self.tag}: sync hook {letter} (layer {h.layer}) got a tensor that does not "
                f"require grad during a coordinated run; its backward hook would never run. "
                f"The MoE input must be on the autograd path (put a parameterised op before it)")
        if self.trace is not None:
            return _TimedHook.apply(x, letter, h.coordinator, h.layer, self.trace, self.tag)
        return sync_hook(x, letter, h.coordinator, h.layer)

    def _all_to_all(self, x: torch.Tensor, output_splits: list[int] | None,
                    input_splits: list[int] | None, tag: str,
                    async_op: bool = False) -> Any:
        if self.hooks is not None:
            return self.hooks.coordinator.serializer.all_to_all_single(
                x, output_splits, input_splits, self.group, tag=tag, async_op=async_op,
                timeout_s=self.timeout_s)
        return comm.all_to_all_single(x, output_splits, input_splits, self.group,
                                      async_op=async_op, timeout_s=self.timeout_s, what=tag)

    def _span(self, name: str, t0: int) -> None:
        if self.trace is not None:
            self.trace.record(name, "a2a", t0, time.time_ns())

    def _check_metadata(self, metadata: DispatchMetadata, what: str) -> None:
        if not isinstance(metadata, DispatchMetadata):
            raise TypeError(f"{self.tag}.{what}: expected DispatchMetadata, got "
                            f"{type(metadata).__name__}")
        if metadata.owner != self._uid:
            raise ValueError(f"{self.tag}.{what}: the metadata came from another dispatcher "
                             f"(owner {metadata.owner}, this one {self._uid})")

    # ------------------------------------------------------------------ dispatch
    @_profiled("dispatch")
    def dispatch(self, x: torch.Tensor, routing: RoutingResult
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """Send each token to the ranks of its ``k`` experts.

        Args:
            x: ``[..., H]`` tokens (any float dtype); must not be modified in place until the
                combine of this call has been waited.
            routing: the router's decision for the ``N = x.numel() / H`` tokens.

        Returns:
            ``(permuted [M, H] in x's dtype, expert-major; tokens_per_expert [E_l] int64 on the
            CPU; metadata)``.
        """
        hidden = x.shape[-1]
        x_flat = x.reshape(-1, hidden)
        n, k = routing.top_indices.shape
        if n != x_flat.shape[0]:
            raise ValueError(f"{self.tag}.dispatch: routing is for {n} tokens but x has "
                             f"{x_flat.shape[0]} ({tuple(x.shape)})")
        slots = routing.top_indices.reshape(-1)
        slot_order = torch.argsort(slots, stable=True)
        slot_inverse = torch.empty_like(slot_order)
        slot_inverse[slot_order] = torch.arange(slot_order.numel(), device=slot_order.device)
        permuted = x_flat.index_select(0, slot_order // k)
        counts = torch.bincount(slots, minlength=self.num_experts)
        if counts.numel() != self.num_experts:
            raise ValueError(f"{self.tag}.dispatch: expert index {int(slots.max())} out of range "
                             f"for {self.num_experts} experts")
        p, el = self.ep_size, self.num_local_experts

        def meta(ins: list[int], outs: list[int], per_expert: list[int],
                 recv_order: torch.Tensor | None, recv_inverse: torch.Tensor | None) -> DispatchMetadata:
            return DispatchMetadata(x.shape, k, slot_order, slot_inverse, routing.top_scores,
                                    tuple(ins), tuple(outs), tuple(per_expert), recv_order,
                                    recv_inverse, self._uid)

        if self.group is None:
            per_expert = counts.cpu()
            return permuted, per_expert, meta([n * k], [n * k], per_expert.tolist(), None, None)

        permuted = self._hook(permuted, "A")
        t0 = time.time_ns()  # the span starts after the hook's wait for the comm token
        # The split sizes travel first, as an all-to-all of counts (bounded like every wait).
        recv_counts = self._all_to_all(counts, None, None, f"{self.tag}.dispatch_counts")
        recv_counts = recv_counts.view(p, el).cpu()  # [source rank, local expert]
        input_splits = counts.view(p, el).sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        box: list[int] = []
        traced = self.trace is not None and permuted.requires_grad
        if traced:
            permuted = _BackwardSpanClose.apply(permuted, box, self.trace, f"{self.tag}.dispatch bwd")
        if self.deferred_w_queue is not None:
            received = _WindowedAllToAll.apply(permuted, output_splits, input_splits, self,
                                               "dispatch", None)
        else:
            received = self._all_to_all(permuted, output_splits, input_splits,
                                        f"{self.tag}.dispatch")
        if traced:
            received = _BackwardSpanOpen.apply(received, box)
        self._span(f"{self.tag}.dispatch fwd", t0)
        received = self._hook(received, "B")
        per_expert = recv_counts.sum(0)
        if p > 1 and el > 1:
            row_expert = torch.repeat_interleave(torch.arange(el).repeat(p), recv_counts.reshape(-1))
            recv_order = torch.argsort(row_expert, stable=True).to(x.device)
            recv_inverse = torch.empty_like(recv_order)
            recv_inverse[recv_order] = torch.arange(recv_order.numel(), device=x.device)
            received = received.index_select(0, recv_order)
        else:
            recv_order = recv_inverse = None
        return received, per_expert, meta(input_splits, output_splits, per_expert.tolist(),
                                          recv_order, recv_inverse)

    # ------------------------------------------------------------------ combine
    @_profiled("combine_start")
    def combine_start(self, expert_output: torch.Tensor, metadata: DispatchMetadata
                      ) -> tuple[CommHandle, CombinePartialResult]:
        """Launch the combine all-to-all of ``expert_output`` ``[M, H]`` (expert-major, as
        dispatch returned it) without waiting; finish with :meth:`combine_wait`."""
        self._check_metadata(metadata, "combine_start")
        if expert_output.dim() != 2 or expert_output.shape[0] != metadata.num_received:
            raise ValueError(f"{self.tag}.combine_start: expert output {tuple(expert_output.shape)} "
                             f"but dispatch delivered {metadata.num_received} rows")
        y = expert_output
        if metadata.recv_inverse is not None:
            y = y.index_select(0, metadata.recv_inverse)  # back to rank-major
        if self.group is None:
            handle: CommHandle = _CompletedHandle()
            return handle, CombinePartialResult(y, metadata, handle, time.time_ns())
        y = self._hook(y, "C")
        t0 = time.time_ns()
        box: list[int] | None = None
        if self.trace is not None and y.requires_grad:
            box = []
            y = _BackwardSpanClose.apply(y, box, self.trace, f"{self.tag}.combine bwd")
        if self.deferred_w_queue is not None:
            hbox: list[Any] = []
            out = _WindowedAllToAll.apply(y, list(metadata.input_splits),
                                          list(metadata.output_splits), self, "combine", hbox)
            handle = hbox[0]
        else:
            handle, out = self._all_to_all(y, list(metadata.input_splits),
                                           list(metadata.output_splits), f"{self.tag}.combine",
                                           async_op=True)
        return handle, CombinePartialResult(out, metadata, handle, t0, bwd_span_box=box)

    @_profiled("combine_wait")
    def combine_wait(self, handle: CommHandle, partial: CombinePartialResult) -> torch.Tensor:
        """Wait the combine (bounded), then unpermute and weight: returns ``[..., H]`` shaped
        like dispatch's ``x``, in the expert output's dtype."""
        if not isinstance(partial, CombinePartialResult):
            raise TypeError(f"{self.tag}.combine_wait: expected CombinePartialResult, got "
                            f"{type(partial).__name__}")
        if partial.consumed:
            raise RuntimeError(f"{self.tag}.combine_wait: this CombinePartialResult was already "
                               f"waited and combined")
        if handle is not partial.handle:
            raise ValueError(f"{self.tag}.combine_wait: the handle is not the one combine_start "
                             f"returned with this partial result")
        meta = partial.metadata
        self._check_metadata(meta, "combine_wait")
        self._flush_window(handle, "combine fwd")
        handle.wait()
        out = partial.received
        if self.group is not None:
            self._span(f"{self.tag}.combine fwd", partial.started_ns)
            box = partial.bwd_span_box
            if self.trace is not None and out.requires_grad and box is not None:
                out = _BackwardSpanOpen.apply(out, box)
            out = self._hook(out, self.hooks.combine_letter if self.hooks else "D")
        partial.consumed = True
        n, k, hidden = meta.num_tokens, meta.top_k, out.shape[-1]
        slots = out.index_select(0, meta.slot_inverse).view(n, k, hidden)
        # fp32 at least; float64 when the layer (scores or expert output) is float64
        acc = torch.promote_types(torch.promote_types(slots.dtype, torch.float32),
                                  meta.top_scores.dtype)
        combined = (slots.to(acc) * meta.top_scores.to(acc).unsqueeze(-1)).sum(dim=1)
        combined = combined.to(out.dtype)
        return combined.view(meta.input_shape)

    def combine(self, expert_output: torch.Tensor, metadata: DispatchMetadata) -> torch.Tensor:
        """Synchronous combine: ``combine_wait(*combine_start(...))``, nothing in between."""
        handle, partial = self.combine_start(expert_output, metadata)
        return self.combine_wait(handle, partial)
