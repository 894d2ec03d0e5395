"""Your own model through Interleaved 1F1B, with an OVERLAP_B_F callback of your own.

What it shows:
  * a user's ``nn.Module`` (four residual MLP chunks) cut into pipeline stages: 2 ranks x 2
    virtual stages, loop placement (stage ``s`` lives on rank ``s % world``);
  * ``ScheduleInterleaved1F1B(..., overlap_b_f=True)``: the steady state pairs the backward of one
    microbatch with the forward of another in one ``(sB_i;s'F_j)OVERLAP_B_F`` step;
  * ``schedule.register_custom_function(ActionKind.OVERLAP_B_F, callback)``: the callback runs the
    backward sub-action on a worker thread while the forward sub-action runs here (the shape of a
    comm/compute overlap), through the public ``ActionContext`` (``ctx.run``), every wait bounded;
  * the check: the loss and every parameter gradient against one process running the whole
    model on the whole batch (rel-L2, fp32, must be <= 1e-5).

Run (CPU, gloo):
  torchrun --nproc-per-node 2 examples/pipeline_interleaved_overlap.py

Prints (rank 0; numbers vary in the last digits):
  schedule of rank 0: 0F0 0F1 2F0 2F1 0F2 (2B0;0F3)OVERLAP_B_F (2B1;2F2)OVERLAP_B_F ... 0B3
  OVERLAP_B_F steps run by the callback: 3 (rank 0), 5 (rank 1)
  CHECK pipeline_interleaved_overlap: max rel-L2 1.1e-07 <= 1e-05 (loss and 24 gradients): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import sys
import threading
import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.launch import init_from_env
from overlap_runtime.pipeline import ActionContext, PipelineStage, ScheduleInterleaved1F1B
from overlap_runtime.schedules import Action, ActionKind

HIDDEN = 16
BATCH = 8
MICROBATCHES = 4
VIRTUAL_STAGES = 2
TOL = 1e-5
JOIN_TIMEOUT_S = 60.0


class ResidualMLP(nn.Module):
    """One chunk of the user's model: ``x + W2 gelu(W1 norm(x))``, x ``[N, HIDDEN]`` fp32."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build_model(num_chunks: int) -> nn.Sequential:
    torch.manual_seed(0)  # identical weights on every rank and in the reference
    return nn.Sequential(*[ResidualMLP(HIDDEN) for _ in range(num_chunks)])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


class ThreadedOverlapBF:
    """OVERLAP_B_F callback: backward sub-action on a worker thread, forward sub-action here.

    ``ctx.run`` may be called from another thread; an exception on either side is re-raised here,
    and the worker is joined with a timeout (a stuck worker is an error, never a hang).
    """

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, action: Action, ctx: ActionContext) -> None:
        fwd = next(a for a in action.sub_actions if a.kind is ActionKind.F)
        bwd = next(a for a in action.sub_actions if a.kind is not ActionKind.F)
        errors: list[BaseException] = []

        def backward() -> None:
            try:
                ctx.run(bwd)
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                errors.append(exc)

        worker = threading.Thread(target=backward, name="bwd-worker", daemon=True)
        with ctx.span(str(action), "compound"):
            worker.start()
            ctx.run(fwd)
            worker.join(JOIN_TIMEOUT_S)
        if worker.is_alive():
            raise TimeoutError(f"{action}: backward worker still running after {JOIN_TIMEOUT_S} s")
        if errors:
            raise errors[0]
        self.calls += 1


def main() -> int:
    rc = init_from_env("cpu")
    rank, world = rc.rank, rc.world_size
    num_stages = world * VIRTUAL_STAGES
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)

    # The pipeline: this rank keeps the chunks of its stages (loop placement).
    model = build_model(num_stages)
    stages = [PipelineStage(model[s], s, num_stages) for s in range(rank, num_stages, world)]
    schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn, overlap_b_f=True,
                                       timeout_s=60)
    callback = ThreadedOverlapBF()
    schedule.register_custom_function(ActionKind.OVERLAP_B_F, callback)
    losses: list[torch.Tensor] = []
    schedule.step(*((x,) if rank == 0 else ()),
                  target=y if (num_stages - 1) % world == rank else None, losses=losses)

    # The reference: one process, the whole model, the whole batch (mean of equal microbatches).
    ref = build_model(num_stages)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    errs: dict[str, float] = {}
    for st in stages:
        for (name, p), (_, q) in zip(model[st.stage_index].named_parameters(),
                                     ref[st.stage_index].named_parameters()):
            errs[f"stage{st.stage_index}.{name}"] = rel_l2(p.grad, q.grad)
    if losses:
        errs["loss"] = rel_l2(torch.stack(losses).mean(), ref_loss.detach())

    # Every rank learns every rank's worst error and callback count, so all exit alike.
    mine = torch.tensor([max(errs.values()), len(errs), callback.calls,
                         sum(a.kind is ActionKind.OVERLAP_B_F for a in schedule.program)],
                        dtype=torch.float64)
    report = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(report, mine)
    worst = max(float(r[0]) for r in report)
    checked = int(sum(int(r[1]) for r in report))
    ok = worst <= TOL and all(int(r[2]) == int(r[3]) > 0 for r in report)
    if rank == 0:
        p2p = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
        print("schedule of rank 0:",
              " ".join(str(a) for a in schedule.program if a.kind not in p2p))
        print("OVERLAP_B_F steps run by the callback: "
              + ", ".join(f"{int(r[2])} (rank {i})" for i, r in enumerate(report)))
        verdict = "OK" if ok else "FAIL"
        print(f"CHECK pipeline_interleaved_overlap: max rel-L2 {worst:.1e} <= {TOL:g} "
              f"(loss and {checked - 1} gradients): {verdict}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
