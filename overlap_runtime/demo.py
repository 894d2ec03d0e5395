"""``overlap-runtime demo``: PP x EP Interleaved 1F1B with OVERLAP_B_F on CPU ranks (gloo).

The main job, end to end, on ``pp * ep`` ranks this process spawns (default 2 x 2 = 4):

* a small MoE model: ``pp * chunks`` pipeline stages, each a chunk of ``layers`` blocks
  ``x + tanh(Linear(x))`` then ``x + MoE(x)`` (top-k router with aux loss, SwiGLU experts
  sharded over the EP group, a shared expert overlapped with the combine);
* a 2-D device mesh ``("pp", "ep")``: the pipeline runs over the ``pp`` dim, the all-to-alls over
  ``ep``; each EP rank's pipeline gets its own data;
* every step runs twice from the same weights: ``ScheduleInterleaved1F1B`` without
  ``overlap_b_f`` (the baseline), then with it and the OVERLAP_B_F callback, where the backward
  of microbatch i (worker thread) and the forward of microbatch i+1 (caller thread) hand the
  EP all-to-alls back and forth through the HookCoordinator. Loss and every gradient must match;
  then one SGD update;
* after the last step: the launch-order check on every EP group, the measured share of
  all-to-all time hidden behind the other thread's compute (execution trace), the share the
  task-graph simulator predicts from node costs measured in the baseline run, and one merged
  Chrome trace (measured ranks and the predicted pairing side by side).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

TOL = 1e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (default 2)")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank (default 2)")
    parser.add_argument("--layers", type=int, default=2, help="MoE layers per chunk (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per microbatch")
    parser.add_argument("--hidden", type=int, default=32, help="model width")
    parser.add_argument("--experts", type=int, default=4, help="routed experts (global)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--out", default=os.path.join("out", "moe_pp_ep_trace.json"),
                        help="merged Chrome trace (default out/moe_pp_ep_trace.json)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")


@dataclass(frozen=True)
class DemoConfig:
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


def build_chunk(cfg: DemoConfig, stage: int) -> Any:
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


def _data(cfg: DemoConfig, step: int, ep_rank: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(7919 * step + 31 * ep_rank + 1)
    shape = (cfg.microbatches, cfg.tokens, cfg.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def pp_ep_main(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any]:
    """One rank of the job; returns its report (rank 0's includes the merged trace events)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
    from overlap_runtime.graph import simulate
    from overlap_runtime.moe import OverlapExpertParallel, make_overlap_b_f_callback
    from overlap_runtime.moe.task_nodes import (measured_a2a_overlap, moe_overlap_pair_task_graph,
                                                node_costs_from_trace, predicted_a2a_overlap)
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
    measured = measured_a2a_overlap(gathered["overlap"])
    measured_all = measured_a2a_overlap(gathered["overlap"], paired_only=False)
    costs = node_costs_from_trace(gathered["baseline"], cfg.layers)
    sim = simulate(moe_overlap_pair_task_graph(costs, layers=cfg.layers, ep_size=cfg.ep))
    sim_serial = simulate(moe_overlap_pair_task_graph(costs, layers=cfg.layers, ep_size=cfg.ep,
                                                      overlap=False))
    paired = sum(1 for a in ovl.program if a.kind is ActionKind.OVERLAP_B_F)
    report = {"rank": rank, "pp_rank": pp_rank, "ep_rank": ep_rank, "errs": errs,
              "steps": steps, "launches": launches, "paired_steps": paired,
              "measured": measured, "measured_all": measured_all,
              "predicted": predicted_a2a_overlap(sim), "predicted_pair_s": sim.makespan,
              "predicted_serial_pair_s": sim_serial.makespan,
              "costs": dataclasses.asdict(costs.resolved()), "has_last": has_last}
    if rank == 0:
        report["events"] = gathered["overlap"]
        from overlap_runtime.graph import chrome_trace
        report["sim_trace"] = chrome_trace(sim, time_scale=1e6)  # seconds -> microseconds
    dist.barrier()
    return report


def _worse(a: float, b: float) -> float:
    """The larger error; NaN (a non-finite value on either side) counts as infinitely bad."""
    import math

    if math.isnan(a) or math.isnan(b):
        return math.inf
    return max(a, b)


def write_merged_trace(events: list[Any], predicted: dict[str, Any], path: str) -> None:
    """Measured execution trace (a process per rank, a track per thread) plus the simulated
    OVERLAP_B_F pairing (``graph.chrome_trace`` dict; a process per EP rank, pid 100+) in one
    Chrome trace file."""
    from overlap_runtime.pipeline.exec_trace import chrome_trace_events

    measured = chrome_trace_events(events)
    for ev in predicted["traceEvents"]:
        ev["pid"] = 100 + ev["pid"]
        if ev.get("name") == "process_name":
            ev["args"]["name"] = f"predicted OVERLAP_B_F pair, EP rank {ev['pid'] - 100}"
    measured["traceEvents"].extend(predicted["traceEvents"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(measured, fh)


def run(args: argparse.Namespace) -> int:
    from overlap_runtime.launch import spawn
    from overlap_runtime.schedules import ScheduleSpec, compile_spec

    cfg = DemoConfig(pp=args.pp, ep=args.ep, chunks=args.chunks, layers=args.layers,
                     microbatches=args.microbatches, tokens=args.tokens, hidden=args.hidden,
                     experts=args.experts, top_k=args.top_k, steps=args.steps,
                     timeout_s=args.timeout)
    world = cfg.pp * cfg.ep
    print(f"overlap-runtime demo: PP={cfg.pp} x EP={cfg.ep} on {world} CPU ranks (gloo); "
          f"Interleaved1F1B, {cfg.chunks} chunks/rank x {cfg.layers} MoE layers, "
          f"{cfg.microbatches} microbatches x {cfg.tokens} tokens, hidden {cfg.hidden}, "
          f"{cfg.experts} experts top-{cfg.top_k} + shared expert, {cfg.steps} steps")
    spec = ScheduleSpec(kind="interleaved_1f1b", pp_size=cfg.pp, num_microbatches=cfg.microbatches,
                        virtual_stages=cfg.chunks, overlap_b_f=True, overlap_p2p=True)
    compiled = compile_spec(spec)
    from overlap_runtime.graph import format_grid
    programs = {r: [str(a) for a in acts if a is not None and not a.is_comm]
                for r, acts in compiled.lowered.items()}
    print("schedule (compute steps per pipeline rank; every EP replica runs the same):")
    print(format_grid(programs))
    t0 = time.perf_counter()
    reports = spawn(pp_ep_main, world, args=(cfg,), timeout_s=cfg.timeout_s)
    wall = time.perf_counter() - t0
    print("\nstep  pipeline(ep)  loss overlap_b_f   loss baseline     rel diff   "
          "wall overlap / baseline")
    for rep in reports:
        if not rep["has_last"]:
            continue
        for k, st in enumerate(rep["steps"]):
            lo, lb = st["overlap"]["loss"], st["baseline"]["loss"]
            print(f"{k:>4}  {rep['ep_rank']:>12}  {lo:>16.8f}  {lb:>14.8f}  "
                  f"{abs(lo - lb) / abs(lb):>10.2e}   {st['overlap']['wall_s']:.3f}s / "
                  f"{st['baseline']['wall_s']:.3f}s")
    worst = max(max(r["errs"].values()) for r in reports)
    worst_name = max(((k, v) for r in reports for k, v in r["errs"].items()), key=lambda kv: kv[1])[0]
    n_grads = sum(len(r["errs"]) for r in reports)
    ok = worst <= TOL
    print(f"loss and {n_grads} gradient tensors (all ranks, all steps) vs baseline: worst rel "
          f"{worst:.2e} ({worst_name})  {'ok' if ok else 'FAIL'} (tol {TOL:g})")
    print(f"launch order: {reports[0]['launches']} EP all-to-alls per rank, same order on every "
          f"rank of each EP group (checked on all {world} ranks); "
          f"{reports[0]['paired_steps']} OVERLAP_B_F steps per rank per step")
    m = reports[0]["measured"]
    print(f"overlap ratio (measured, last step, all ranks): {m['share']:.1%} of all-to-all time "
          f"inside OVERLAP_B_F steps ran while the other thread computed "
          f"({m['hidden_s'] * 1e3:.1f} of {m['a2a_s'] * 1e3:.1f} ms, {int(m['count'])} "
          f"all-to-alls); over the whole step: {reports[0]['measured_all']['share']:.1%}")
    r0 = reports[0]
    print(f"overlap ratio (predicted by the task-graph simulator from node costs measured in the "
          f"baseline run): {r0['predicted']:.1%}; one pairing {r0['predicted_pair_s'] * 1e3:.2f} "
          f"ms overlapped vs {r0['predicted_serial_pair_s'] * 1e3:.2f} ms serial")
    write_merged_trace(r0["events"], r0["sim_trace"], args.out)
    print(f"merged Chrome trace (measured ranks + predicted pairing): {os.path.abspath(args.out)}")
    print(f"wall {wall:.1f}s")
    if not ok:
        print(f"demo FAILED: overlapped run differs from the baseline (rel {worst:.2e} > {TOL:g})")
        return 1
    print("demo OK")
    return 0
