"""PipelineStage: one model chunk's forward, backward and split backward on torch autograd.

A stage holds a module and, per microbatch, the tensors autograd needs between the forward and
the backward. That per-microbatch state lives in :class:`MicrobatchState` objects kept in a dict
keyed by microbatch, created by ``forward`` and released by the last backward action, so any
number of microbatches may be in flight.

Boundary convention: a stage's input that came from another stage is a detached leaf with
``requires_grad=True``, so each stage's backward stops at its own input and produces the gradient
to send upstream. The first stage's inputs are the user's microbatch tensors (no gradient).
Outputs: a tensor, or a tuple of tensors the next stage takes as positional inputs (torch's
rule; any other value raises ``TypeError`` naming the stage and the element). Each received
tensor whose :class:`~.tensor_meta.TensorMeta` has ``requires_grad`` becomes such a leaf; the
others (integer tensors, floats the sender detached) enter as plain tensors. The backward of a
tuple boundary returns one gradient per input: a tensor for each leaf requiring grad (zeros when
the stage did not use it), None for the others; a bare-tensor boundary returns its one gradient,
exactly as before tuples existed.

Split backward (``I`` then ``W``) uses only public autograd: ``I`` is
``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True)``; ``W`` is
``torch.autograd.backward(outputs, grad_outputs, inputs=params)``, which walks the graph a
second time (it recomputes activation gradients on the way to the weights: correct, and more
arithmetic than a fused ``B``).

Deferred W (:mod:`overlap_runtime.pipeline.deferred_w`): a stage whose module holds
``DeferredLinear`` layers (or that is given ``deferred_w=queue``) runs ``I`` as *one* backward
walk inside ``queue.capture((stage, microbatch))``: the deferred layers push their weight
gradients to the queue, every other parameter gets its gradient at once, and the autograd graph
is freed. ``W`` then runs that microbatch's tasks (``queue.run``); tasks already flushed in a
communication window leave it nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .deferred_w import DeferredWQueue, find_deferred_w_queue
from .tensor_meta import (BoundaryMeta, TensorMeta, as_boundary_value, boundary_metas,
                          describe_boundary)


@dataclass
class MicrobatchState:
    """What one microbatch keeps on one stage between its forward and its backward.

    ``inputs``: the stage's inputs (a received activation is a leaf requiring grad);
    ``output``: the stage's output (a tensor or a tuple of tensors); ``loss``: the last stage's unscaled loss (a 0-dim tensor);
    ``loss_scale``: what the backward multiplies the loss by (``1 / num_microbatches`` when the
    schedule scales gradients); ``grad_output``: the output gradient kept between I and W;
    ``input_grad_done``: I ran; ``tuple_input``: the inputs came over a tuple boundary (the
    input gradient is then a tuple, one entry per input).
    """

    inputs: tuple[torch.Tensor, ...]
    output: "torch.Tensor | tuple[torch.Tensor, ...]"
    loss: torch.Tensor | None = None
    loss_scale: float = 1.0
    grad_output: "torch.Tensor | tuple[torch.Tensor | None, ...] | None" = None
    input_grad_done: bool = False
    tuple_input: bool = False


class PipelineStage:
    """One pipeline stage (model chunk) placed on this rank.

    Args:
        module: the chunk; ``module(*inputs) -> Tensor | tuple[Tensor, ...]``.
        stage_index: global stage index ``0 .. num_stages-1``.
        num_stages: number of stages of the whole model.
        device: where the module and its activations live.
        group: the pipeline process group (None: the default group).
        input_meta: what this stage receives per microbatch (stages > 0): a ``TensorMeta``
            (one tensor) or a tuple of them (positional inputs). None: learnt by the schedule's
            one-time metadata exchange (as is ``output_meta``).
        deferred_w: the rank's W queue for split backwards; None: the queue the module's
            ``DeferredLinear`` layers share, if any (else I/W use public autograd only).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        input_meta: BoundaryMeta | None = None,
        deferred_w: DeferredWQueue | None = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1} "
                             f"(num_stages={num_stages})")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.input_meta = input_meta
        self.output_meta: BoundaryMeta | None = None
        self.microbatches: dict[int, MicrobatchState] = {}
        self.deferred_w = deferred_w if deferred_w is not None else find_deferred_w_queue(module)

    # ------------------------------------------------------------------ properties
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        microbatch: int,
        inputs: Sequence[torch.Tensor],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        target: Any = None,
        loss_scale: float = 1.0,
        *,
        kwargs: dict[str, Any] | None = None,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> "torch.Tensor | tuple[torch.Tensor, ...]":
        """Run the chunk on one microbatch and keep what the backward needs.

        ``inputs``: the user's microbatch tensors on the first stage, else the received
        tensors (one, or one per tensor of a tuple boundary; those whose meta has
        ``requires_grad`` are made leaves requiring grad here). On the last stage
        ``loss_fn(output, target, **loss_kwargs)`` is computed and kept (scaled by
        ``loss_scale`` for the backward; ``output`` as the module returned it, a tuple
        included). ``kwargs``: keyword inputs of the module (the first stage's, split per
        microbatch by ``PipelineSchedule.step(**kwargs)``).
        Returns the output detached (a tensor, or a tuple of tensors) for sending downstream.
        """
        if microbatch in self.microbatches:
            raise RuntimeError(f"stage {self.stage_index}: forward of microbatch {microbatch} "
                               f"ran twice before its backward")
        tuple_input = False
        if self.is_first:
            ins = tuple(inputs)
        elif isinstance(self.input_meta, tuple) or len(inputs) != 1:
            ins, tuple_input = self._tuple_leaves(microbatch, tuple(inputs)), True
        else:
            x = inputs[0]
            meta = self.input_meta
            if meta is not None and not meta.matches(x):
                raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: received "
                                 f"{TensorMeta.of(x)} but expected {meta}")
            ins = (x.detach().requires_grad_(meta is None or bool(meta.requires_grad)),)
        out = as_boundary_value(self.module(*ins, **(kwargs or {})),
                                f"stage {self.stage_index} microbatch {microbatch}")
        if self.output_meta is not None and not self.is_last:
            self._check_output(microbatch, out)
        state = MicrobatchState(inputs=ins, output=out, tuple_input=tuple_input)
        if self.is_last and loss_fn is not None:
            loss = loss_fn(out, target, **(loss_kwargs or {}))
            state.loss = loss
            state.loss_scale = loss_scale
        self.microbatches[microbatch] = state
        if isinstance(out, tuple):
            return tuple(t.detach() for t in out)
        return out.detach()

    def _tuple_leaves(self, microbatch: int, inputs: tuple[torch.Tensor, ...]
                      ) -> tuple[torch.Tensor, ...]:
        """The received tensors of a tuple boundary as stage inputs: a leaf requiring grad for
        each meta with ``requires_grad`` (the dtype rule without a meta), a detached tensor
        otherwise."""
        where = f"stage {self.stage_index} microbatch {microbatch}"
        metas = boundary_metas(self.input_meta) if self.input_meta is not None else None
        if metas is not None and len(metas) != len(inputs):
            raise ValueError(f"{where}: received {len(inputs)} tensors but expected "
                             f"{describe_boundary(self.input_meta)}")  # type: ignore[arg-type]
        ins = []
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{where}: input {i} is {type(x).__name__}, not a tensor")
            meta = metas[i] if metas is not None else TensorMeta.of(x)
            if not meta.matches(x):
                raise ValueError(f"{where}: input {i} is {TensorMeta.of(x)} but expected {meta}")
            ins.append(x.detach().requires_grad_(bool(meta.requires_grad)))
        return tuple(ins)

    def _check_output(self, microbatch: int, out: "torch.Tensor | tuple[torch.Tensor, ...]") -> None:
        """``out`` against ``output_meta``: same structure, shapes and dtypes; an output that
        requires grad where the meta says it carries none raises (its gradient would be lost)."""
        meta = self.output_meta
        assert meta is not None
        outs = out if isinstance(out, tuple) else (out,)
        metas = boundary_metas(meta)
        if isinstance(out, tuple) != isinstance(meta, tuple) or len(outs) != len(metas) \
                or not all(m.matches(t) for m, t in zip(metas, outs)):
            got = describe_boundary(tuple(TensorMeta.of(t) for t in outs) if isinstance(out, tuple)
                                    else TensorMeta.of(out))
            raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: output is {got} "
                             f"but stage {self.stage_index + 1} expects {describe_boundary(meta)}")
        for i, (m, t) in enumerate(zip(metas, outs)):
            if t.requires_grad and not m.requires_grad:
                raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: output {i} "
                                 f"requires grad but its boundary meta {m} carries no gradient, "
                                 "so its gradient would be dropped (set requires_grad=True in "
                                 "output_meta, or detach the output)")

    # ------------------------------------------------------------------ backward
    def _state(self, microbatch: int, what: str) -> MicrobatchState:
        try:
            return self.microbatches[microbatch]
        except KeyError:
            raise RuntimeError(f"stage {self.stage_index}: {what} of microbatch {microbatch} "
                               f"before its forward") from None

    def _roots(self, st: MicrobatchState, grad_output: Any, microbatch: int) -> tuple[Any, Any]:
        """``(outputs, grad_outputs)`` the backward starts from: the scaled loss on the last
        stage; the output and its gradient for a bare tensor; for a tuple, lists of the outputs
        that require grad and have a gradient (empty lists: nothing to differentiate)."""
        if self.is_last:
            if st.loss is None:
                raise RuntimeError(f"stage {self.stage_index}: last stage has no loss for "
                                   f"microbatch {microbatch} (pass loss_fn to the schedule)")
            return st.loss * st.loss_scale, None
        if isinstance(st.output, tuple):
            return self._tuple_roots(st.output, grad_output, microbatch)
        if grad_output is None:
            if isinstance(self.output_meta, TensorMeta) and not self.output_meta.requires_grad:
                return [], []  # a boundary without gradient (an integer tensor)
            raise RuntimeError(f"stage {self.stage_index}: backward of microbatch {microbatch} "
                               f"needs the output gradient from stage {self.stage_index + 1}")
        if grad_output.shape != st.output.shape or grad_output.dtype != st.output.dtype:
            raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: gradient is "
                             f"{TensorMeta.of(grad_output)} but the output was {TensorMeta.of(st.output)}")
        return st.output, grad_output

    def _tuple_roots(self, outs: tuple[torch.Tensor, ...], grads: Any, microbatch: int
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        where = f"stage {self.stage_index} microbatch {microbatch}"
        if not isinstance(grads, tuple) or len(grads) != len(outs):
            got = f"{len(grads)} gradients" if isinstance(grads, tuple) else type(grads).__name__
            raise ValueError(f"{where}: the output is a tuple of {len(outs)} tensors but its "
                             f"gradient is {got} (one entry per output, None where none)")
        roots, root_grads = [], []
        for i, (o, g) in enumerate(zip(outs, grads)):
            if g is None:
                continue
            if g.shape != o.shape or g.dtype != o.dtype:
                raise ValueError(f"{where}: gradient {i} is {TensorMeta.of(g)} but output {i} "
                                 f"was {TensorMeta.of(o)}")
            if o.requires_grad:  # torch's rule: an output that needs no grad takes none
                roots.append(o)
                root_grads.append(g)
        return roots, root_grads

    def _grad_inputs(self, st: MicrobatchState) -> list[torch.Tensor]:
        return [t for t in st.inputs if t.requires_grad]

    def _input_grads(self, st: MicrobatchState) -> Any:
        """After a backward walk: a bare input's gradient (None on the first stage), or for a
        tuple boundary one entry per input, zeros where a leaf got none, None for inputs that
        carry no gradient."""
        if st.tuple_input:
            return tuple((t.grad if t.grad is not None else torch.zeros_like(t))
                         if t.requires_grad else None for t in st.inputs)
        ins = self._grad_inputs(st)
        return ins[0].grad if ins else None

    def backward(self, microbatch: int, grad_output: Any,
                 defer_w: bool = False) -> Any:
        """Full backward (B): parameter gradients accumulate; returns the input gradient
        (None on the first stage; a tuple over a tuple boundary, see the module doc).
        ``grad_output``: the output's gradient (a tuple with None entries for a tuple output).
        Frees the microbatch's state. ``defer_w``: the deferred layers' weight gradients go to
        the W queue instead (run later by a flush or the drain at the end of the step)."""
        st = self._state(microbatch, "backward")
        root, grad = self._roots(st, grad_output, microbatch)
        if defer_w:
            if self.deferred_w is None:
                raise RuntimeError(f"stage {self.stage_index}: backward(defer_w=True) of "
                                   f"microbatch {microbatch} needs a DeferredWQueue")
            with self.deferred_w.capture((self.stage_index, microbatch)):
                _backward(root, grad)
        else:
            _backward(root, grad)
        g = self._input_grads(st)
        del self.microbatches[microbatch]
        return g

    def backward_input(self, microbatch: int, grad_output: Any) -> Any:
        """I: the input gradient only (as :meth:`backward` returns it); the graph is kept for
        ``backward_weight``."""
        st = self._state(microbatch, "backward_input")
        root, grad = self._roots(st, grad_output, microbatch)
        st.grad_output = grad_output if isinstance(st.output, tuple) else grad
        st.input_grad_done = True
        ins = self._grad_inputs(st)
        if self.deferred_w is not None:
            # one walk; the graph is freed and W tasks hold what they need
            with self.deferred_w.capture((self.stage_index, microbatch)):
                _backward(root, grad)
            g = self._input_grads(st)
            st.inputs, st.output, st.loss, st.grad_output = (), None, None, None  # type: ignore[assignment]
            return g
        if st.tuple_input:
            gs = torch.autograd.grad(root, ins, grad, retain_graph=True, allow_unused=True) \
                if ins and (not isinstance(root, list) or root) else [None] * len(ins)
            got = {id(t): g for t, g in zip(ins, gs)}
            return tuple((got[id(t)] if got[id(t)] is not None else torch.zeros_like(t))
                         if t.requires_grad else None for t in st.inputs)
        if not ins:
            return None
        (g,) = torch.autograd.grad(root, ins[0], grad, retain_graph=True)
        return g

    def backward_weight(self, microbatch: int) -> None:
        """W: parameter gradients of a microbatch whose ``backward_input`` ran; frees its state."""
        st = self._state(microbatch, "backward_weight")
        if not st.input_grad_done:
            raise RuntimeError(f"stage {self.stage_index}: W of microbatch {microbatch} before its I")
        if self.deferred_w is not None:
            self.deferred_w.run((self.stage_index, microbatch))
            del self.microbatches[microbatch]
            return
        root, grad = self._roots(st, st.grad_output, microbatch)
        params = self.parameters()
        if params and (not isinstance(root, list) or root):
            torch.autograd.backward(root, grad, inputs=params)
        del self.microbatches[microbatch]

    def clear(self) -> None:
        """Drop every microbatch's state (after a failed step), and its pending W tasks."""
        self.microbatches.clear()
        if self.deferred_w is not None:
            self.deferred_w.discard(lambda key: isinstance(key, tuple) and key[0] == self.stage_index)


def _backward(root: Any, grad: Any) -> None:
    """``torch.autograd.backward(root, grad)``, a no-op for an empty list of roots (a tuple
    boundary none of whose outputs carries a gradient)."""
    if isinstance(root, list) and not root:
        return
    torch.autograd.backward(root, grad)
