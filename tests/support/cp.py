"""Helpers for the context-parallel tests: reference attention, inputs, a c10d op counter."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float | None = None) -> torch.Tensor:
    """Plain float64 softmax attention with autograd; q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``.

    Independent of ``ops.attention``: materialises the expanded kv heads and the full score
    matrix and lets autograd differentiate ``softmax``.
    """
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = (x.double() for x in (q, k, v))
    kd, vd = kd.repeat_interleave(g, dim=2), vd.repeat_interleave(g, dim=2)
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * sc
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool).tril_(diagonal=n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vd)


def make_qkv(seed: int, b: int, s: int, hq: int, hkv: int, d: int,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and an upstream gradient dout (same on every rank for one seed)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g)
    k = torch.randn(b, s, hkv, d, generator=g)
    v = torch.randn(b, s, hkv, d, generator=g)
    dout = torch.randn(b, s, hq, d, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v, dout))


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    causal: bool) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` of :func:`reference_attention` on the full sequence, float64."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    out = reference_attention(*leaves, causal=causal)
    out.backward(dout.double())
    return (out.detach(), *(x.grad for x in leaves))


_COMM_OPS = {
    "c10d.send.default": "send",
    "c10d.recv_.default": "recv",
    "c10d.alltoall_base_.default": "all_to_all",
    "c10d._allgather_base_.default": "all_gather",
}


class C10dOpCounter(TorchDispatchMode):
    """Counts the c10d operations torch actually dispatches (including point-to-point, which
    ``CommDebugMode`` does not track). Any other c10d op is recorded under its own name so a
    test notices it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in torch._disable_dynamo by default, whose first call
        # imports torch._dynamo (seconds per rank). Nothing here runs under torch.compile.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        #: "comm" and "mm" in dispatch order, consecutive repeats merged: shows whether a
        #: transfer was issued before the matrix products it should hide behind.
        self.timeline: list[str] = []
        #: point-to-point operations in dispatch order: ``("send" | "recv", bytes)``.
        self.p2p: list[tuple[str, int]] = []

    def _mark(self, what: str) -> None:
        if not self.timeline or self.timeline[-1] != what:
            self.timeline.append(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("c10d."):
            kind = _COMM_OPS.get(name, name)
            self.counts[kind] += 1
            self._mark("comm")
            if kind in ("send", "recv"):
                self.p2p.append((kind, sum(t.numel() * t.element_size() for t in args[0])))
        elif name.startswith(("aten.mm.", "aten.bmm.")):
            self._mark("mm")
        return func(*args, **(kwargs or {}))
