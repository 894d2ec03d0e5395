"""Deferred weight gradients (W tasks) with the DualPipeV schedule, against one process.

What it shows:
  * a user's model whose linear layers are ``DeferredLinear``s sharing this rank's
    ``DeferredWQueue``: during a deferred backward they return dX at once and push a W task
    (dW = dY^T x, db) to the queue instead of computing it;
  * ``PipelineSchedule(ScheduleSpec(kind="dualpipev", ...))``: 2 ranks x 2 virtual stages placed
    in a V (rank 0 holds the first and the last stage), whose steady state pairs forward and
    backward chunks in ``OVERLAP_F_B`` steps;
  * ``FlushWhileWaiting(queue, defer_backward=True)`` registered for ``OVERLAP_F_B``: the full
    backwards of compound steps defer their dW, and pending W tasks run while a receive is still
    in flight (reason "window"); the rest run at the program's own W actions ("action") or in
    the drain at the end of the step ("drain"). ``queue.listeners`` tells where each one ran;
  * the check: the loss and every parameter gradient, over two steps, against one process
    running the same model on the whole batch (rel-L2, fp32, must be <= 1e-5), and no W task
    left pending after a step.

Run (CPU, gloo; 2 or 4 ranks):
  torchrun --nproc-per-node 2 examples/dualpipev_deferred_w.py

Prints (rank 0; the split between reasons depends on timing):
  rank 0 program: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B ... 0I7 0W7
  W tasks (one per DeferredLinear and microbatch) over 2 steps, window/action/drain:
    rank 0: 40/12/4, rank 1: 36/8/8
  CHECK dualpipev_deferred_w: max rel-L2 1.2e-07 <= 1e-05 (2 steps, loss and 20 gradients): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.launch import init_from_env
from overlap_runtime.pipeline import (DeferredLinear, DeferredWQueue, FlushWhileWaiting,
                                      PipelineSchedule, PipelineStage)
from overlap_runtime.schedules import ActionKind, ScheduleSpec

HIDDEN = 16
MICROBATCHES = 8
BATCH = 2 * MICROBATCHES
STEPS = 2
TOL = 1e-5
P2P = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)


class Block(nn.Module):
    """``x + gain * tanh(W2 gelu(W1 x))``, x ``[N, HIDDEN]`` fp32. ``gain`` belongs to no deferred
    layer: its gradient comes from the backward walk itself, W1's and W2's from the W tasks."""

    def __init__(self, queue: DeferredWQueue) -> None:
        super().__init__()
        self.up = DeferredLinear(HIDDEN, 2 * HIDDEN, queue=queue)
        self.down = DeferredLinear(2 * HIDDEN, HIDDEN, queue=queue)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * torch.tanh(self.down(nn.functional.gelu(self.up(x))))


def build_model(num_stages: int, queue: DeferredWQueue) -> nn.Sequential:
    torch.manual_seed(0)  # identical weights on every rank and in the reference
    return nn.Sequential(*[Block(queue) for _ in range(num_stages)])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def main() -> int:
    rc = init_from_env("cpu")
    rank, world = rc.rank, rc.world_size
    spec = ScheduleSpec(kind="dualpipev", pp_size=world, num_microbatches=MICROBATCHES,
                        virtual_stages=2, placement="v")
    queue = DeferredWQueue(f"rank {rank}")  # one per rank, handed to its layers
    model = build_model(spec.num_stages, queue)
    stages = [PipelineStage(model[s], s, spec.num_stages)  # finds the queue of its layers
              for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank]
    schedule = PipelineSchedule(spec, stages, loss_fn, timeout_s=60)
    schedule.register_custom_function(ActionKind.OVERLAP_F_B,
                                      FlushWhileWaiting(queue, defer_backward=True))
    reasons: Counter[str] = Counter()
    queue.listeners.append(lambda run: reasons.update([run.reason]))

    # The reference never captures, so its DeferredLinears behave as nn.Linear.
    reference = build_model(spec.num_stages, DeferredWQueue("reference"))
    has_first = spec.stage_to_rank(0) == rank
    has_last = spec.stage_to_rank(spec.num_stages - 1) == rank
    errs: dict[str, float] = {}
    pending_after_step = 0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if has_first else ()), target=y if has_last else None,
                      losses=losses)
        pending_after_step += queue.pending()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        for st in stages:
            for (name, p), (_, q) in zip(model[st.stage_index].named_parameters(),
                                         reference[st.stage_index].named_parameters()):
                errs[f"step{step}.stage{st.stage_index}.{name}"] = rel_l2(p.grad, q.grad)
        if losses:
            errs[f"step{step}.loss"] = rel_l2(torch.stack(losses).mean(), ref_loss.detach())
        with torch.no_grad():  # a plain SGD step on both, so step 2 starts from new weights
            for p, q in zip(model.parameters(), reference.parameters()):
                q -= 0.1 * q.grad
                if p.grad is not None:  # the stages of this rank
                    p -= 0.1 * p.grad

    mine = torch.tensor([max(errs.values()), len(errs), pending_after_step, reasons["window"],
                         reasons["action"], reasons["drain"]], dtype=torch.float64)
    table = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(table, mine)
    worst = max(float(t[0]) for t in table)
    ok = worst <= TOL and all(int(t[2]) == 0 for t in table)
    if rank == 0:
        print("rank 0 program:", " ".join(str(a) for a in schedule.program if a.kind not in P2P))
        print(f"W tasks (one per DeferredLinear and microbatch) over {STEPS} steps, "
              "window/action/drain:\n    " + ", ".join(
            f"rank {r}: {int(t[3])}/{int(t[4])}/{int(t[5])}" for r, t in enumerate(table)))
        n_grads = sum(int(t[1]) for t in table) // STEPS - 1
        print(f"CHECK dualpipev_deferred_w: max rel-L2 {worst:.1e} <= {TOL:g} ({STEPS} steps, "
              f"loss and {n_grads} gradients): {'OK' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
