"""Rank functions of tests/pipeline/test_torch_runtime_interop.py: our schedules inside torch's
``_PipelineScheduleRuntime`` with real torch ``PipelineStage``s (not collected: no test_ prefix).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

HIDDEN, TOKENS = 8, 4


def dense_chunk(stage: int) -> nn.Module:
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())


def batch(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m * 2, HIDDEN, generator=g), torch.randn(m * 2, HIDDEN, generator=g)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def reference_grads(num_stages: int, m: int) -> tuple[dict[str, torch.Tensor], float]:
    """One process, the whole model, the mean of the microbatch losses (what scale_grads gives)."""
    chunks = [dense_chunk(s) for s in range(num_stages)]
    x, y = batch(m)
    losses = []
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = xm
        for c in chunks:
            h = c(h)
        losses.append(mse(h, ym))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {f"S{s}.{n}": p.grad.clone() for s, c in enumerate(chunks)
             for n, p in c.named_parameters()}
    return grads, float(loss)


def _torch_stages(chunks: dict[int, nn.Module], num_stages: int, shape: tuple[int, ...],
                  group: Any = None) -> list[Any]:
    from torch.distributed.pipelining import PipelineStage as TorchStage

    del shape  # torch infers the boundary shapes on the first step
    return [TorchStage(chunks[s], s, num_stages, torch.device("cpu"), group=group)
            for s in sorted(chunks)]


def csv_in_torch_runtime(rank: int, world: int, spec_kw: dict[str, Any], csv_dir: str
                         ) -> dict[str, Any]:
    """Our schedule, exported with to_torch_csv, loaded and stepped by torch's runtime."""
    import torch.distributed.pipelining.schedules as ts

    from overlap_runtime.schedules import ScheduleSpec, build_schedule, to_torch_csv

    spec = ScheduleSpec(**spec_kw)
    path = os.path.join(csv_dir, f"rank{rank}.csv")
    to_torch_csv(build_schedule(spec), path)
    mine = [s for s, r in spec.stage_mapping().items() if r == rank]
    chunks = {s: dense_chunk(s) for s in mine}
    m = spec.num_microbatches
    stages = _torch_stages(chunks, spec.num_stages, (2, HIDDEN))
    sched = ts._PipelineScheduleRuntime(stages, m, loss_fn=mse)
    sched._load_csv(path)
    x, y = batch(m)
    losses: list[torch.Tensor] = []
    first, last = 0 in chunks, spec.num_stages - 1 in chunks
    sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    overlapped = sum(a is not None and a.computation_type == ts.OVERLAP_F_B
                     for a in sched.pipeline_order[rank])
    return {"grads": {f"S{s}.{n}": p.grad.clone() for s, c in chunks.items()
                      for n, p in c.named_parameters()},
            "loss": float(torch.stack(losses).mean()) if losses else None,
            "overlapped_steps": overlapped}


def moe_chunk(stage: int, layers: int = 2) -> nn.Module:
    from overlap_runtime.moe import MoE

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
            self.mixer = nn.Linear(HIDDEN, HIDDEN)
            self.moe = MoE(HIDDEN, HIDDEN, 4, 2, shared_ffn_hidden=HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + torch.tanh(self.mixer(self.norm1(x)))
            return x + self.moe(self.norm2(x))

    torch.manual_seed(1000 + stage)
    return nn.Sequential(*[Block() for _ in range(layers)])


def pp2_ep2_overlap_f_b(rank: int, world: int, csv_dir: str, fail: str | None = None
                        ) -> dict[str, Any]:
    """PP2 x EP2: our interleaved schedule with OVERLAP_B_F exported for torch, run by torch's
    runtime without, then with, our OVERLAP_F_B callback; every gradient and the loss compared."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as ts
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
    from overlap_runtime.moe import OverlapExpertParallel
    from overlap_runtime.pipeline.torch_interop import make_torch_overlap_f_b_callback
    from overlap_runtime.schedules import ScheduleSpec, build_schedule, to_torch_csv
    from overlap_runtime.testing import rel_l2

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp_group = mesh["pp"].get_group()
    pp_rank, ep_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    spec = ScheduleSpec(kind="interleaved_1f1b", pp_size=2, num_microbatches=4,
                        virtual_stages=2, overlap_b_f=True)
    path = os.path.join(csv_dir, f"rank{rank}.csv")
    to_torch_csv(build_schedule(spec), path)
    coordinator = HookCoordinator(timeout_s=60, debug=True)
    overlap = CommComputeOverlap(coordinator, "cpu")
    mine = [s for s, r in spec.stage_mapping().items() if r == pp_rank]
    chunks = {}
    for s in mine:
        chunks[s] = moe_chunk(s)
        OverlapExpertParallel(coordinator, tag_prefix=f"S{s}.").apply(chunks[s], mesh["ep"])
    armed = {"on": False}
    if fail is not None and pp_rank == 1 and ep_rank == 0:
        def boom(mod: Any, args: Any) -> None:
            if armed["on"]:
                raise ValueError("injected failure in stage 1's forward")
        chunks[1].register_forward_pre_hook(boom)
    stages = _torch_stages(chunks, spec.num_stages, (1, TOKENS, HIDDEN), pp_group)
    sched = ts._PipelineScheduleRuntime(stages, 4, loss_fn=mse)
    sched._load_csv(path)
    g = torch.Generator().manual_seed(31 * ep_rank + 1)
    x, y = torch.randn(4, TOKENS, HIDDEN, generator=g), torch.randn(4, TOKENS, HIDDEN, generator=g)
    first, last = 0 in chunks, spec.num_stages - 1 in chunks
    params = [(f"S{s}.{n}", p) for s, c in chunks.items() for n, p in c.named_parameters()]
    calls = []
    callback = make_torch_overlap_f_b_callback(overlap, timeout_s=30)

    def counted(action: Any, ctx: Any) -> None:
        calls.append(str(action))
        armed["on"] = fail is not None  # the injected failure fires inside a pair only
        try:
            callback(action, ctx)
        finally:
            armed["on"] = False

    runs = {}
    # torch's first step infers the boundary metadata by running forward and backward on empty
    # tensors (torch 2.13): a warm-up step keeps that out of the compared gradients
    for name in ("warm-up", "sequential", "overlap"):
        if name == "overlap":
            sched.register_custom_function(ts.OVERLAP_F_B, counted)
        for _, p in params:
            p.grad = None
        losses: list[torch.Tensor] = []
        coordinator.clear_trace()
        dist.barrier()
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        runs[name] = ({n: p.grad.clone() for n, p in params},
                      float(torch.stack(losses).detach().mean()) if losses else None,
                      len(coordinator.comm_order()))
    overlap.close()
    (g_seq, l_seq, _), (g_ovl, l_ovl, a2a) = runs["sequential"], runs["overlap"]
    errs = {n: rel_l2(g_ovl[n], g_seq[n]) for n in g_seq}
    return {"rank": rank, "errs": errs, "loss": (l_seq, l_ovl), "calls": calls,
            "coordinated_a2a": a2a, "n_params": len(params)}


def torch_dump_in_our_runtime(rank: int, world: int, csv_path: str) -> dict[str, Any]:
    """torch's own ``_dump_csv`` output (FSDP steps, OVERLAP_F_B, I/W, V placement) run by our
    ``PipelineSchedule`` through ``compile_table``: no schedule kind registered."""
    from overlap_runtime.pipeline import PipelineSchedule, PipelineStage
    from overlap_runtime.schedules import compile_table, load_torch_csv

    compiled = compile_table(load_torch_csv(csv_path))
    spec = compiled.spec
    mine = [s for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank]
    chunks = {s: dense_chunk(s) for s in mine}
    sched = PipelineSchedule(compiled, [PipelineStage(chunks[s], s, spec.num_stages)
                                        for s in mine], mse, timeout_s=30)
    x, y = batch(spec.num_microbatches)
    losses: list[torch.Tensor] = []
    first, last = 0 in chunks, spec.num_stages - 1 in chunks
    sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    return {"grads": {f"S{s}.{n}": p.grad.clone() for s, c in chunks.items()
                      for n, p in c.named_parameters()},
            "loss": float(torch.stack(losses).mean()) if losses else None,
            "placement": spec.placement, "kinds": sorted({a.kind.value for a in sched.program})}


class _Scaled(nn.Module):
    """Stage 0 with a keyword input: ``forward(x, *, scale)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dense_chunk(0)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, shift: float) -> torch.Tensor:
        return self.inner(x * scale + shift)


def torch_style_step(rank: int, world: int) -> dict[str, Any]:
    """Schedule1F1B built with ``n_microbatches``, stepped like torch's (``**kwargs`` for stage
    0, ``loss_kwargs``, ``return_outputs``), under the profiler (ranges named after actions)."""
    from overlap_runtime.pipeline import PipelineStage, Schedule1F1B

    module = _Scaled() if rank == 0 else dense_chunk(1)

    def loss_fn(out: torch.Tensor, target: torch.Tensor, *, weight: float) -> torch.Tensor:
        return weight * mse(out, target)

    sched = Schedule1F1B(PipelineStage(module, rank, 2), loss_fn=loss_fn, n_microbatches=4,
                         timeout_s=30)
    x, y = batch(4)
    scale = torch.linspace(0.5, 2.0, 8).unsqueeze(1)
    results = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for ret in (True, False):
            losses: list[torch.Tensor] = []
            for p in module.parameters():
                p.grad = None
            out = sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None,
                             losses=losses, return_outputs=ret, loss_kwargs={"weight": 3.0},
                             **({"scale": scale, "shift": 0.25} if rank == 0 else {}))
            results[ret] = out
    names = sorted({e.name for e in prof.events() if e.name.startswith("pp.")})
    return {"out_shape": None if results[True] is None else tuple(results[True].shape),
            "out_false": results[False], "losses": [float(v) for v in losses],
            "grads": {n: p.grad.clone() for n, p in module.named_parameters()},
            "ranges": names, "num_microbatches": sched.spec.num_microbatches}


def torch_style_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    first, second = _Scaled(), dense_chunk(1)
    x, y = batch(4)
    scale = torch.linspace(0.5, 2.0, 8).unsqueeze(1)
    losses = []
    for xm, ym, sm in zip(x.chunk(4), y.chunk(4), scale.chunk(4)):
        losses.append(3.0 * mse(second(first(xm, scale=sm, shift=0.25)), ym))
    torch.stack(losses).mean().backward()
    grads = {f"S0.{n}": p.grad for n, p in first.named_parameters()}
    grads.update({f"S1.{n}": p.grad for n, p in second.named_parameters()})
    return grads, [float(v) for v in losses]
