"""Routed experts as grouped GEMMs, and the dense feed-forward used as the shared expert.

``GroupedExperts`` holds the SwiGLU weights of all its experts stacked::

    w1, w3: [E, H, F]     w2: [E, F, H]
    y_e = (silu(x_e @ w1[e]) * (x_e @ w3[e])) @ w2[e]     for the rows x_e of expert e

Its input is expert-major: the first ``tokens_per_expert[0]`` rows belong to expert 0, and so on
(what :meth:`AllToAllTokenDispatcher.dispatch` returns).

Two backends compute the same thing:

* ``"grouped_mm"``: ``torch._grouped_mm`` (one kernel per projection for all experts, offsets
  from ``tokens_per_expert``). Used only where :func:`grouped_mm_supported` says so: a CUDA
  device of compute capability >= 9.0, bf16 weights and activations, and H and F multiples of 8
  (16-byte rows). torch's CPU build ships a ``_grouped_mm`` too, but its backward fails on
  CPU in torch 2.13 (``Invalid strides/sizes``), so CPU never takes it.
* ``"loop"`` (the default): a Python loop over the local experts, one ``mm`` chain per expert.
  Runs everywhere.

There is no ``auto`` and no fallback: ``grouped_mm`` where it is not supported raises, naming the
failed condition.

An expert that receives no rows still runs its (empty) matmuls, so the output stays connected to
the input and to every weight in autograd even when the whole rank receives zero tokens: the
backward then runs the reverse all-to-alls like every other rank (no hang, no "element 0 does
not require grad").
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from overlap_runtime.pipeline.deferred_w import DeferredWQueue, accumulate_grad

ExpertBackend = Literal["loop", "grouped_mm"]


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype, hidden: int,
                         ffn_hidden: int) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` can run this expert layer; ``(ok, reason when not)``."""
    dev = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    if dev.type != "cuda":
        return False, f"device {dev} is not cuda (the CPU _grouped_mm backward fails in torch 2.13)"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 9:
        return False, f"compute capability {major}.{minor} < 9.0"
    if dtype != torch.bfloat16:
        return False, f"dtype {dtype} is not bfloat16"
    if hidden % 8 or ffn_hidden % 8:
        return False, f"hidden {hidden} and ffn_hidden {ffn_hidden} must be multiples of 8"
    return True, ""


class DeferredWUnsupportedError(NotImplementedError):
    """Deferred expert weight gradients asked of a backend that does not implement them."""


def _expert_weight_grads(xs: list[torch.Tensor], hs: list[torch.Tensor], das: list[torch.Tensor],
                         dbs: list[torch.Tensor], dys: list[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dW1, dW3, dW2 ``[E, ...]`` of every local expert from its GEMMs' inputs and output
    gradients (an expert without rows gets zeros)."""
    dw1 = torch.stack([x.t() @ da for x, da in zip(xs, das)])
    dw3 = torch.stack([x.t() @ db for x, db in zip(xs, dbs)])
    dw2 = torch.stack([h.t() @ dy for h, dy in zip(hs, dys)])
    return dw1, dw3, dw2


class _LoopExpertsFn(torch.autograd.Function):
    """The loop backend with a split backward: dX now, dW1/dW3/dW2 now or as one W task."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                counts: list[int], queue: DeferredWQueue) -> torch.Tensor:
        outs, As, Bs = [], [], []
        for e, part in enumerate(torch.split(x, counts, dim=0)):
            a, b = part @ w1[e], part @ w3[e]
            outs.append((F.silu(a) * b) @ w2[e])
            As.append(a)
            Bs.append(b)
        ctx.save_for_backward(x, w1, w3, w2, torch.cat(As), torch.cat(Bs))
        ctx.counts, ctx.queue = counts, queue
        return torch.cat(outs, dim=0)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w3, w2, a_all, b_all = ctx.saved_tensors
        counts, queue = ctx.counts, ctx.queue
        need_x = ctx.needs_input_grad[0]
        need_w = any(ctx.needs_input_grad[1:4])
        xs = list(torch.split(x, counts, 0))
        dys = list(torch.split(grad_out, counts, 0))
        hs, das, dbs, dxs = [], [], [], []
        for e, (a, b, dy) in enumerate(zip(torch.split(a_all, counts, 0),
                                          torch.split(b_all, counts, 0), dys)):
            sig = torch.sigmoid(a)
            silu = a * sig
            dh = dy @ w2[e].t()
            da = dh * b * (sig * (1 + a * (1 - sig)))  # d silu(a) / da
            db = dh * silu
            hs.append(silu * b)
            das.append(da)
            dbs.append(db)
            if need_x:
                dxs.append(da @ w1[e].t() + db @ w3[e].t())
        grad_x = torch.cat(dxs, 0) if need_x else None
        if not need_w:
            return grad_x, None, None, None, None, None
        if queue.capturing is not None:
            params = (w1, w3, w2)

            def task() -> None:
                for p, g in zip(params, _expert_weight_grads(xs, hs, das, dbs, dys)):
                    if p.requires_grad:
                        accumulate_grad(p, g)

            queue.push(task, (x, grad_out, *hs, *das, *dbs),
                       what=f"experts {tuple(w1.shape)} x {len(counts)}")
            return grad_x, None, None, None, None, None
        dw1, dw3, dw2 = _expert_weight_grads(xs, hs, das, dbs, dys)
        return (grad_x, dw1 if ctx.needs_input_grad[1] else None,
                dw3 if ctx.needs_input_grad[2] else None,
                dw2 if ctx.needs_input_grad[3] else None, None, None)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts (see the module doc).

    Args:
        num_experts: experts held here (all of them before :meth:`shard_`, the local ones after).
        hidden: H.  ffn_hidden: F.
        backend: ``"loop"`` or ``"grouped_mm"`` (no ``auto``).
        deferred_w_queue: defer the weight gradients to this queue while it captures (loop
            backend only; see the module doc). None: immediate gradients, no custom Function.
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int,
                 backend: ExpertBackend = "loop", device: Any = None,
                 dtype: torch.dtype | None = None, *,
                 deferred_w_queue: DeferredWQueue | None = None) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"GroupedExperts: num_experts={num_experts} must be >= 1")
        if backend not in ("loop", "grouped_mm"):
            raise ValueError(f"GroupedExperts: backend {backend!r} is not 'loop' or 'grouped_mm' "
                             f"(there is no 'auto')")
        self.num_experts = num_experts
        self.global_num_experts = num_experts
        self.expert_offset = 0
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.backend = backend
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden, **kw))
        self.deferred_w_queue: DeferredWQueue | None = None
        self.reset_parameters()
        if deferred_w_queue is not None:
            self.defer_weight_gradients(deferred_w_queue)

    def defer_weight_gradients(self, queue: DeferredWQueue | None) -> "GroupedExperts":
        """Configure (or, with None, remove) the W queue the expert weight gradients go to while
        it captures; returns self. Raises :class:`DeferredWUnsupportedError` on ``grouped_mm``."""
        if queue is not None and not isinstance(queue, DeferredWQueue):
            raise TypeError(f"GroupedExperts.defer_weight_gradients needs a DeferredWQueue, got "
                            f"{type(queue).__name__}")
        if queue is not None and self.backend != "loop":
            raise DeferredWUnsupportedError(
                f"GroupedExperts(backend={self.backend!r}): deferred weight gradients are "
                f"implemented for backend='loop' only")
        self.deferred_w_queue = queue
        return self

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w, fan_in in ((self.w1, self.hidden), (self.w3, self.hidden),
                              (self.w2, self.ffn_hidden)):
                w.normal_(0.0, 1.0 / math.sqrt(fan_in))

    def shard_(self, ep_rank: int, ep_size: int) -> "GroupedExperts":
        """Keep experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` (in place); returns self."""
        if self.num_experts != self.global_num_experts:
            raise RuntimeError(f"GroupedExperts: already sharded ({self.num_experts} of "
                               f"{self.global_num_experts} experts kept)")
        if self.num_experts % ep_size:
            raise ValueError(f"GroupedExperts: {self.num_experts} experts cannot be split over "
                             f"ep_size={ep_size} ranks evenly")
        n = self.num_experts // ep_size
        lo = ep_rank * n
        for name in ("w1", "w2", "w3"):
            w = getattr(self, name)
            setattr(self, name, nn.Parameter(w.detach()[lo:lo + n].clone()))
        self.num_experts, self.expert_offset = n, lo
        return self

    def resolved_backend(self, x: torch.Tensor) -> str:
        """The backend this call takes for input ``x`` (``"loop"`` or ``"grouped_mm"``)."""
        if self.backend == "loop":
            return "loop"
        ok, why = grouped_mm_supported(x.device, x.dtype, self.hidden, self.ffn_hidden)
        if not ok:
            raise RuntimeError(f"GroupedExperts(backend='grouped_mm'): not supported here: {why}")
        return "grouped_mm"

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, H]`` expert-major rows; ``tokens_per_expert`` ``[E_local]`` int64 (any
        device) summing to M. Returns ``[M, H]`` in x's dtype."""
        counts = [int(c) for c in tokens_per_expert.tolist()]
        if len(counts) != self.num_experts or sum(counts) != x.shape[0]:
            raise ValueError(f"GroupedExperts: tokens_per_expert {counts} must have "
                             f"{self.num_experts} entries summing to the {x.shape[0]} rows of x")
        if self.resolved_backend(x) == "grouped_mm":
            if self.deferred_w_queue is not None:  # set by hand past defer_weight_gradients
                raise DeferredWUnsupportedError("GroupedExperts(backend='grouped_mm') with a "
                                                "deferred_w_queue: only backend='loop' defers W")
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1, offs=offs)) * torch._grouped_mm(x, self.w3, offs=offs)
            return torch._grouped_mm(h, self.w2, offs=offs)
        if self.deferred_w_queue is not None:
            return _LoopExpertsFn.apply(x, self.w1, self.w3, self.w2, counts,
                                        self.deferred_w_queue)
        outs = []
        for e, part in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(part @ self.w1[e]) * (part @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs, dim=0)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (offset {self.expert_offset} of "
                f"{self.global_num_experts}), hidden={self.hidden}, ffn={self.ffn_hidden}, "
                f"backend={self.backend}"
                + (f", deferred_w={self.deferred_w_queue.name!r}" if self.deferred_w_queue
                   else ""))


class FeedForward(nn.Module):
    """Dense SwiGLU FFN ``[..., H] -> [..., H]`` (the shared expert)."""

    def __init__(self, hidden: int, ffn_hidden: int, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.w1 = nn.Linear(hidden, ffn_hidden, **kw)
        self.w3 = nn.Linear(hidden, ffn_hidden, **kw)
        self.w2 = nn.Linear(ffn_hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
