"""Toy chunks for the coordinator tests: MoE-shaped layers made of sync hooks and small matmuls.

A layer is ``attn -> A -> "dispatch" -> B -> expert -> C -> "combine" -> D`` where the two comm
steps are either identities (coordinator-only tests) or real all-to-alls (``comm`` given).
``Inject`` raises a marked exception before or after one hook, in the forward pass (plain code)
or in the backward pass (tensor hooks, which run in the thread that runs the backward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from overlap_runtime.coordinator import HookCoordinator, sync_hook


class Injected(RuntimeError):
    """The exception a scenario plants."""


@dataclass(frozen=True)
class Inject:
    direction: str  # "forward" | "backward"
    letter: str  # A | B | C | D (D means the layer's D or D_LAST)
    when: str  # "before" | "after" (in the order of that pass)
    layer: int = 0
    stall_s: float = 0.0  # > 0: sleep instead of raising

    def fire(self) -> None:
        if self.stall_s > 0:
            time.sleep(self.stall_s)
            return
        raise_injected(self)


def raise_injected(inj: Inject) -> None:
    raise Injected(f"planted {inj.when} hook {inj.letter} (layer {inj.layer}) in the "
                   f"{inj.direction} pass")


def _grad_hook(inj: Inject) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        inj.fire()
    return hook


def _point(x: torch.Tensor, letter: str, coord: HookCoordinator | None, layer: int,
           inj: Inject | None) -> torch.Tensor:
    base = "D" if letter == "D_LAST" else letter
    hit = inj is not None and inj.letter == base and inj.layer == layer
    if hit and inj.direction == "forward" and inj.when == "before":
        inj.fire()
    if hit and inj.direction == "backward" and inj.when == "after" and x.requires_grad:
        x.register_hook(_grad_hook(inj))
    y = sync_hook(x, letter, coord, layer)
    if hit and inj.direction == "forward" and inj.when == "after":
        inj.fire()
    if hit and inj.direction == "backward" and inj.when == "before" and y.requires_grad:
        y.register_hook(_grad_hook(inj))
    return y


Comm = Callable[[torch.Tensor, str], torch.Tensor]


def layer(x: torch.Tensor, w_attn: torch.Tensor, w_exp: torch.Tensor,
          coord: HookCoordinator | None, idx: int, last: bool, inj: Inject | None = None,
          comm: Comm | None = None) -> torch.Tensor:
    """One MoE-shaped layer; ``comm(t, tag)`` plays dispatch and combine (identity if None)."""
    h = torch.tanh(x @ w_attn)
    h = _point(h, "A", coord, idx, inj)
    d = comm(h, f"L{idx}.dispatch") if comm else h * 1.0
    d = _point(d, "B", coord, idx, inj)
    e = torch.tanh(d @ w_exp)
    e = _point(e, "C", coord, idx, inj)
    c = comm(e, f"L{idx}.combine") if comm else e * 1.0
    c = _point(c, "D_LAST" if last else "D", coord, idx, inj)
    return x + c


def chunk(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]],
          coord: HookCoordinator | None, inj: Inject | None = None, comm: Comm | None = None,
          d_last: bool = True) -> torch.Tensor:
    """A chunk of ``len(weights)`` layers; the last one's D is D_LAST when ``d_last``."""
    for i, (wa, we) in enumerate(weights):
        x = layer(x, wa, we, coord, i, d_last and i == len(weights) - 1, inj, comm)
    return x


def make_weights(n_layers: int, dim: int = 8,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(dim, dim, generator=g) / dim ** 0.5).requires_grad_(True),
             (torch.randn(dim, dim, generator=g) / dim ** 0.5).requires_grad_(True))
            for _ in range(n_layers)]


def make_input(mb: int, rows: int = 4, dim: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * seed + mb)
    return torch.randn(rows, dim, generator=g).requires_grad_(True)
