"""Helpers for the MoE tests: tiny models, per-rank data, serial references, overlapped training."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.moe import GroupedExperts, MoE
from overlap_runtime.moe.experts import FeedForward
from overlap_runtime.testing import rel_l2

HIDDEN, FFN, EXPERTS, TOP_K = 8, 16, 4, 2


def make_moe(shared: bool = True, seed: int = 0, experts: int = EXPERTS, **kw: Any) -> MoE:
    torch.manual_seed(seed)
    return MoE(HIDDEN, FFN, experts, TOP_K, shared_ffn_hidden=FFN if shared else None, **kw)


def tokens(rank: int, n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(1000 * seed + rank))


def objective(out: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """A loss that weights every output element differently (fixed random weights)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return (out * w).sum()


def expert_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def ep_errors(moe: MoE, ref: MoE, rank: int, world: int, xs: list[torch.Tensor],
              with_aux: bool = True) -> dict[str, float]:
    """Run ``moe`` (expert-parallel) on this rank's tokens and the unsharded ``ref`` serially on
    every rank's tokens; rel-L2 of output, aux loss, input gradient and every parameter gradient.

    Replicated parameters (router, shared expert) are compared with the reference gradient of
    this rank's tokens only; expert weights with the sum over every rank's tokens (that is what
    EP computes: an expert sees the tokens of all ranks).
    """
    x = xs[rank].clone().requires_grad_(True)
    out, aux = moe(x, return_aux=True)
    (objective(out) + (aux if with_aux else 0)).backward()
    errs: dict[str, float] = {}
    local_ref_grads: dict[str, torch.Tensor] = {}
    expert_sums: dict[str, torch.Tensor] = {}
    for q, xq in enumerate(xs):
        ref.zero_grad(set_to_none=True)
        xr = xq.clone().requires_grad_(True)
        ro, raux = ref(xr, return_aux=True)
        (objective(ro) + (raux if with_aux else 0)).backward()
        if q == rank:
            errs["out"] = rel_l2(out, ro)
            errs["aux"] = rel_l2(aux, raux)
            errs["dx"] = rel_l2(x.grad, xr.grad)
            local_ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()
                               if not n.startswith("experts.")}
        for n, p in ref.named_parameters():
            if n.startswith("experts."):
                acc = expert_sums.setdefault(n, torch.zeros_like(p))
                acc += p.grad
    for n, p in moe.named_parameters():
        if n.startswith("experts."):
            want = expert_slice(expert_sums[n], rank, world)
        else:
            want = local_ref_grads[n]
        errs[f"d{n}"] = rel_l2(p.grad, want)
    return errs


class SlowExperts(GroupedExperts):
    """Experts that take ``delay_s`` longer (a rank with more work launches its combine late)."""

    delay_s = 0.0

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return super().forward(x, tokens_per_expert)


class SlowFeedForward(FeedForward):
    """A shared expert whose compute takes ``delay_s`` (sleep releases the GIL, like a kernel)."""

    delay_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return super().forward(x)


class Block(nn.Module):
    """``x + MoE(act(Linear(x)))``; ``positive`` uses softplus so MoE inputs are > 0."""

    def __init__(self, shared: bool, positive: bool = False) -> None:
        super().__init__()
        self.mixer = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, FFN, EXPERTS, TOP_K, shared_ffn_hidden=FFN if shared else None)
        self.positive = positive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mixer(x)
        h = F.softplus(h) if self.positive else torch.tanh(h)
        return x + self.moe(h)


def make_chunk(layers: int = 2, seed: int = 0, shared: bool = True,
               positive: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(shared, positive) for _ in range(layers)])


def route_to_first_rank(chunk: nn.Module, experts_on_first: int) -> None:
    """Gate weights that send every positive token to experts ``< experts_on_first``."""
    with torch.no_grad():
        for m in chunk.modules():
            if isinstance(m, MoE):
                w = m.router.gate.weight
                w.abs_()
                w[experts_on_first:] *= -1


def train_overlapped(chunk: nn.Module, coordinator: HookCoordinator, rank: int, n_mb: int,
                     overlapped: bool, rows: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward of microbatch k+1 beside the backward of microbatch k (n_mb + 1 pairings).

    With ``overlapped=False`` the coordinator is disabled and each pairing runs serially in the
    caller. Returns (outputs, parameter gradients).
    """
    if not overlapped:
        coordinator.disable()
    outs: list[torch.Tensor] = []
    with CommComputeOverlap(coordinator) as ov:
        loss_prev = None
        for mb in range(n_mb + 1):
            x = (torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(100 * rank + mb))
                 if mb < n_mb else None)
            fwd: Callable[[], Any] = (lambda x=x: chunk(x)) if x is not None else (lambda: None)
            bwd: Callable[[], Any] = loss_prev.backward if loss_prev is not None else (lambda: None)
            out, _ = ov.run(fwd, bwd)
            if out is not None:
                outs.append(out.detach())
                loss_prev = objective(out, seed=mb)
    if not overlapped:
        coordinator.enable()
    return outs, [p.grad.clone() for p in chunk.parameters()]
