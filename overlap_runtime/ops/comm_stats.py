"""Per-call record of the communication a context-parallel attention call issued.

The caller creates one :class:`CommStats` per call and passes it in (``stats=``); the forward
records what it issues and stores the object in its autograd context, so the backward records
into the same object. Nothing is kept on modules or in globals: two calls in flight (two
microbatches) each have their own record.

Kinds recorded: ``send`` and ``recv`` (point-to-point, one per ``isend``/``irecv``),
``all_to_all`` and ``all_gather`` (one per collective), each under phase ``forward`` or
``backward``, with the bytes each moved (sent bytes for ``send``, received bytes for ``recv``,
the output size for collectives).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Phase = Literal["forward", "backward"]
CommKind = Literal["send", "recv", "all_to_all", "all_gather"]


@dataclass
class CommStats:
    """Counts and bytes of the communication one call issued, by ``(phase, kind)``."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    nbytes: Counter[tuple[str, str]] = field(default_factory=Counter)

    def record(self, phase: Phase, kind: CommKind, nbytes: int = 0, n: int = 1) -> None:
        """Add ``n`` operations of ``kind`` moving ``nbytes`` in total."""
        self.calls[(phase, kind)] += n
        self.nbytes[(phase, kind)] += nbytes

    def count(self, phase: Phase, kind: CommKind) -> int:
        """How many ``kind`` operations were issued in ``phase``."""
        return self.calls[(phase, kind)]

    def as_dict(self) -> dict[str, int]:
        """``{"forward/send": n, ...}`` for printing and JSON."""
        return {f"{p}/{k}": n for (p, k), n in sorted(self.calls.items())}


class _RecordBackward(torch.autograd.Function):
    """Identity whose backward records one collective; placed on a differentiable collective's
    output so that its backward collective (``ops.comm.collectives``) is counted when it runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stats: CommStats, kind: str, nbytes: int) -> torch.Tensor:
        ctx.stats, ctx.kind, ctx.nbytes = stats, kind, nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.stats.record("backward", ctx.kind, ctx.nbytes)
        return grad, None, None, None


def record_backward(x: torch.Tensor, stats: CommStats | None, kind: CommKind,
                    nbytes: int) -> torch.Tensor:
    """Return ``x``; when it needs a gradient, its backward records one ``kind`` collective."""
    if stats is None or not x.requires_grad:
        return x
    return _RecordBackward.apply(x, stats, kind, nbytes)
