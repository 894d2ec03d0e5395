"""Full-attention context parallelism: ring (zigzag) and Ulysses against one device.

GPU (the figures in docs/benchmarks.md)::

    torchrun --nproc-per-node 2 -m benchmarks.attention_cp            # NCCL, bf16, 16 heads,
                                                                      # head dim 128, 32K and 64K

CPU smoke test (spawns its own gloo ranks when not started by torchrun)::

    python -m benchmarks.attention_cp --device cpu --seq 256 --heads 4 --dim 16

For each total sequence length every rank builds the same full q, k, v and upstream gradient
from one seed, then times forward + backward of

* ``single``: causal ``scaled_dot_product_attention`` over the whole sequence on one device
  (every rank runs it on its own device; the table shows the slowest);
* ``single_ops``: ``ops.attention.attention`` (the block kernel the CP modes use, ``--backend``)
  over the whole sequence on one device: separates the kernel's speed from CP's overhead;
* each CP mode on the rank's zigzag shard (``overlap_runtime.context_parallel``).

A figure is the median over iterations of the maximum over ranks (CUDA events on GPU,
``perf_counter`` on CPU; a barrier before each timed iteration). Accuracy: rel-L2 of each rank's
rows of out, dq, dk, dv against the single-device result (worst rank). The table is printed at
the end; JSON goes to ``$OUT/attention_cp.json`` when ``OUT`` is set (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


from overlap_runtime.context_parallel import (  # noqa: E402
    CommStats,
    all_gather_kv_attention,
    ring_attention,
    shard_positions,
    ulysses_attention,
)
from overlap_runtime.ops.attention import attention  # noqa: E402
from benchmarks._timing import max_over_ranks, profile_kernels, rank_device, timed_slowest_rank, write_out  # noqa: E402  (benchmarks/_timing.py)

MODES: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_attention, "ulysses": ulysses_attention, "all_gather_kv": all_gather_kv_attention}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 65536], help="total lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["ring", "ulysses"])
    p.add_argument("--load-balance", choices=["zigzag", "none"], default="zigzag")
    p.add_argument("--backend", choices=["cudnn", "flash", "math"], default=None,
                   help="local block kernel (overlap_runtime.ops.attention); default: cudnn on "
                        "cuda, math on cpu (printed with the results)")
    p.add_argument("--profile", action="store_true",
                   help="also write each rank's per-kernel device times to "
                        "$OUT/attention_cp_profile_r<rank>.txt")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--json", default=None, help="default: $OUT/attention_cp.json if OUT is set")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "cudnn" if args.device == "cuda" else "math"
    args.kv_heads = args.kv_heads or args.heads
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median over ``iters`` of the slowest rank's milliseconds for one ``fn()``."""
    return timed_slowest_rank(fn, device, warmup, iters)[0]

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return (torch.linalg.vector_norm(a64 - b64) / torch.linalg.vector_norm(b64).clamp_min(1e-30)).item()



def causal_flops(b: int, s: int, h: int, d: int) -> float:
    """Forward + backward matmul FLOPs of causal attention (backward = 2.5 x forward)."""
    fwd = 4.0 * b * s * s * h * d / 2
    return 3.5 * fwd


def bench_length(args: argparse.Namespace, seq: int, device: torch.device,
                 group: dist.ProcessGroup) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = DTYPES[args.dtype]
    lb = None if args.load_balance == "none" else "zigzag"
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.dim
    g = torch.Generator(device=device).manual_seed(1234 + seq)
    q = torch.randn(b, seq, h, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(b, seq, hkv, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(b, seq, hkv, d, device=device, dtype=dtype, generator=g)
    dout = torch.randn(b, seq, h, d, device=device, dtype=dtype, generator=g)
    pos = shard_positions(seq, world, rank, lb, device=device)
    rows: list[dict[str, Any]] = []
    flops = causal_flops(b, seq, h, d)

    # single device: SDPA over the whole sequence ([B, H, S, D] views of [B, S, H, D]).
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def single() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        qt, kt, vt = (t.transpose(1, 2) for t in leaves)
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=hkv != h).transpose(1, 2)
        out.backward(dout)
        return out

    ref_out = single().detach()
    ref = [ref_out[:, pos]] + [t.grad[:, pos] for t in leaves]
    ms = timed(single, device, args.warmup, args.iters)
    rows.append(dict(seq=seq, mode="single", ranks=1, ms=ms, tflops=flops / ms / 1e9,
                     speedup=1.0))
    if args.profile and rank == 0:
        write_out("attention_cp_profile_r0.txt",
                  f"seq {seq} single SDPA\n" + profile_kernels(single, device))
    single_ms = ms

    def single_ops() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        out = attention(*leaves, causal=True, backend=args.backend)
        out.backward(dout)
        return out

    try:
        out = single_ops()
        errs = [_rel(out[:, pos], ref[0])] + [_rel(t.grad[:, pos], r)
                                             for t, r in zip(leaves, ref[1:])]
        ms = timed(single_ops, device, args.warmup, args.iters)
        rows.append(dict(seq=seq, mode="single_ops", ranks=1, ms=ms, tflops=flops / ms / 1e9,
                         speedup=single_ms / ms, rel_out=errs[0], rel_dq=errs[1], rel_dk=errs[2],
                         rel_dv=errs[3]))
    except Exception as exc:  # e.g. the math backend out of memory at long lengths
        rows.append(dict(seq=seq, mode="single_ops", ranks=1, error=f"{type(exc).__name__}: {exc}"))
    del leaves

    for mode in args.modes:
        local = [t[:, pos].detach().clone().requires_grad_(True) for t in (q, k, v)]
        dout_l = dout[:, pos].contiguous()
        fn = MODES[mode]

        def step(stats: CommStats | None = None) -> torch.Tensor:
            for t in local:
                t.grad = None
            out = fn(*local, group=group, causal=True, load_balance=lb, stats=stats,
                     backend=args.backend)
            out.backward(dout_l)
            return out

        try:
            stats = CommStats()
            out = step(stats)
            errs = [_rel(out, ref[0])] + [_rel(t.grad, r) for t, r in zip(local, ref[1:])]
            errs = [max_over_ranks(e, device) for e in errs]
            ms = timed(step, device, args.warmup, args.iters)
            if args.profile:
                write_out(f"attention_cp_profile_r{rank}.txt",
                          f"seq {seq} mode {mode} rank {rank}\n" + profile_kernels(step, device))
            rows.append(dict(seq=seq, mode=mode, ranks=world, ms=ms,
                             tflops=flops / world / ms / 1e9, speedup=single_ms / ms,
                             rel_out=errs[0], rel_dq=errs[1], rel_dk=errs[2], rel_dv=errs[3],
                             comm=stats.as_dict(),
                             comm_mib={f"{p}/{k}": round(n / 2**20, 2)
                                       for (p, k), n in sorted(stats.nbytes.items())}))
        except Exception as exc:  # keep the other modes' figures; report the failure
            rows.append(dict(seq=seq, mode=mode, ranks=world, error=f"{type(exc).__name__}: {exc}"))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del local
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'seq':>7} {'mode':>14} {'ranks':>5} {'ms':>10} {'TFLOP/s/dev':>12} "
            f"{'speedup':>8} {'rel out':>9} {'rel dq':>9} {'rel dk':>9} {'rel dv':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['seq']:>7} {r['mode']:>14} {r['ranks']:>5}  ERROR {r['error']}")
            continue
        rel = "".join(f" {r[k]:>9.2e}" if k in r else f" {'-':>9}"
                      for k in ("rel_out", "rel_dq", "rel_dk", "rel_dv"))
        lines.append(f"{r['seq']:>7} {r['mode']:>14} {r['ranks']:>5} {r['ms']:>10.3f} "
                     f"{r['tflops']:>12.2f} {r['speedup']:>8.2f}{rel}")
    return "\n".join(lines)


def run_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank's benchmark; the process group is already initialised (spawn or torchrun)."""
    device = rank_device(args.device, rank)
    group = dist.group.WORLD
    rows: list[dict[str, Any]] = []
    for seq in args.seq:
        if seq % (2 * world):
            raise SystemExit(f"--seq {seq} is not a multiple of 2 * ranks = {2 * world}")
        rows += bench_length(args, seq, device, group)
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace, world: int, device: str) -> None:
    meta = dict(device=device, ranks=world, dtype=args.dtype, backend=args.backend,
                heads=args.heads,
                kv_heads=args.kv_heads, dim=args.dim, batch=args.batch,
                load_balance=args.load_balance, warmup=args.warmup, iters=args.iters,
                torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if device == "cuda" else None)
    print(f"\nfull-attention CP, {meta}")
    print("time = median over iterations of the slowest rank, forward + backward\n")
    print(format_table(rows))
    for r in rows:
        if "comm" in r:
            print(f"  seq {r['seq']} {r['mode']}: ops {r['comm']}  MiB {r['comm_mib']}")
    path = args.json or (os.path.join(os.environ["OUT"], "attention_cp.json")
                         if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
        print(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        from overlap_runtime.launch import init_from_env

        ctx = init_from_env(device=args.device)
        try:
            rows = run_rank(ctx.rank, ctx.world_size, args)
            if ctx.rank == 0:
                report(rows, args, ctx.world_size, args.device)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return
    from overlap_runtime.launch import spawn

    results = spawn(run_rank, args.nproc, args=(args,), device=args.device,
                    timeout_s=max(600.0, 60.0 * len(args.seq)))
    report(results[0], args, args.nproc, args.device)


if __name__ == "__main__":
    main()
