"""GDN context parallelism on GPUs: the whole GatedDeltaNet layer, CP modes against one device.

GPU (H200 pair, the run this script was written for)::

    torchrun --nproc-per-node 2 -m benchmarks.gdn_cp_gpu     # NCCL, CP2, backend triton, bf16,
                                                            # hidden 2048, heads 16/32, K=V=128,
                                                            # local sequence 8K, 16K, 32K

CPU smoke test (eager backend, tiny sizes, spawns its own gloo ranks)::

    python -m benchmarks.gdn_cp_gpu --device cpu --smoke

For each local length ``L`` (global ``S = P * L``) every rank builds the same layer (seeded; slow
decay by default, ``--decay``), the same global input and the same upstream gradient, then times one
forward + backward of

* ``single_local``: the plain layer on one device over ``L`` tokens (the weak-scaling baseline:
  a CP rank holds ``L`` tokens too; ``eff = single_local / mode``);
* ``single_global``: the plain layer on one device over all ``S`` tokens (``speedup = single_global
  / mode``); it is also the accuracy reference;
* each CP mode (``LinearAttentionContextParallel(mode, backend)``) on the rank's contiguous
  shard.

A time is the median over iterations of the maximum over ranks (CUDA events on GPU,
``perf_counter`` on CPU; a device sync and a barrier before each timed iteration). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed iterations, max over ranks (GPU only).
Accuracy: rel-L2 of the CP output and input gradient (the rank's rows) and of every parameter
gradient (summed over ranks) against ``single_global``; worst rank / worst parameter, and the run
fails the ``--tol`` check (default 1e-2) loudly in the table. JSON goes to
``$OUT/gdn_cp_gpu.json`` when ``OUT`` is set (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


from overlap_runtime.context_parallel import LinearAttentionContextParallel  # noqa: E402
from overlap_runtime.layers import GatedDeltaNet  # noqa: E402
from benchmarks._timing import (  # noqa: E402  (benchmarks/_timing.py)
    max_over_ranks, profile_kernels, rank_device, timed_local_ms, timed_slowest_rank, write_out,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("ulysses", "p2p", "all_gather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, eager backend, fp32 (with --device cpu: runs anywhere)")
    p.add_argument("--local-seq", type=int, nargs="+", default=None,
                   help="tokens per rank (default 8192 16384 32768; smoke: 64)")
    p.add_argument("--hidden", type=int, default=None, help="default 2048 (smoke: 32)")
    p.add_argument("--key-heads", type=int, default=None, help="default 16 (smoke: 2)")
    p.add_argument("--value-heads", type=int, default=None, help="default 32 (smoke: 4)")
    p.add_argument("--head-dim", type=int, default=None, help="K = V, default 128 (smoke: 16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default bf16 (smoke: fp32)")
    p.add_argument("--backend", choices=["triton", "eager"], default=None,
                   help="local GDN backend, default triton (smoke: eager)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                   help="default ulysses p2p (all_gather runs with backend eager only)")
    p.add_argument("--decay", choices=["slow", "qwen"], default="slow",
                   help="slow: A_log in [-5, -3], dt_bias in [-2, 0] (exp(g) ~ 0.97-0.9995 per "
                        "token, as in the tests: the state crossing ranks matters, so the "
                        "accuracy check sees a broken chain); qwen: Qwen3.5's initialisation "
                        "(the state is forgotten within a few tokens). Timing does not depend "
                        "on it")
    p.add_argument("--predict", action="store_true",
                   help="GPU, backend triton: measure the fused chain's node costs and one state "
                        "message, simulate CP 2..32 (benchmarks/gdn_cp_nodes.py) and print the "
                        "prediction next to the measured p2p row")
    p.add_argument("--profile", action="store_true",
                   help="also write each rank's per-kernel device times to "
                        "$OUT/gdn_cp_profile_r<rank>.txt")
    p.add_argument("--tol", type=float, default=1e-2, help="accuracy bound (rel-L2)")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (smoke: 1)")
    p.add_argument("--iters", type=int, default=None, help="default 10 (smoke: 2)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--json", default=None, help="default: $OUT/gdn_cp_gpu.json if OUT is set")
    args = p.parse_args(argv)
    full = dict(local_seq=[8192, 16384, 32768], hidden=2048, key_heads=16, value_heads=32,
                head_dim=128, dtype="bf16", backend="triton", warmup=3, iters=10)
    smoke = dict(local_seq=[64], hidden=32, key_heads=2, value_heads=4, head_dim=16,
                 dtype="fp32", backend="eager", warmup=1, iters=2)
    for name, value in (smoke if args.smoke else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.modes is None:
        args.modes = ["ulysses", "p2p"] + (["all_gather"] if args.backend == "eager" else [])
    return args


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int
          ) -> tuple[float, float | None]:
    """``(median ms of the slowest rank, peak GiB of the timed iterations, max over ranks)``."""
    return timed_slowest_rank(fn, device, warmup, iters)

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return (torch.linalg.vector_norm(a64 - b64)
            / torch.linalg.vector_norm(b64).clamp_min(1e-30)).item()


def make_layer(args: argparse.Namespace, device: torch.device) -> GatedDeltaNet:
    torch.manual_seed(0)  # the same layer on every rank
    layer = GatedDeltaNet(args.hidden, args.key_heads, args.value_heads, args.head_dim,
                          args.head_dim, backend=args.backend)
    if args.decay == "slow":
        with torch.no_grad():
            layer.A_log.uniform_(-5.0, -3.0)
            layer.dt_bias.uniform_(-2.0, 0.0)
    return layer.to(device=device, dtype=DTYPES[args.dtype])


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """One forward + backward; returns the output (grads land on x and the parameters)."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    y = layer(x)
    y.backward(dy)
    return y


def bench_length(args: argparse.Namespace, local_len: int, device: torch.device,
                 mesh: DeviceMesh) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    seq = world * local_len
    rows_sl = slice(rank * local_len, (rank + 1) * local_len)
    gen = torch.Generator(device=device).manual_seed(1234 + seq)
    x_full = torch.randn(args.batch, seq, args.hidden, device=device, dtype=dtype, generator=gen)
    dy_full = torch.randn(args.batch, seq, args.hidden, device=device, dtype=dtype, generator=gen)
    base = make_layer(args, device)
    rows: list[dict[str, Any]] = []
    common = dict(local_seq=local_len, seq=seq)

    # single device over the local length: the weak-scaling baseline
    x_loc = x_full[:, rows_sl].detach().clone().requires_grad_(True)
    dy_loc = dy_full[:, rows_sl].contiguous()
    ms, peak = timed(lambda: fwd_bwd(base, x_loc, dy_loc), device, args.warmup, args.iters)
    single_local_ms = ms
    prediction = None
    if args.predict:
        prediction = predict_chain(args, local_len, device, x_loc, base, single_local_ms)
    if args.profile and rank == 0:
        write_out("gdn_cp_profile_r0.txt", f"local {local_len} single_local\n"
                  + profile_kernels(lambda: fwd_bwd(base, x_loc, dy_loc), device))
    rows.append(dict(common, mode="single_local", ranks=1, ms=ms, peak_gib=peak, eff=1.0))

    # single device over the whole sequence: accuracy reference (and a speedup baseline)
    x_glob = x_full.detach().clone().requires_grad_(True)
    y_ref = fwd_bwd(base, x_glob, dy_full).detach()
    ref_out, ref_dx = y_ref[:, rows_sl].clone(), x_glob.grad[:, rows_sl].clone()
    ref_params = {n: p.grad.detach().clone() for n, p in base.named_parameters()}
    del y_ref
    ms, peak = timed(lambda: fwd_bwd(base, x_glob, dy_full), device, args.warmup, args.iters)
    single_global_ms = ms
    rows.append(dict(common, mode="single_global", ranks=1, ms=ms, peak_gib=peak,
                     eff=single_local_ms / ms))
    x_glob.grad = None
    base.zero_grad(set_to_none=True)
    del x_glob
    if device.type == "cuda":
        torch.cuda.empty_cache()

    for mode in args.modes:
        try:
            layer = LinearAttentionContextParallel(mode=mode, backend=args.backend).apply(
                copy.deepcopy(base), mesh)
            y = fwd_bwd(layer, x_loc, dy_loc)
            errs = {"out": _rel(y, ref_out), "dx": _rel(x_loc.grad, ref_dx)}
            worst_param, worst_name = 0.0, ""
            for n, p in layer.named_parameters():
                g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)  # each rank holds its share
                e = _rel(g, ref_params[n])
                if e >= worst_param:
                    worst_param, worst_name = e, n
            errs["param"] = worst_param
            errs = {k: max_over_ranks(v, device) for k, v in errs.items()}
            del y
            ms, peak = timed(lambda: fwd_bwd(layer, x_loc, dy_loc), device, args.warmup,
                             args.iters)
            if args.profile:
                write_out(f"gdn_cp_profile_r{rank}.txt", f"local {local_len} mode {mode} "
                          f"rank {rank}\n" + profile_kernels(lambda: fwd_bwd(layer, x_loc,
                                                                                dy_loc), device))
            ok = all(v < args.tol for v in errs.values())
            rows.append(dict(common, mode=mode, ranks=world, ms=ms, peak_gib=peak,
                             eff=single_local_ms / ms, speedup=single_global_ms / ms,
                             rel_out=errs["out"], rel_dx=errs["dx"], rel_param=errs["param"],
                             worst_param=worst_name, accurate=ok))
            del layer
        except Exception as exc:  # keep the other modes' figures; report the failure
            rows.append(dict(common, mode=mode, ranks=world,
                             error=f"{type(exc).__name__}: {exc}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if prediction is not None:
        measured = next((r["ms"] for r in rows if r.get("mode") == "p2p" and "ms" in r), None)
        rows.append(dict(common, mode="predicted", ranks=world, prediction=prediction,
                         measured_p2p_ms=measured))
    return rows


def predict_chain(args: argparse.Namespace, local_len: int, device: torch.device,
                  x_loc: torch.Tensor, base: torch.nn.Module, single_local_ms: float
                  ) -> dict[str, Any]:
    """Node costs on rank 0 (every rank runs them; rank 0's are kept), one state message,
    then the simulated chain for CP 2..32 (benchmarks/gdn_cp_nodes.py)."""
    if device.type != "cuda" or args.backend != "triton":
        raise SystemExit(f"--predict needs --device cuda and --backend triton, got "
                         f"{device.type}/{args.backend}")
    from benchmarks.gdn_cp_nodes import measure_node_costs, measure_state_message, predict

    layer_fwd_ms = timed_local_ms(lambda: base(x_loc), device)
    costs = measure_node_costs(layer_fwd_ms, single_local_ms, local_len, args.key_heads,
                               args.value_heads, args.head_dim, DTYPES[args.dtype], device)
    message_ms = measure_state_message(args.value_heads, args.head_dim, device)
    return {"node_ms": costs, "message_ms": message_ms,
            "rows": predict(costs, message_ms, [2, 4, 8, 16, 32], local_len)}


def format_prediction(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if r.get("mode") != "predicted":
            continue
        pr = r["prediction"]
        nodes = ", ".join(f"{k} {v:.3f}" for k, v in pr["node_ms"].items())
        lines.append(f"local {r['local_seq']}: node ms {nodes}; state message "
                     f"{pr['message_ms']:.3f} ms")
        cells = " | ".join(f"CP{x['cp']} {x['makespan_ms']:.2f} ms eff {x['eff']:.3f}"
                           for x in pr["rows"])
        measured = r.get("measured_p2p_ms")
        lines.append(f"  predicted (fused chain, weak scaling): {cells}"
                     + (f"; measured p2p CP{r['ranks']} {measured:.2f} ms" if measured else ""))
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]], tol: float) -> str:
    head = (f"{'local':>7} {'global':>7} {'mode':>13} {'ranks':>5} {'ms':>10} {'peak GiB':>9} "
            f"{'eff':>6} {'speedup':>8} {'rel out':>9} {'rel dx':>9} {'rel param':>9}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["mode"] == "predicted":
            continue
        pre = f"{r['local_seq']:>7} {r['seq']:>7} {r['mode']:>13} {r['ranks']:>5}"
        if "error" in r:
            lines.append(f"{pre}  ERROR {r['error']}")
            continue
        peak = f"{r['peak_gib']:>9.2f}" if r.get("peak_gib") is not None else f"{'-':>9}"
        speed = f"{r['speedup']:>8.2f}" if "speedup" in r else f"{'-':>8}"
        rel = "".join(f" {r[k]:>9.2e}" if k in r else f" {'-':>9}"
                      for k in ("rel_out", "rel_dx", "rel_param"))
        ok = "" if "accurate" not in r else ("  yes" if r["accurate"] else f"  NO (>= {tol:g})")
        lines.append(f"{pre} {r['ms']:>10.3f} {peak} {r['eff']:>6.2f} {speed}{rel}{ok}")
    return "\n".join(lines)


def run_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank's benchmark; the process group is already initialised (spawn or torchrun)."""
    device = rank_device(args.device, rank)
    mesh = init_device_mesh(device.type, (world,))
    rows: list[dict[str, Any]] = []
    for local_len in args.local_seq:
        rows += bench_length(args, local_len, device, mesh)
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> bool:
    meta = dict(device=args.device, ranks=world, backend=args.backend, dtype=args.dtype,
                hidden=args.hidden, key_heads=args.key_heads, value_heads=args.value_heads,
                head_dim=args.head_dim, batch=args.batch, decay=args.decay, modes=args.modes,
                tol=args.tol,
                warmup=args.warmup, iters=args.iters, smoke=args.smoke, torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    print(f"\nGDN layer CP, {meta}")
    print("time = median over iterations of the slowest rank, forward + backward of the layer;")
    print("eff = single_local / row (weak scaling), speedup = single_global / row;")
    print("rel-L2 against single_global (out, dx: this rank's rows; param: summed over ranks)\n")
    print(format_table(rows, args.tol))
    if any(r["mode"] == "predicted" for r in rows):
        print("\n" + format_prediction(rows))
    path = args.json or (os.path.join(os.environ["OUT"], "gdn_cp_gpu.json")
                         if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
        print(f"\nwrote {path}")
    return all(r.get("accurate", True) and "error" not in r for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        from overlap_runtime.launch import init_from_env

        ctx = init_from_env(device=args.device)
        ok = True
        try:
            rows = run_rank(ctx.rank, ctx.world_size, args)
            if ctx.rank == 0:
                ok = report(rows, args, ctx.world_size)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return 0 if ok else 1
    from overlap_runtime.launch import spawn

    results = spawn(run_rank, args.nproc, args=(args,), device=args.device,
                    timeout_s=max(600.0, 120.0 * len(args.local_seq)))
    return 0 if report(results[0], args, args.nproc) else 1


if __name__ == "__main__":
    sys.exit(main())
