"""The HookCoordinator's sync hooks (A/B/C/D/D_LAST) in a MoE block you write yourself.

What it shows:
  * a user's MoE block (top-1 router, experts split over the expert-parallel ranks) whose token
    dispatch and combine are all-to-alls issued through ``coordinator.serializer``, between the
    hooks A..B (dispatch) and C..D (combine); the last MoE block of the chunk uses D_LAST;
  * ``CommComputeOverlap.run(forward_fn, backward_fn)``: the forward of microbatch k+1 (this
    thread) beside the backward of microbatch k (a worker thread); the coordinator hands the comm
    token back and forth so that one thread's all-to-all is in flight while the other computes,
    at most one all-to-all per group at a time, in the same order on every rank;
  * ``serializer.check_launch_order(group)``: every rank launched the same all-to-alls in the
    same order;
  * the check: every output and every gradient against one process holding all experts
    (rel-L2, fp32, must be <= 1e-5).

Run (CPU, gloo; 2 or 4 ranks, NUM_EXPERTS must divide by the rank count):
  torchrun --nproc-per-node 2 examples/moe_hook_coordinator.py

Prints (rank 0; numbers vary in the last digits):
  all-to-alls launched in the same order on every rank: 40
  CHECK moe_hook_coordinator: max rel-L2 1.4e-07 <= 1e-05 (4 outputs, 10 gradients): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator, sync_hook
from overlap_runtime.launch import init_from_env

HIDDEN = 16
FFN = 32
NUM_EXPERTS = 4
NUM_LAYERS = 2
TOKENS = 8  # per rank and microbatch
MICROBATCHES = 4
TOL = 1e-5


class ToyMoEBlock(nn.Module):
    """``h = x + tanh(mix(x))``, then ``h + gate * expert_e(h)`` with ``e`` the top-1 expert.

    Shapes: x ``[N, HIDDEN]`` fp32 -> ``[N, HIDDEN]``. Experts ``first_expert ..
    first_expert + local_experts - 1`` live here; with ``coordinator`` None the block is the
    single-process reference (all experts local, no communication).
    """

    def __init__(self, layer: int, last: bool, first_expert: int, local_experts: int,
                 coordinator: HookCoordinator | None, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        torch.manual_seed(100 + layer)  # the same full weights everywhere; keep our experts
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.router = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        w1 = torch.randn(NUM_EXPERTS, HIDDEN, FFN) / HIDDEN ** 0.5
        w2 = torch.randn(NUM_EXPERTS, FFN, HIDDEN) / FFN ** 0.5
        keep = slice(first_expert, first_expert + local_experts)
        self.w1 = nn.Parameter(w1[keep].clone())
        self.w2 = nn.Parameter(w2[keep].clone())
        self.layer, self.last, self.local_experts = layer, last, local_experts
        self.coordinator, self.group = coordinator, group

    def _experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """rows ``[M, HIDDEN]``, expert ``[M]`` (local index) -> ``[M, HIDDEN]``."""
        out = torch.zeros_like(rows)
        for e in range(self.local_experts):
            idx = (expert == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, torch.relu(rows[idx] @ self.w1[e]) @ self.w2[e])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.mix(x))
        probs = torch.softmax(self.router(h), dim=-1)
        gate, top = probs.max(dim=-1)  # [N], [N]
        if self.coordinator is None:
            return h + gate[:, None] * self._experts(h, top)
        coord, tag, i = self.coordinator, f"L{self.layer}", self.layer
        world = dist.get_world_size(self.group)
        order = torch.argsort(top, stable=True)  # rows grouped by expert, hence by rank
        counts = torch.bincount(top, minlength=NUM_EXPERTS)  # [E] what I send to each expert
        send = sync_hook(h[order], "A", coord, i)  # ---- comm region: dispatch
        recv_counts = coord.serializer.all_to_all_single(counts, group=self.group,
                                                         tag=f"{tag}.counts")
        in_splits = counts.view(world, -1).sum(1).tolist()
        out_splits = recv_counts.view(world, -1).sum(1).tolist()
        recv = coord.serializer.all_to_all_single(send, out_splits, in_splits, self.group,
                                                  tag=f"{tag}.dispatch")
        recv = sync_hook(recv, "B", coord, i)  # ---- compute region: experts
        local_expert = torch.arange(self.local_experts).repeat(world).repeat_interleave(
            recv_counts)
        y = sync_hook(self._experts(recv, local_expert), "C", coord, i)  # ---- comm: combine
        back = coord.serializer.all_to_all_single(y, in_splits, out_splits, self.group,
                                                  tag=f"{tag}.combine")
        back = sync_hook(back, "D_LAST" if self.last else "D", coord, i)  # ---- compute
        moe_out = torch.zeros_like(h).index_copy(0, order, back)
        return h + gate[:, None] * moe_out


def build_chunk(rank: int, world: int, coordinator: HookCoordinator | None,
                group: dist.ProcessGroup | None) -> nn.Sequential:
    local = NUM_EXPERTS // world if coordinator is not None else NUM_EXPERTS
    first = rank * local if coordinator is not None else 0
    return nn.Sequential(*[ToyMoEBlock(i, i == NUM_LAYERS - 1, first, local, coordinator, group)
                           for i in range(NUM_LAYERS)])


def microbatch(rank: int, mb: int) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1000 * rank + mb))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def main() -> int:
    rc = init_from_env("cpu")
    rank, world = rc.rank, rc.world_size
    if NUM_EXPERTS % world:
        raise ValueError(f"NUM_EXPERTS={NUM_EXPERTS} is not a multiple of the {world} ranks")
    ep_group = dist.new_group(list(range(world)))  # the expert-parallel group: every rank here
    coord = HookCoordinator(timeout_s=60, debug=True)  # debug: keep the launch log
    chunk = build_chunk(rank, world, coord, ep_group)

    # Microbatch k's forward runs beside microbatch k-1's backward (one run each; the first run
    # has no backward yet, the last one no forward).
    outputs: list[torch.Tensor] = []
    with CommComputeOverlap(coord, "cpu") as overlap:
        pending_loss: torch.Tensor | None = None
        for mb in range(MICROBATCHES + 1):
            x = microbatch(rank, mb) if mb < MICROBATCHES else None
            fwd = (lambda x=x: chunk(x)) if x is not None else (lambda: None)
            bwd = pending_loss.backward if pending_loss is not None else (lambda: None)
            out, _ = overlap.run(fwd, bwd)
            pending_loss = None
            if out is not None:
                outputs.append(out.detach())
                pending_loss = (out ** 2).mean()
    launched = coord.serializer.check_launch_order(ep_group)  # raises on any difference

    # Reference: one process, all experts, every rank's microbatches, the same losses summed.
    ref = build_chunk(0, 1, None, None)
    ref_outputs = {}
    for r in range(world):
        for mb in range(MICROBATCHES):
            out = ref(microbatch(r, mb))
            (out ** 2).mean().backward()
            ref_outputs[r, mb] = out.detach()
    errs = {f"out{mb}": rel_l2(o, ref_outputs[rank, mb]) for mb, o in enumerate(outputs)}
    local = NUM_EXPERTS // world
    for (name, p), (_, q) in zip(chunk.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        if name.endswith(("w1", "w2")):  # expert: all its tokens came here
            want = q.grad[rank * local:(rank + 1) * local]
        else:  # replicated: each rank holds the gradient of its own tokens
            dist.all_reduce(grad)
            want = q.grad
        errs[name] = rel_l2(grad, want)

    worst = torch.tensor(max(errs.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = float(worst) <= TOL
    if rank == 0:
        print(f"all-to-alls launched in the same order on every rank: {launched}")
        n_grads = sum(1 for _ in chunk.parameters())
        print(f"CHECK moe_hook_coordinator: max rel-L2 {float(worst):.1e} <= {TOL:g} "
              f"({len(outputs)} outputs, {n_grads} gradients): {'OK' if ok else 'FAIL'}",
              flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
