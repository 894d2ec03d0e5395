"""The hand-built PP x EP job of tests/moe/test_moe_pp_ep.py (seed 001 OV-B01, OV-B06).

A small PP x EP model built by hand (not the trainer's Qwen3.5 hybrid): ``chunks`` chunks per
pipeline rank, each ``layers`` blocks of a mixer and a MoE with a shared expert, run by
Interleaved 1F1B once without ``overlap_b_f`` (baseline) and once with it and
``make_overlap_b_f_callback``, on the same weights and data; every gradient of the two runs is
compared per tensor. Until the demo became a training run (``overlap-runtime demo`` now trains
``configs/demo_pp2_ep2.yaml`` with the trainer) this was the demo's job, and the OV-B06 figure in
docs/benchmarks.md was measured with it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PPEPConfig:
    """Sizes of the PP x EP job (all ranks build the same model from it)."""

    pp: int = 2
    ep: int = 2
    chunks: int = 2
    layers: int = 2
    microbatches: int = 8
    tokens: int = 16
    hidden: int = 32
    experts: int = 4
    top_k: int = 2
    steps: int = 3
    lr: float = 0.05
    timeout_s: float = 120.0


def _worse(a: float, b: float) -> float:
    """The larger error; NaN (a non-finite value on either side) counts as infinitely bad."""
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return max(a, b)


def build_chunk(cfg: PPEPConfig, stage: int) -> Any:
    """Chunk ``stage`` of the model: ``cfg.layers`` blocks (mixer + MoE), seeded by stage."""
    import torch
    from torch import nn

    from overlap_runtime.moe import MoE

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.RMSNorm(cfg.hidden)
            self.mixer = nn.Linear(cfg.hidden, cfg.hidden)
            self.norm2 = nn.RMSNorm(cfg.hidden)
            self.moe = MoE(cfg.hidden, cfg.hidden, cfg.experts, cfg.top_k,
                           shared_ffn_hidden=cfg.hidden, aux_loss_coef=1e-2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + torch.tanh(self.mixer(self.norm1(x)))
            return x + self.moe(self.norm2(x))

    torch.manual_seed(1000 + stage)
    return nn.Sequential(*[Block() for _ in range(cfg.layers)])


def _data(cfg: PPEPConfig, step: int, ep_rank: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(7919 * step + 31 * ep_rank + 1)
    shape = (cfg.microbatches, cfg.tokens, cfg.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def predict_job(cfg: PPEPConfig, baseline_events: list[Any]) -> dict[str, Any]:
    """The job's all-to-all overlap as the task-graph simulator predicts it: the compiled step
    of a training config of the same layout (pp x ep, ``chunks`` stages per rank of ``layers``
    MoE layers, the same microbatches; ``tests/support/step_configs.py``) with and without
    ``overlap_b_f``, priced with the op costs measured in the baseline's trace."""
    import sys
    from pathlib import Path

    from tests.support.step_configs import moe_config

    from overlap_runtime.graph import chrome_trace
    from overlap_runtime.graph.comm_overlap import simulated_a2a_overlap
    from overlap_runtime.moe.step_costs import moe_op_seconds, op_costs_from_trace
    from overlap_runtime.stepgraph.compose import compile_step
    from overlap_runtime.stepgraph.pricing import predict_priced

    steps = {name: compile_step(moe_config(
        ep=cfg.ep, pp=cfg.pp, layers=cfg.pp * cfg.chunks * cfg.layers, overlap_b_f=on,
        microbatches=cfg.microbatches, virtual_stages=cfg.chunks))
        for name, on in (("baseline", False), ("overlap", True))}
    costs = op_costs_from_trace(baseline_events, {s: cfg.layers
                                                  for s in range(cfg.pp * cfg.chunks)})
    pred = {name: predict_priced(sg, moe_op_seconds(costs, sg)) for name, sg in steps.items()}
    ovl = pred["overlap"].result
    return {"predicted": simulated_a2a_overlap(ovl, paired_only=True).share,
            "predicted_step_s": pred["overlap"].step_s,
            "predicted_serial_step_s": pred["baseline"].step_s, "costs": costs.to_dict(),
            "sim_trace": chrome_trace(ovl, time_scale=1e6)}  # seconds -> microseconds


def pp_ep_main(rank: int, world: int, cfg: PPEPConfig) -> dict[str, Any]:
    """One rank of the job; returns its report (rank 0's includes the merged trace events)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
    from overlap_runtime.moe import OverlapExpertParallel, make_overlap_b_f_callback
    from overlap_runtime.trainer.a2a_overlap import trace_a2a_overlap
    from overlap_runtime.pipeline import (ExecutionTrace, PipelineStage, ScheduleInterleaved1F1B,
                                          TensorMeta, gather_traces)
    from overlap_runtime.schedules import ActionKind
    from overlap_runtime.testing import rel_l2

    if cfg.pp * cfg.ep != world:
        raise ValueError(f"pp {cfg.pp} x ep {cfg.ep} != {world} ranks")
    mesh = init_device_mesh("cpu", (cfg.pp, cfg.ep), mesh_dim_names=("pp", "ep"))
    pp_group, ep_group = mesh["pp"].get_group(), mesh["ep"].get_group()
    pp_rank, ep_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    num_stages = cfg.pp * cfg.chunks
    my_stages = [s for s in range(num_stages) if s % cfg.pp == pp_rank]  # loop placement

    coordinator = HookCoordinator(timeout_s=cfg.timeout_s, debug=True)
    overlap = CommComputeOverlap(coordinator, "cpu")
    trace = ExecutionTrace()
    chunks = {}
    for s in my_stages:
        chunk = build_chunk(cfg, s)
        OverlapExpertParallel(coordinator, tag_prefix=f"S{s}.", trace=trace,
                              timeout_s=cfg.timeout_s).apply(chunk, mesh["ep"])
        chunks[s] = chunk
    meta = TensorMeta((1, cfg.tokens, cfg.hidden), torch.float32)
    stages = [PipelineStage(chunks[s], s, num_stages, "cpu", pp_group,
                            input_meta=meta if s > 0 else None) for s in my_stages]
    for st in stages:  # every boundary is [1, tokens, hidden] fp32: no metadata exchange
        if not st.is_last:
            st.output_meta = meta
    params = [(f"S{s}.{n}", p) for s in my_stages for n, p in chunks[s].named_parameters()]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target)

    common = dict(loss_fn=loss_fn, overlap_p2p=True, group=pp_group, timeout_s=cfg.timeout_s)
    base = ScheduleInterleaved1F1B(stages, cfg.microbatches, overlap_b_f=False, **common)
    ovl = ScheduleInterleaved1F1B(stages, cfg.microbatches, overlap_b_f=True, **common)
    ovl.register_custom_function(ActionKind.OVERLAP_B_F, make_overlap_b_f_callback(overlap, "cpu"))
    has_first, has_last = 0 in my_stages, (num_stages - 1) in my_stages

    errs: dict[str, float] = {}
    steps: list[dict[str, Any]] = []
    base_events: list[Any] = []
    ovl_events: list[Any] = []
    for step in range(cfg.steps):
        x, y = _data(cfg, step, ep_rank)
        runs = {}
        for name, sched in (("baseline", base), ("overlap", ovl)):
            for _, p in params:
                p.grad = None
            trace.events.clear()
            losses: list[torch.Tensor] = []
            dist.barrier()
            t0 = time.perf_counter()
            sched.step(*((x,) if has_first else ()), target=y if has_last else None,
                       losses=losses, trace=trace)
            wall = time.perf_counter() - t0
            runs[name] = {"grads": {n: p.grad.detach().clone() for n, p in params},
                          "loss": float(torch.stack(losses).mean()) if losses else None,
                          "wall_s": wall, "events": [dataclasses.replace(e, rank=rank)
                                                      for e in trace.events]}
        for n, g in runs["overlap"]["grads"].items():
            errs[n] = _worse(errs.get(n, 0.0), rel_l2(g, runs["baseline"]["grads"][n]))
        if has_last:
            lb, lo = runs["baseline"]["loss"], runs["overlap"]["loss"]
            errs["loss"] = _worse(errs.get("loss", 0.0), abs(lo - lb) / max(abs(lb), 1e-30))
        steps.append({k: {"loss": v["loss"], "wall_s": v["wall_s"]} for k, v in runs.items()})
        base_events, ovl_events = runs["baseline"]["events"], runs["overlap"]["events"]
        with torch.no_grad():  # one SGD step from the (identical) overlapped gradients
            for _, p in params:
                p.add_(p.grad, alpha=-cfg.lr)

    launches = coordinator.serializer.check_launch_order(ep_group)
    overlap.close()
    gathered: dict[str, list[Any]] = {}
    for name, evs in (("baseline", base_events), ("overlap", ovl_events)):
        t = ExecutionTrace(rank=rank, events=evs)
        gathered[name] = gather_traces(t, None, cfg.timeout_s)
    measured = trace_a2a_overlap(gathered["overlap"], paired_only=True).to_dict(1e-9)
    measured_all = trace_a2a_overlap(gathered["overlap"]).to_dict(1e-9)
    predicted = predict_job(cfg, gathered["baseline"])
    paired = sum(1 for a in ovl.program if a.kind is ActionKind.OVERLAP_B_F)
    report = {"rank": rank, "pp_rank": pp_rank, "ep_rank": ep_rank, "errs": errs,
              "steps": steps, "launches": launches, "paired_steps": paired,
              "measured": measured, "measured_all": measured_all, "has_last": has_last,
              **{k: v for k, v in predicted.items() if k != "sim_trace"}}
    if rank == 0:
        report["events"] = gathered["overlap"]
        report["sim_trace"] = predicted["sim_trace"]
    dist.barrier()
    return report
