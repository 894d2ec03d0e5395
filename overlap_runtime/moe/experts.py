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

__all__ = ["GroupedExperts", "FeedForward", "grouped_mm_supported", "ExpertBackend"]

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


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts (see the module doc).

    Args:
        num_experts: experts held here (all of them before :meth:`shard_`, the local ones after).
        hidden: H.  ffn_hidden: F.
        backend: ``"loop"`` or ``"grouped_mm"`` (no ``auto``).
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int,
                 backend: ExpertBackend = "loop", device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
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
        self.reset_parameters()

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
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1, offs=offs)) * torch._grouped_mm(x, self.w3, offs=offs)
            return torch._grouped_mm(h, self.w2, offs=offs)
        outs = []
        for e, part in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(part @ self.w1[e]) * (part @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs, dim=0)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (offset {self.expert_offset} of "
                f"{self.global_num_experts}), hidden={self.hidden}, ffn={self.ffn_hidden}, "
                f"backend={self.backend}")


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
