"""Where each context-parallel mode wins (issue #24 item 4): measured on CPU gloo ranks at CP
2..8, predicted by the step simulator at CP 4..64 over 8-GPU nodes.

    .venv/bin/python -m benchmarks.cp_crossover --measure       # CPU ranks, ~1-2 min on 2 cores
    .venv/bin/python -m benchmarks.cp_crossover --predict       # simulator, a few seconds

``--measure`` spawns ``P`` gloo ranks for each ``P`` of ``--cp`` (default 2 4 8) and times
forward + backward (median over ``--iters`` of the slowest rank, after one warm-up) of

* a GatedDeltaNet layer (eager, fp32) under ``LinearAttentionContextParallel`` in the modes
  ``p2p`` (chain), ``prefix_scan`` (tree), ``all_gather`` and ``ulysses``;
* causal attention (fp32, zigzag) in the modes ``ring``, ``ulysses`` and ``hierarchical``
  (``a2a = 2``, ``ring = P / 2``; from CP4),

each against one process over the whole sequence (rel-L2 of this rank's output rows, worst
rank). What the CPU figures can show: that every mode runs and agrees with one process at every
CP size, and how a mode's message count grows (gloo over loopback, ~0.05 ms a message). What
they cannot: anything about GPUs, NVLink or nodes. ``P`` ranks share the host's 2 cores, so from
CP4 each rank runs at a fraction of a core and the times measure the oversubscription first.

``--predict`` prices one layer of ``configs/gpu_cp2_16k.yaml`` (Qwen3.5 geometry: GDN 16/32
heads of 128, attention 16 q / 2 kv heads of 128, bf16) on the H200 profile (NVLink inside 8
GPUs, the inter-node link assumed 400 Gb/s NDR at 40 GB/s and 25 us:
``stepgraph.costs.h200_profile``) with ``stepgraph.crossover``: the fastest mode per CP size
and local length, the crossover CP sizes, and the predicted CP64 training step of the whole
4-layer model per mode.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

GDN_MODES = ("p2p", "prefix_scan", "all_gather", "ulysses")
ATTENTION_MODES = ("ring", "ulysses", "hierarchical")
MARGIN = 0.01  # a mode "wins" a crossover only when faster by more than this share


# ----------------------------------------------------------------------------- measure (CPU)


def _rel(a: Any, b: Any) -> float:
    import torch

    a64, b64 = a.detach().double(), b.detach().double()
    return (torch.linalg.vector_norm(a64 - b64)
            / torch.linalg.vector_norm(b64).clamp_min(1e-30)).item()


def _timed(fn: Any, iters: int) -> float:
    """Median over ``iters`` (after one warm-up) of the slowest rank's ms."""
    import torch
    import torch.distributed as dist

    samples = []
    for i in range(1 + iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ms = torch.tensor((time.perf_counter() - t0) * 1e3)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if i:
            samples.append(ms.item())
    return statistics.median(samples)


def measure_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank: every GDN and attention mode at CP ``world`` (rows identical on every rank)."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_runtime.context_parallel import (LinearAttentionContextParallel, ring_attention,
                                                  shard_positions, ulysses_attention)
    from overlap_runtime.context_parallel.hierarchical import (hierarchical_attention,
                                                               hierarchical_cp_mesh)
    from overlap_runtime.layers import GatedDeltaNet

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    # GDN: contiguous shards of the global sequence
    seq = world * args.local_seq
    base = GatedDeltaNet(args.hidden, args.heads, args.heads * 2, args.dim, args.dim)
    x_full = torch.randn(1, seq, args.hidden)
    dy_full = torch.randn(1, seq, args.hidden)
    mine = slice(rank * args.local_seq, (rank + 1) * args.local_seq)
    ref = base(x_full)[:, mine].detach()
    x = x_full[:, mine].clone().requires_grad_(True)
    dy = dy_full[:, mine].contiguous()
    for mode in GDN_MODES:
        layer = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), mesh)

        def step() -> Any:
            y = layer(x)
            y.backward(dy)
            return y

        err = torch.tensor(_rel(step(), ref))
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        rows.append(dict(kind="gdn", mode=mode, cp=world, ms=_timed(step, args.iters),
                         rel=err.item()))
    # attention: zigzag shards, q [1, S/P, H, D]
    heads = max(world, args.heads)
    q_full, k_full, v_full = (torch.randn(1, seq, heads, args.dim) for _ in range(3))
    pos = shard_positions(seq, world, rank, "zigzag")
    ref = F.scaled_dot_product_attention(q_full.transpose(1, 2), k_full.transpose(1, 2),
                                         v_full.transpose(1, 2), is_causal=True
                                         ).transpose(1, 2)[:, pos]
    q, k, v = (t[:, pos].clone().requires_grad_(True) for t in (q_full, k_full, v_full))
    do = torch.randn_like(q)
    group = mesh.get_group()
    fns: dict[str, Any] = {"ring": lambda: ring_attention(q, k, v, group),
                           "ulysses": lambda: ulysses_attention(q, k, v, group)}
    if world >= 4:
        hmesh = hierarchical_cp_mesh(mesh, 2)
        ga, gr = hmesh.get_group("cp_a2a"), hmesh.get_group("cp_ring")
        fns["hierarchical"] = lambda: hierarchical_attention(q, k, v, ga, gr)
    for mode in ATTENTION_MODES:
        if mode not in fns:
            rows.append(dict(kind="attention", mode=mode, cp=world, ms=None, rel=None,
                             note="needs a2a >= 2 and ring >= 2"))
            continue

        def step(fn: Any = fns[mode]) -> Any:
            out = fn()
            out.backward(do)
            return out

        err = torch.tensor(_rel(step(), ref))
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        rows.append(dict(kind="attention", mode=mode, cp=world, ms=_timed(step, args.iters),
                         rel=err.item()))
    return rows


def measure(args: argparse.Namespace) -> None:
    import torch

    from overlap_runtime.launch import spawn

    print(f"CPU gloo ranks on this host ({torch.__version__}, 1 thread a rank); GDN hidden "
          f"{args.hidden}, {args.heads}/{2 * args.heads} heads of {args.dim}, attention "
          f"{args.heads}+ heads of {args.dim}, local {args.local_seq} tokens a rank, fp32, "
          f"forward + backward, median of {args.iters} of the slowest rank")
    modes = GDN_MODES + ATTENTION_MODES
    print("| CP | " + " | ".join(f"GDN {m}" for m in GDN_MODES) + " | "
          + " | ".join(f"attn {m}" for m in ATTENTION_MODES) + " |")
    print("|---:|" + "---:|" * len(modes))
    for cp in args.cp:
        t0 = time.perf_counter()
        rows = spawn(measure_rank, cp, args=(args,), timeout_s=600.0)[0]
        cells = []
        for kind, names in (("gdn", GDN_MODES), ("attention", ATTENTION_MODES)):
            for m in names:
                r = next(x for x in rows if x["kind"] == kind and x["mode"] == m)
                cells.append("n/a" if r["ms"] is None else f"{r['ms']:.1f} ({r['rel']:.0e})")
        print(f"| {cp} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - t0:.1f} s -->")


# ----------------------------------------------------------------------------- predict


def predict(args: argparse.Namespace) -> None:
    from overlap_runtime.stepgraph.costs import h200_profile
    from overlap_runtime.stepgraph.crossover import crossover_cp, predict_grid, winner
    from overlap_runtime.stepgraph.scale import predict_at_scale
    from overlap_runtime.config.train import apply_overrides, load_config

    t0 = time.perf_counter()
    base = load_config(ROOT / "configs" / "gpu_cp2_16k.yaml")
    prof = h200_profile(args.gpus_per_node)
    cps, lens = args.cp, [n * 1024 for n in args.local_k]
    print(f"profile: {prof.source}; {prof.gpus_per_node} GPUs per node; one layer of "
          f"configs/gpu_cp2_16k.yaml, forward + backward, ms; n/a = refused by the config")
    grids = {}
    for kind, modes in (("gdn", GDN_MODES), ("attention", ATTENTION_MODES)):
        rows = grids[kind] = predict_grid(base, kind, cps, lens, prof)  # type: ignore[arg-type]
        print(f"\n{kind}: " + ", ".join(modes) + " (the fastest in bold)")
        print("| local | CP | " + " | ".join(modes) + " | fastest |")
        print("|---:|---:|" + "---:|" * len(modes) + "---|")
        for n in lens:
            for cp in cps:
                best = winner(rows, n, cp)
                cells = []
                for m in modes:
                    r = next(x for x in rows if x.local_len == n and x.cp == cp and x.mode == m)
                    if r.ms is None:
                        cells.append("n/a")
                        continue
                    txt = f"{r.ms:.2f}" + (f" ({r.split[0]}x{r.split[1]})" if r.split else "")
                    cells.append(f"**{txt}**" if r is best else txt)
                print(f"| {n // 1024}K | {cp} | " + " | ".join(cells) + f" | {best.mode} |")
        pairs = [(a, b) for i, a in enumerate(modes) for b in modes[i + 1:]]
        print(f"\n{kind} crossover: smallest CP from which the second mode is faster by more than "
              f"{MARGIN:.0%} at every larger CP of the grid ('-': never in {cps[0]}..{cps[-1]})")
        print("| local | " + " | ".join(f"{a} -> {b}" for a, b in pairs) + " |")
        print("|---:|" + "---:|" * len(pairs))
        for n in lens:
            cells = []
            for a, b in pairs:
                fwd = crossover_cp(rows, n, a, b, margin=MARGIN)
                back = crossover_cp(rows, n, b, a, margin=MARGIN)
                cells.append(f"{b} from {fwd}" if fwd else f"{a} from {back}" if back else "-")
            print(f"| {n // 1024}K | " + " | ".join(cells) + " |")
    # the whole 4-layer model (3 GDN + 1 attention), FSDP over CP, at CP64
    cp = max(cps)
    print(f"\nCP{cp} training step of the whole configs/gpu_cp2_16k.yaml model (3 GDN + 1 "
          f"attention layers, FSDP over the {cp} CP ranks), ms; attention {args.step_attention}")
    print("| local | " + " | ".join(GDN_MODES) + " |")
    print("|---:|" + "---:|" * len(GDN_MODES))
    att = args.step_attention.split(":")
    for n in lens:
        cells = []
        for m in GDN_MODES:
            sets = [f"train.accelerator.cp={cp}", f"train.accelerator.world_size={cp}",
                    f"data.seq_len={cp * n}", f"train.accelerator.linear_attention_cp_mode={m}",
                    f"train.accelerator.full_attention_cp_mode={att[0]}"]
            if att[0] == "hierarchical":
                a2a = int(att[1])
                sets.append(f"train.accelerator.hierarchical_cp={{a2a: {a2a}, ring: {cp // a2a}}}")
            try:
                cfg = apply_overrides(base, sets, "crossover step")
            except ValueError as exc:
                cells.append("n/a")
                continue
            cells.append(f"{predict_at_scale(cfg, prof).step_s * 1e3:.1f}")
        print(f"| {n // 1024}K | " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="CPU gloo ranks (module doc)")
    p.add_argument("--predict", action="store_true", help="the simulator (module doc)")
    p.add_argument("--cp", type=int, nargs="+", default=None,
                   help="CP sizes (default: 2 4 8 measured, 4 8 16 32 64 predicted)")
    p.add_argument("--local-k", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="predicted local lengths in K tokens")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--step-attention", default="ring",
                   help="attention mode of the CP64 step table (hierarchical:A for a2a = A)")
    p.add_argument("--local-seq", type=int, default=128, help="measured tokens a rank")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4, help="GDN key heads (values: twice)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    if not (args.measure or args.predict):
        p.error("give --measure, --predict or both")
    if args.measure:
        measure(argparse.Namespace(**{**vars(args), "cp": args.cp or [2, 4, 8]}))
    if args.predict:
        predict(argparse.Namespace(**{**vars(args), "cp": args.cp or [4, 8, 16, 32, 64]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
