"""sync_hook: the differentiable A/B/C/D/D_LAST hook, identity on values and gradients.

A MoE layer brackets each all-to-all with a pair of hooks::

    h = attention(x)                              compute region
    h = sync_hook(h, "A", coordinator, layer)     forward COMM     | backward COMPUTE
    d = dispatch_all_to_all(h)                    comm region
    d = sync_hook(d, "B", coordinator, layer)     forward COMPUTE  | backward COMM
    e = experts(d)                                compute region
    e = sync_hook(e, "C", coordinator, layer)     forward COMM     | backward COMPUTE
    y = combine_all_to_all(e)                     comm region
    y = sync_hook(y, "D", coordinator, layer)     forward COMPUTE  | backward COMM
                  ("D_LAST" on the last MoE layer of a chunk)

Autograd runs the backward hooks in reverse (D, C, B, A), so in the backward the comm regions are
D->C (combine backward) and B->A (dispatch backward): the role tables
:data:`FORWARD_ROLES` / :data:`BACKWARD_ROLES` say which hook opens and which closes a region.
The hook's input must be on the autograd path (``requires_grad``) for its backward to run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from overlap_runtime.coordinator.coordinator import HOOK_LETTERS, HookCoordinator, Side


class _SyncHook(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, letter: str, coordinator: HookCoordinator,
                layer: int) -> torch.Tensor:
        ctx.letter, ctx.coordinator, ctx.layer = letter, coordinator, layer
        coordinator.hook(Side.FORWARD, letter, layer)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.coordinator.hook(Side.BACKWARD, ctx.letter, ctx.layer)
        return grad, None, None, None


def sync_hook(x: torch.Tensor, letter: str, coordinator: HookCoordinator | None,
              layer: int) -> torch.Tensor:
    """Identity on ``x`` (any shape and dtype) and on its gradient; a coordination point.

    Args:
        x: the activation flowing through the layer at this point.
        letter: ``"A"``, ``"B"``, ``"C"``, ``"D"`` or ``"D_LAST"`` (see the module doc).
        coordinator: the run's HookCoordinator; None makes the hook a plain identity.
        layer: MoE layer index, for error messages and traces.

    Returns a view of ``x``. The forward pass calls ``coordinator.hook(FORWARD, ...)``, the
    backward ``coordinator.hook(BACKWARD, ...)``; either may block (bounded by the coordinator's
    ``timeout_s``) and raise CoordinatorTimeout / CoordinatorAborted / CoordinatorProtocolError.
    """
    if letter not in HOOK_LETTERS:
        raise ValueError(f"sync_hook: letter {letter!r} is not one of {list(HOOK_LETTERS)}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"sync_hook: layer must be a non-negative int, got {layer!r}")
    if coordinator is None:
        return x
    return _SyncHook.apply(x, letter, coordinator, layer)
