"""Feed-forward block of the Qwen3.5-style dense decoder: SwiGLU.

Token-wise (a token's output reads only that token), so it runs unchanged on a context-parallel
sequence shard. The choice between SwiGLU and a mixture of experts is the model's
(``models.mlp.build_mlp``), not this floor's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``[..., hidden] -> [..., hidden]`` in x's dtype.

    Args:
        hidden_size: model width.
        intermediate_size: width of the gated hidden layer.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
