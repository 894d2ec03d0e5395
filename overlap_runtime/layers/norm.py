"""Norms of the Qwen3.5-style layers: RMSNorm (pre-norms, final norm, q/k head norms) and the
Gated DeltaNet output norm RMSNormGated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "RMSNormGated"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32.

    Args:
        dim: size of the normalised (last) dim.
        eps: added to the mean square.

    ``forward(x [..., dim] any float dtype) -> [..., dim]`` in x's dtype; the statistics are taken
    in fp32 (float64 stays float64) so bf16 activations keep a stable normaliser.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        compute = torch.promote_types(dtype, torch.float32)
        xc = x.to(compute)
        xc = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight.to(compute) * xc).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RMSNormGated(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim, computed in fp32 (or float64).

    x, gate: ``[..., D]`` any float dtype; returns x's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        compute = torch.promote_types(dtype, torch.float32)  # fp32, float64 stays float64
        xc = x.to(compute)
        xc = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out = self.weight.to(compute) * xc * F.silu(gate.to(compute))
        return out.to(dtype)
