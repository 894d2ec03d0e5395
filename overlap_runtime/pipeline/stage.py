"""PipelineStage: one model chunk's forward, backward and split backward on torch autograd.

A stage holds a module and, per microbatch, the tensors autograd needs between the forward and
the backward. That per-microbatch state lives in :class:`MicrobatchState` objects kept in a dict
keyed by microbatch, created by ``forward`` and released by the last backward action, so any
number of microbatches may be in flight.

Boundary convention: a stage's input that came from another stage is a detached leaf with
``requires_grad=True``, so each stage's backward stops at its own input and produces the gradient
to send upstream. The first stage's inputs are the user's microbatch tensors (no gradient).
Outputs are one tensor per stage (the activation sent downstream).

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
from .tensor_meta import TensorMeta

__all__ = ["PipelineStage", "MicrobatchState"]


@dataclass
class MicrobatchState:
    """What one microbatch keeps on one stage between its forward and its backward.

    ``inputs``: the stage's inputs (a received activation is a leaf requiring grad);
    ``output``: the stage's output; ``loss``: the last stage's unscaled loss (a 0-dim tensor);
    ``loss_scale``: what the backward multiplies the loss by (``1 / num_microbatches`` when the
    schedule scales gradients); ``grad_output``: the output gradient kept between I and W;
    ``input_grad_done``: I ran.
    """

    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    loss: torch.Tensor | None = None
    loss_scale: float = 1.0
    grad_output: torch.Tensor | None = None
    input_grad_done: bool = False


class PipelineStage:
    """One pipeline stage (model chunk) placed on this rank.

    Args:
        module: the chunk; ``module(*inputs) -> Tensor``.
        stage_index: global stage index ``0 .. num_stages-1``.
        num_stages: number of stages of the whole model.
        device: where the module and its activations live.
        group: the pipeline process group (None: the default group).
        input_meta: shape/dtype of the activation this stage receives per microbatch (stages
            > 0). None: learnt by the schedule's one-time metadata exchange.
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
        input_meta: TensorMeta | None = None,
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
        self.output_meta: TensorMeta | None = None
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
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        target: Any = None,
        loss_scale: float = 1.0,
        *,
        kwargs: dict[str, Any] | None = None,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Run the chunk on one microbatch and keep what the backward needs.

        ``inputs``: the user's microbatch tensors on the first stage, else the one received
        activation (made a leaf requiring grad here). On the last stage ``loss_fn(output,
        target, **loss_kwargs)`` is computed and kept (scaled by ``loss_scale`` for the
        backward). ``kwargs``: keyword inputs of the module (the first stage's, split per
        microbatch by ``PipelineSchedule.step(**kwargs)``).
        Returns the output (detached view for sending downstream).
        """
        if microbatch in self.microbatches:
            raise RuntimeError(f"stage {self.stage_index}: forward of microbatch {microbatch} "
                               f"ran twice before its backward")
        if self.is_first:
            ins = tuple(inputs)
        else:
            if len(inputs) != 1:
                raise ValueError(f"stage {self.stage_index} takes one activation, got {len(inputs)}")
            x = inputs[0]
            if self.input_meta is not None and TensorMeta.of(x) != self.input_meta:
                raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: received "
                                 f"{TensorMeta.of(x)} but expected {self.input_meta}")
            ins = (x.detach().requires_grad_(True),)
        out = self.module(*ins, **(kwargs or {}))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {self.stage_index}: the module returned {type(out).__name__}; "
                            f"a stage returns one tensor")
        if self.output_meta is not None and not self.is_last and TensorMeta.of(out) != self.output_meta:
            raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: output is "
                             f"{TensorMeta.of(out)} but stage {self.stage_index + 1} expects "
                             f"{self.output_meta}")
        state = MicrobatchState(inputs=ins, output=out)
        if self.is_last and loss_fn is not None:
            loss = loss_fn(out, target, **(loss_kwargs or {}))
            state.loss = loss
            state.loss_scale = loss_scale
        self.microbatches[microbatch] = state
        return out.detach()

    # ------------------------------------------------------------------ backward
    def _state(self, microbatch: int, what: str) -> MicrobatchState:
        try:
            return self.microbatches[microbatch]
        except KeyError:
            raise RuntimeError(f"stage {self.stage_index}: {what} of microbatch {microbatch} "
                               f"before its forward") from None

    def _roots(self, st: MicrobatchState, grad_output: torch.Tensor | None,
               microbatch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_last:
            if st.loss is None:
                raise RuntimeError(f"stage {self.stage_index}: last stage has no loss for "
                                   f"microbatch {microbatch} (pass loss_fn to the schedule)")
            return st.loss * st.loss_scale, None
        if grad_output is None:
            raise RuntimeError(f"stage {self.stage_index}: backward of microbatch {microbatch} "
                               f"needs the output gradient from stage {self.stage_index + 1}")
        if grad_output.shape != st.output.shape or grad_output.dtype != st.output.dtype:
            raise ValueError(f"stage {self.stage_index} microbatch {microbatch}: gradient is "
                             f"{TensorMeta.of(grad_output)} but the output was {TensorMeta.of(st.output)}")
        return st.output, grad_output

    def _grad_inputs(self, st: MicrobatchState) -> list[torch.Tensor]:
        return [t for t in st.inputs if t.requires_grad]

    def backward(self, microbatch: int, grad_output: torch.Tensor | None,
                 defer_w: bool = False) -> torch.Tensor | None:
        """Full backward (B): parameter gradients accumulate; returns the input gradient
        (None on the first stage). Frees the microbatch's state. ``defer_w``: the deferred
        layers' weight gradients go to the W queue instead (run later by a flush or the drain
        at the end of the step)."""
        st = self._state(microbatch, "backward")
        root, grad = self._roots(st, grad_output, microbatch)
        if defer_w:
            if self.deferred_w is None:
                raise RuntimeError(f"stage {self.stage_index}: backward(defer_w=True) of "
                                   f"microbatch {microbatch} needs a DeferredWQueue")
            with self.deferred_w.capture((self.stage_index, microbatch)):
                torch.autograd.backward(root, grad)
        else:
            torch.autograd.backward(root, grad)
        ins = self._grad_inputs(st)
        g = ins[0].grad if ins else None
        del self.microbatches[microbatch]
        return g

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """I: the input gradient only; the graph is kept for ``backward_weight``."""
        st = self._state(microbatch, "backward_input")
        root, grad = self._roots(st, grad_output, microbatch)
        st.grad_output = grad
        st.input_grad_done = True
        ins = self._grad_inputs(st)
        if self.deferred_w is not None:
            # one walk; the graph is freed and W tasks hold what they need
            with self.deferred_w.capture((self.stage_index, microbatch)):
                torch.autograd.backward(root, grad)
            g = ins[0].grad if ins else None
            st.inputs, st.output, st.loss, st.grad_output = (), None, None, None  # type: ignore[assignment]
            return g
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
        if params:
            torch.autograd.backward(root, grad, inputs=params)
        del self.microbatches[microbatch]

    def clear(self) -> None:
        """Drop every microbatch's state (after a failed step), and its pending W tasks."""
        self.microbatches.clear()
        if self.deferred_w is not None:
            self.deferred_w.discard(lambda key: isinstance(key, tuple) and key[0] == self.stage_index)
