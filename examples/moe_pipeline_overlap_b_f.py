"""The library's MoE layer on PP x EP with OVERLAP_B_F: all-to-alls hidden behind compute.

What it shows:
  * a user's pipeline chunks whose blocks hold ``overlap_runtime.moe.MoE`` layers (router,
    experts, shared expert), on a 2 x 2 ``DeviceMesh`` ("pp", "ep"): 2 pipeline ranks, each
    with 2 chunks (Interleaved 1F1B, loop placement), experts split over the 2 EP ranks;
  * ``OverlapExpertParallel(coordinator).apply(chunk, mesh["ep"])``: each MoE layer keeps its
    EP rank's experts and gets the A/B/C/D/D_LAST sync hooks around its all-to-alls;
  * ``make_overlap_b_f_callback(overlap)`` registered for ``OVERLAP_B_F``: in each compound step
    the forward chunk runs here and the backward chunk on the ``CommComputeOverlap`` worker, the
    coordinator alternating their all-to-alls (``check_launch_order``: same order everywhere);
  * the check: the loss and every gradient against one process running all chunks with all
    experts on each EP rank's batch (rel-L2, fp32, must be <= 1e-5). Every token goes to every
    expert (top-k = number of experts) so no routing tie can flip between the two runs.

Run (CPU, gloo; exactly 4 ranks):
  torchrun --nproc-per-node 4 examples/moe_pipeline_overlap_b_f.py

Prints (rank 0; numbers vary in the last digits):
  OVERLAP_B_F steps per rank: 3, 3, 5, 5; all-to-alls in the same order per EP group: 86, 92
  CHECK moe_pipeline_overlap_b_f: max rel-L2 1.2e-07 <= 1e-05 (loss and 88 gradients): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.launch import init_from_env
from overlap_runtime.moe import MoE, OverlapExpertParallel, make_overlap_b_f_callback
from overlap_runtime.pipeline import PipelineStage, ScheduleInterleaved1F1B
from overlap_runtime.schedules import ActionKind

PP, EP, CHUNKS_PER_RANK = 2, 2, 2
HIDDEN, EXPERTS, TOKENS, MICROBATCHES = 16, 4, 8, 4
TOL = 1e-5


class Block(nn.Module):
    """``h = x + tanh(mix(norm1(x)))``; ``h + moe(norm2(h))``. x ``[1, TOKENS, HIDDEN]`` fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, 2 * HIDDEN, EXPERTS, top_k=EXPERTS, shared_ffn_hidden=HIDDEN,
                       aux_loss_coef=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.mix(self.norm1(x)))
        return h + self.moe(self.norm2(h))


def build_chunk(stage: int) -> nn.Sequential:
    torch.manual_seed(1000 + stage)  # the same weights on every rank and in the reference
    return nn.Sequential(Block(), Block())


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def batch(ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each EP rank trains on its own batch ``[MICROBATCHES, TOKENS, HIDDEN]``."""
    g = torch.Generator().manual_seed(10 + ep_rank)
    shape = (MICROBATCHES, TOKENS, HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def main() -> int:
    rc = init_from_env("cpu")
    if rc.world_size != PP * EP:
        raise ValueError(f"needs {PP * EP} ranks (pp {PP} x ep {EP}), got {rc.world_size}")
    mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    pp_rank, ep_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    ep_group = mesh["ep"].get_group()
    num_stages = PP * CHUNKS_PER_RANK
    my_stages = list(range(pp_rank, num_stages, PP))  # loop placement

    coordinator = HookCoordinator(timeout_s=60, debug=True)  # debug: keep the launch log
    overlap = CommComputeOverlap(coordinator, "cpu")
    chunks = {s: build_chunk(s) for s in my_stages}
    for s, chunk in chunks.items():
        OverlapExpertParallel(coordinator, tag_prefix=f"S{s}.").apply(chunk, mesh["ep"])
    stages = [PipelineStage(chunks[s], s, num_stages, group=mesh["pp"].get_group())
              for s in my_stages]
    schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn, overlap_b_f=True,
                                       group=mesh["pp"].get_group(), timeout_s=60)
    schedule.register_custom_function(ActionKind.OVERLAP_B_F,
                                      make_overlap_b_f_callback(overlap, "cpu"))
    x, y = batch(ep_rank)
    losses: list[torch.Tensor] = []
    schedule.step(*((x,) if 0 in my_stages else ()),
                  target=y if num_stages - 1 in my_stages else None, losses=losses)
    overlap.close()
    launched = coordinator.serializer.check_launch_order(ep_group)  # raises on a difference

    # Reference: one process, every chunk with all its experts, each EP rank's batch in turn,
    # microbatch by microbatch (the pipeline's loss is the mean over microbatches).
    reference = nn.Sequential(*[build_chunk(s) for s in range(num_stages)])
    ref_losses = {}
    for r in range(EP):
        xr, yr = batch(r)
        for m in range(MICROBATCHES):
            loss = loss_fn(reference(xr[m:m + 1]), yr[m:m + 1])
            (loss / MICROBATCHES).backward()
            ref_losses[r, m] = loss.detach()
    errs: dict[str, float] = {}
    local = EXPERTS // EP
    for s in my_stages:
        for (name, p), (_, q) in zip(chunks[s].named_parameters(),
                                     reference[s].named_parameters()):
            grad = p.grad.clone()
            if ".experts." in f".{name}":  # this EP rank's experts saw every rank's tokens
                want = q.grad[ep_rank * local:(ep_rank + 1) * local]
            else:  # replicated over EP: each rank holds the gradient of its own batch
                dist.all_reduce(grad, group=ep_group)
                want = q.grad
            errs[f"S{s}.{name}"] = rel_l2(grad, want)
    if losses:
        want_loss = torch.stack([ref_losses[ep_rank, m] for m in range(MICROBATCHES)]).mean()
        errs["loss"] = rel_l2(torch.stack(losses).mean(), want_loss)

    paired = sum(a.kind is ActionKind.OVERLAP_B_F for a in schedule.program)
    mine = torch.tensor([max(errs.values()), len(errs), paired, launched], dtype=torch.float64)
    table = [torch.zeros_like(mine) for _ in range(rc.world_size)]
    dist.all_gather(table, mine)
    worst = max(float(t[0]) for t in table)
    ok = worst <= TOL and all(int(t[2]) > 0 for t in table)
    if rc.rank == 0:
        n_grads = sum(int(t[1]) for t in table) // EP - 1  # each parameter on EP ranks, 1 loss
        launches = sorted({int(t[3]) for t in table})
        print("OVERLAP_B_F steps per rank: " + ", ".join(str(int(t[2])) for t in table)
              + "; all-to-alls in the same order per EP group: "
              + ", ".join(str(n) for n in launches))
        print(f"CHECK moe_pipeline_overlap_b_f: max rel-L2 {worst:.1e} <= {TOL:g} (loss and "
              f"{n_grads} gradients): {'OK' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
