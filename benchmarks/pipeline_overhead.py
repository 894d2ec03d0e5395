"""The pipeline runtime's own cost per action: no-op stages on CPU ranks (gloo).

Each stage multiplies a [mb, 1] activation by a 1-element weight. With one rank the runtime's
own cost per action is the step time minus the same forwards and backwards called directly in a
plain loop ("bare"), divided by the actions executed: program walk, context bookkeeping, stage
state, loss scaling. With several ranks the step time per action also holds gloo point-to-point
latency and the waits of the schedule's dependencies (max over ranks).

    .venv/bin/python -m benchmarks.pipeline_overhead --ranks 2 --microbatches 32 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


class NoOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _rank(rank: int, world: int, kind: str, m: int, steps: int, virtual: int, overlap: bool) -> dict:
    from overlap_runtime.ops.comm import all_gather
    from overlap_runtime.pipeline import PipelineSchedule, PipelineStage
    from overlap_runtime.schedules import ScheduleSpec

    spec = ScheduleSpec(kind=kind, pp_size=world, num_microbatches=m, virtual_stages=virtual,
                        overlap_p2p=overlap)
    stages = [PipelineStage(NoOp(), s, spec.num_stages) for s in range(spec.num_stages)
              if spec.stage_to_rank(s) == rank]
    sched = PipelineSchedule(spec, stages, lambda out, tgt: out.sum())
    x, y = torch.ones(m, 1), torch.zeros(m, 1)
    mods = [st.module for st in sorted(stages, key=lambda s: s.stage_index)]

    def bare_step() -> None:  # the same module calls without the runtime (one rank only)
        for mb in x.chunk(m):
            outs, h = [], mb
            for mod in mods:
                h = mod(h.detach().requires_grad_(True))
                outs.append(h)
            torch.autograd.backward(outs[-1].sum() * (1.0 / m))

    times, bare = [], []
    for i in range(steps + 3):  # interleaved, so both see the same machine load
        all_gather(torch.zeros(1))  # align ranks
        t0 = time.perf_counter()
        sched.step(x, target=y)
        t1 = time.perf_counter()
        if world == 1:
            bare_step()
        t2 = time.perf_counter()
        if i >= 3:
            times.append(t1 - t0)
            bare.append(t2 - t1)
    n_actions = len(sched.program)
    per_action = statistics.median(times) / n_actions
    worst = all_gather(torch.tensor([per_action], dtype=torch.float64)).max().item()
    bare_ms = statistics.median(bare) * 1e3 if world == 1 else float("nan")
    return {"per_action_us": worst * 1e6, "actions": n_actions,
            "step_ms": statistics.median(times) * 1e3, "bare_ms": bare_ms}


def main() -> None:
    from overlap_runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for kind, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for overlap in (False, True):
            res = spawn(_rank, args.ranks, args=(kind, args.microbatches, args.steps, virtual, overlap))
            rows.append((kind, virtual, overlap, res[0]["actions"], res[0]["step_ms"],
                         res[0]["per_action_us"], res[0]["bare_ms"]))
    print("| schedule | virtual | overlap_p2p | actions/rank | step ms (median) | us/action "
          "(max over ranks) | bare ms | runtime us/action |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, v, ov, n, ms, us, bare in rows:
        own = (ms - bare) * 1e3 / n if bare == bare else float("nan")
        bare_txt = f"{bare:.2f}" if bare == bare else "-"
        own_txt = f"{own:.1f}" if own == own else "-"
        print(f"| {kind} | {v} | {ov} | {n} | {ms:.2f} | {us:.1f} | {bare_txt} | {own_txt} |")


if __name__ == "__main__":
    main()
