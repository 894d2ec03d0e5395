"""The toy pipeline of the runtime tests: ``HIDDEN``-wide tanh residual blocks, one per stage,
a fixed batch and an MSE loss; ``make_schedule`` builds a rank's stages and its
``PipelineSchedule`` for a schedule kind (call it inside a rank of ``run_ranks``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.pipeline import PipelineSchedule, PipelineStage
from overlap_runtime.schedules import ScheduleSpec

HIDDEN = 8
BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


def toy_model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(HIDDEN) for _ in range(num_stages)])


def toy_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)


def toy_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def toy_reference(num_stages: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The single-process reference: the model after one backward, the loss and the output."""
    model = toy_model(num_stages)
    x, y = toy_data()
    out = model(x)
    loss = toy_loss(out, y)
    loss.backward()
    return model, loss.detach(), out.detach()


def make_schedule(kind: str, world: int, virtual: int, m: int, overlap_p2p: bool,
                  overlap_b_f: bool = False, timeout_s: float = 60.0
                  ) -> tuple[PipelineSchedule, nn.Sequential, list[PipelineStage]]:
    """This rank's schedule of ``world * virtual`` toy stages (``m`` microbatches), the whole
    model (every rank builds it from the same seed) and the rank's stages."""
    num_stages = world * virtual
    model = toy_model(num_stages)
    spec = ScheduleSpec(kind=kind, pp_size=world, num_microbatches=m, virtual_stages=virtual,
                        overlap_p2p=overlap_p2p, overlap_b_f=overlap_b_f)
    rank = dist.get_rank()
    stages = [PipelineStage(model[s], s, num_stages)
              for s in range(num_stages) if spec.stage_to_rank(s) == rank]
    return PipelineSchedule(spec, stages, toy_loss, timeout_s=timeout_s), model, stages
