"""MoE layer: router, routed experts over an all-to-all dispatcher, optional shared expert.

Forward order (the shared expert runs while the combine is in flight)::

    routing  = router(x)                                   compute
    permuted, tokens_per_expert, meta = dispatch(x, routing)        comm (A..B)
    y        = experts(permuted, tokens_per_expert)        compute
    handle, partial = combine_start(y, meta)               comm launched (C)
    shared   = shared_expert(x)                            compute, while the combine is in flight
    routed   = combine_wait(handle, partial)               comm done (D / D_LAST)
    out      = routed + shared                 (shared_expert_gate: routed + sigmoid(x Wg) * shared)

Timeline of one layer on one rank with a shared expert::

    compute  |router|            |experts|       |shared expert|      |+|
    comm            |==dispatch==|       |=======combine=======|
                                          ^ combine_start     ^ combine_wait

Without a shared expert the layer calls the synchronous ``combine`` (start and wait back to
back): no extra work, same collectives. ``overlap_shared_expert=False`` keeps a shared expert but
runs it after the combine (the serial baseline the overlapped order is measured against).

The layer keeps no per-call state: the routing, the metadata and the partial combine are locals
of ``forward``, so several microbatches may be inside the layer at once (in two threads).
The load-balancing loss is attached to the output's graph (``attach_aux_loss``); pass
``return_aux=True`` to also get it back.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .dispatcher import AllToAllTokenDispatcher
from .experts import ExpertBackend, FeedForward, GroupedExperts
from .load_stats import ExpertLoadStats
from .pooled_aux import attach_pooled_aux
from .router import TopKRouter, attach_aux_loss


class MoE(nn.Module):
    """Mixture-of-experts feed-forward block ``[..., H] -> [..., H]``.

    Args:
        hidden: H.  ffn_hidden: F of each routed expert.
        num_experts: E routed experts (global).  top_k: experts per token.
        shared_ffn_hidden: F of the shared expert; None: no shared expert.
        aux_loss_coef: load-balancing loss weight.
        overlap_shared_expert: run the shared expert while the combine is in flight (default).
        expert_backend: ``"loop"`` or ``"grouped_mm"`` (see ``experts.py``; no ``auto``).
        shared_expert_gate: scale the shared expert's output per token by
            ``sigmoid(shared_expert_gate(x))`` (a ``hidden -> 1`` linear, no bias), as
            Qwen3.5-MoE / Qwen2-MoE do. Needs a shared expert.
        renormalize_top1: the router renormalises its scores at ``top_k == 1`` too
            (:class:`TopKRouter`).

    ``dispatcher`` starts local (no EP group); ``ExpertParallel.apply`` shards the experts and
    installs an EP dispatcher.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int,
                 shared_ffn_hidden: int | None = None, aux_loss_coef: float = 1e-2,
                 overlap_shared_expert: bool = True, expert_backend: ExpertBackend = "loop",
                 device: Any = None, dtype: torch.dtype | None = None,
                 shared_expert_gate: bool = False, renormalize_top1: bool = False) -> None:
        super().__init__()
        if shared_expert_gate and not shared_ffn_hidden:
            raise ValueError("MoE: shared_expert_gate=True needs a shared expert "
                             "(shared_ffn_hidden)")
        self.hidden = hidden
        self.router = TopKRouter(hidden, num_experts, top_k, aux_loss_coef, device=device,
                                 dtype=dtype, renormalize_top1=renormalize_top1)
        self.experts = GroupedExperts(num_experts, hidden, ffn_hidden, expert_backend,
                                      device=device, dtype=dtype)
        self.shared_expert = (FeedForward(hidden, shared_ffn_hidden, device=device, dtype=dtype)
                              if shared_ffn_hidden else None)
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False, device=device, dtype=dtype)
                                   if shared_expert_gate else None)
        self.overlap_shared_expert = overlap_shared_expert
        self.dispatcher = AllToAllTokenDispatcher(num_experts)
        self.load_stats: tuple[ExpertLoadStats, int] | None = None

    def count_load(self, stats: ExpertLoadStats | None, layer: int = 0) -> "MoE":
        """Add every forward's expert counts to ``stats`` under ``layer`` (None: stop);
        configuration only (the sink, not per-call state; ``moe.load_stats``). Returns self."""
        self.load_stats = None if stats is None else (stats, int(layer))
        return self

    def defer_weight_gradients(self, queue: Any) -> "MoE":
        """Defer the routed experts' weight gradients to ``queue`` (a ``DeferredWQueue``; None
        removes it) while it captures, and run its pending W tasks in this layer's all-to-all
        windows (the dispatcher's; EP only). Router and shared expert keep immediate gradients.
        Configuration only: call it after ``ExpertParallel.apply`` (which installs a new
        dispatcher) or give the queue to ``ExpertParallel(deferred_w=...)``. Returns self."""
        self.experts.defer_weight_gradients(queue)
        self.dispatcher.defer_weight_gradients(queue)
        return self

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def forward(self, x: torch.Tensor, return_aux: bool = False,
                router_pool: Any = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[..., H]`` -> same shape and dtype (and the aux loss, fp32 scalar, if asked).

        A float64 layer computes in float64 throughout: router softmax, scores, aux loss and the
        combine weighting are float64 (fp32 for bf16/fp16/fp32 layers), never a silent fp32.

        ``x`` is read again by the shared expert after the combine is launched: it must not be
        modified in place by anyone until the layer returns.

        ``router_pool``: a per-forward :class:`~overlap_runtime.moe.pooled_aux.RouterStatsPool`:
        this layer's counts join the load-balancing loss pooled over every MoE layer of the
        forward (Hugging Face's form) instead of its own ``aux_loss_coef`` term.
        """
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoE: last dim of x is {x.shape[-1]}, expected hidden={self.hidden}")
        d = self.dispatcher
        x_flat = x.reshape(-1, self.hidden)
        routing = self.router(x_flat)
        permuted, tokens_per_expert, meta = d.dispatch(x_flat, routing)
        if self.load_stats is not None:
            stats, layer = self.load_stats
            stats.add(layer, routing.top_indices, int(tokens_per_expert.sum()))
        y = self._timed("experts", lambda: self.experts(permuted, tokens_per_expert))
        if self.shared_expert is None:
            out = d.combine(y, meta)
        elif self.overlap_shared_expert:
            handle, partial = d.combine_start(y, meta)
            shared = self._timed("shared_expert", lambda: self._shared(x_flat))
            out = d.combine_wait(handle, partial) + shared
        else:
            routed = d.combine(y, meta)
            out = routed + self._timed("shared_expert", lambda: self._shared(x_flat))
        out = attach_aux_loss(out.view(x.shape), routing.aux_loss)
        if router_pool is not None:
            counts = torch.bincount(routing.top_indices.reshape(-1),
                                    minlength=self.num_experts).to(routing.probs.dtype)
            router_pool.add(id(self), counts, routing.num_tokens)
            out = attach_pooled_aux(out, routing.probs, router_pool)
        return (out, routing.aux_loss) if return_aux else out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert of tokens ``x [N, H]``, gated per token when configured."""
        assert self.shared_expert is not None
        out = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out

    def _timed(self, what: str, fn: Any) -> torch.Tensor:
        sink = self.dispatcher.trace
        if sink is None:
            return fn()
        t0 = time.time_ns()
        out = fn()
        sink.record(f"{self.dispatcher.tag}.{what}", "moe_compute", t0, time.time_ns())
        return out
