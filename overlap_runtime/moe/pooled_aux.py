"""The load-balancing loss pooled over the MoE layers of one forward (Hugging Face's form).

Hugging Face's Qwen3.5-MoE / Qwen2-MoE add ``router_aux_loss_coef * aux`` with one statistic over
all ``L`` MoE layers of the forward (each routing the same ``N`` tokens)::

    C_e = sum_l (token slots of layer l routed to e)          no gradient
    P_e = sum_l sum_n probs_l[n, e]                            differentiable
    aux = coef * E * sum_e (C_e / (L N)) * (P_e / (L N))

Layer ``l``'s share of the gradient, ``d aux / d probs_l[n, e] = coef * E * C_e / (L N)^2``,
needs every layer's counts, which exist only once the forward is over. So each layer registers
its counts in a per-call :class:`RouterStatsPool` (created by the model's forward, passed down
explicitly; never state on a module) and attaches to its output an identity whose backward
(run after the whole forward) reads the pool's totals. Recomputing a layer (activation
checkpointing) registers the same counts under the same key again: no double count.
"""

from __future__ import annotations

from typing import Any

import torch


class RouterStatsPool:
    """Per-forward routing statistics of every MoE layer (module docstring).

    Args:
        coef: the loss weight (``router_aux_loss_coef``).
    """

    def __init__(self, coef: float) -> None:
        self.coef = float(coef)
        self._counts: dict[int, torch.Tensor] = {}
        self._tokens: dict[int, int] = {}

    def add(self, key: int, counts: torch.Tensor, tokens: int) -> None:
        """Layer ``key``'s expert counts ``[E]`` (token slots) over its ``tokens`` tokens."""
        self._counts[key] = counts.detach()
        self._tokens[key] = int(tokens)

    def grad_scale(self) -> torch.Tensor:
        """``coef * E * C / (L N)^2`` ``[E]``: the gradient of the pooled loss with respect to
        every probability of every layer."""
        if not self._counts:
            raise RuntimeError("RouterStatsPool: no MoE layer registered its counts")
        tokens = set(self._tokens.values())
        if len(tokens) != 1:
            raise RuntimeError(f"RouterStatsPool: the MoE layers routed different token counts "
                               f"{sorted(tokens)}; the pooled loss needs one N")
        c = torch.stack(list(self._counts.values())).sum(0)
        rows = len(self._counts) * tokens.pop()
        return self.coef * c.numel() * c / rows ** 2

    def value(self, probs_sums: list[torch.Tensor]) -> torch.Tensor:
        """The pooled loss from every layer's ``probs.sum(0)`` (for reporting)."""
        p = torch.stack(probs_sums).sum(0)
        return (self.grad_scale().to(p.dtype) * p).sum()


class _AttachPooled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, probs: torch.Tensor, pool: RouterStatsPool
                ) -> torch.Tensor:
        ctx.pool = pool
        ctx.meta = (probs.shape, probs.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype = ctx.meta
        scale = ctx.pool.grad_scale().to(dtype)                 # [E]
        return grad, scale.expand(shape), None


def attach_pooled_aux(out: torch.Tensor, probs: torch.Tensor, pool: RouterStatsPool
                      ) -> torch.Tensor:
    """Identity on ``out`` whose backward adds the pooled loss's gradient to ``probs``
    ``[N, E]`` (this layer's router probabilities)."""
    if not probs.requires_grad or not torch.is_grad_enabled():
        return out
    return _AttachPooled.apply(out, probs, pool)
