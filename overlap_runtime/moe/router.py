"""Top-k softmax router with the load-balancing auxiliary loss.

``TopKRouter(hidden, num_experts, top_k)(x)`` scores every token against every expert with one
linear layer (no bias), takes the softmax in fp32 (float64 for a float64 layer: never a silent
downgrade) and keeps the ``top_k`` best experts::

    logits  = x @ W^T                       [N, E]   (x's dtype)
    probs   = softmax(logits.to(R), -1)     [N, E]   R = promote_types(x.dtype, fp32)
    scores, indices = topk(probs, k)        [N, k]   R / int64
    scores /= scores.sum(-1)                (``renormalize``: when top_k > 1, or always
                                             with ``renormalize_top1``; a single kept score
                                             then becomes exactly 1, as Hugging Face's
                                             Qwen3.5-MoE router does)

Auxiliary loss (Switch Transformer / GShard form), computed from this rank's tokens only::

    f_e = (token slots routed to e) / (N * k)       fraction of assignments, no gradient
    P_e = mean over tokens of probs[:, e]           differentiable
    aux = coef * E * sum_e f_e * P_e                 1 * coef for a perfectly uniform router

``attach_aux_loss(out, aux)`` makes ``aux`` part of the backward of whatever consumes ``out``
(identity on values, gradient 1 for ``aux``), so a pipeline stage that returns one tensor still
trains the router's balance term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx


@dataclass(frozen=True)
class RoutingResult:
    """What the router decided for ``N`` tokens.

    Attributes:
        top_indices: ``[N, k]`` int64, global expert ids, best first.
        top_scores: ``[N, k]`` fp32 (float64 for a float64 layer), combine weights
            (differentiable).
        aux_loss: scalar, the scores' dtype, the load-balancing loss already multiplied by its
            coefficient.
        probs: ``[N, E]`` the full softmax (differentiable; the pooled loss of
            ``moe.pooled_aux`` reads it).
    """

    top_indices: torch.Tensor
    top_scores: torch.Tensor
    aux_loss: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.top_indices.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.top_indices.shape[1])


class TopKRouter(nn.Module):
    """Linear gate + softmax + top-k (see the module doc).

    Args:
        hidden: model width H.
        num_experts: E, the global number of routed experts.
        top_k: experts per token, ``1 <= top_k <= E``.
        aux_loss_coef: weight of the load-balancing loss (0 disables it; the tensor is then 0).
        renormalize: divide the kept scores by their sum (so each token's weights sum to 1).
        renormalize_top1: also at ``top_k == 1`` (the weight becomes 1 and the router learns
            only through the aux loss); False keeps the raw probability there.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, aux_loss_coef: float = 1e-2,
                 renormalize: bool = True, device: Any = None, dtype: torch.dtype | None = None,
                 renormalize_top1: bool = False) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"TopKRouter: num_experts={num_experts} must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if aux_loss_coef < 0:
            raise ValueError(f"TopKRouter: aux_loss_coef={aux_loss_coef} must be >= 0")
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_loss_coef = float(aux_loss_coef)
        self.renormalize = renormalize
        self.renormalize_top1 = renormalize_top1
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> RoutingResult:
        """Route ``x`` ``[N, H]`` (any float dtype); see :class:`RoutingResult`."""
        if x.dim() != 2:
            raise ValueError(f"TopKRouter: expected tokens [N, H], got shape {tuple(x.shape)}")
        logits = self.gate(x)
        # fp32 for bf16/fp16/fp32 layers; a float64 layer stays float64 (no silent downgrade)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        scores, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize and (self.top_k > 1 or self.renormalize_top1):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return RoutingResult(indices, scores, self.aux_loss(probs, indices), probs)

    def aux_loss(self, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``coef * E * sum_e f_e P_e`` from ``probs [N, E]`` (fp32 or float64) and ``indices
        [N, k]``, in probs' dtype."""
        n = probs.shape[0]
        if self.aux_loss_coef == 0.0 or n == 0:
            return probs.sum() * 0.0  # keeps the graph (and the dtype) with no contribution
        counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts).to(probs.dtype)
        f = counts / (n * self.top_k)
        p = probs.mean(dim=0)
        return self.aux_loss_coef * self.num_experts * (f * p).sum()


class _AttachAux(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Identity on ``out`` whose backward also back-propagates ``aux`` with gradient 1.

    The effective objective is ``loss(out) + aux``. Under a pipeline schedule that scales each
    microbatch's loss by ``1 / num_microbatches`` the aux term is *not* scaled (it enters per
    microbatch); choose ``aux_loss_coef`` with that in mind.
    """
    if not aux.requires_grad or not torch.is_grad_enabled():
        return out
    return _AttachAux.apply(out, aux)
