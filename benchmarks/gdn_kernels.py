"""GDN Triton kernels on one GPU: speed against flash-linear-attention and eager, and accuracy.

Usage (on the H200; fla-core is optional, see gpu/README.md for the wheels):
    PYTHONPATH=$PWD python3 -m benchmarks.gdn_kernels [--quick] [--seq-lens 8192 16384 ...]
        [--heads 32] [--key-heads 16] [--dim 128] [--num-segments N ...] [--profile [T ...]]
        [--no-fla] [--no-eager] [--no-accuracy]

Speed: B=1, HV=32 value heads (``--heads``), H key heads (``--key-heads``, default HV: grouped
heads with fewer), K=V=128, bf16 q/k/v/beta, fp32 g, random initial state, l2norm of q and k
inside the op, chunk 64. For each implementation and T: forward, backward and forward+backward
medians of ``triton.testing.do_bench(..., return_mode="median")`` after a warm-up call (the
compile and autotune stay outside), on random inputs; peak memory of one forward+backward above
what was allocated before it. Implementations: ``triton`` (ours, ``backend="triton"``),
``fla`` (fla-core's ``chunk_gated_delta_rule``, if importable, with its Hopper guard lifted
for timing only), ``eager`` (``backend="eager"``, only at T <= 16K: it is slow).

Accuracy: bf16 inputs through ``backend="triton"`` against the fp32 eager backend on the same
(bf16-valued) inputs at T = 8K, 16K, 32K (8K with --quick): rel-L2 of o, the final state, dH0
and dq, dk, dv, dg, dbeta, with random dO and dHT; every tensor must be finite and every rel-L2
below 1e-2. Each row is caught on its own: a failure is reported and the rest still runs.

Prints a table last and writes ``$OUT/gdn_kernels.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

from overlap_runtime.ops.gdn import chunk_gated_delta_rule
from overlap_runtime.ops.gdn.backend import TritonBackend
from overlap_runtime.testing import rel_l2

MiB = 2**20
NAMES = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(seq_len: int, heads: int, dim: int, device: torch.device, seed: int = 0,
                key_heads: int | None = None) -> dict[str, torch.Tensor]:
    """Random inputs: ``heads`` value heads, ``key_heads`` (default ``heads``) q/k heads."""
    kh = heads if key_heads is None else key_heads
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    return {
        "q": randn(1, seq_len, kh, dim).bfloat16(),
        "k": randn(1, seq_len, kh, dim).bfloat16(),
        "v": randn(1, seq_len, heads, dim).bfloat16(),
        "g": F.logsigmoid(randn(1, seq_len, heads) + 2.0),
        "beta": torch.sigmoid(randn(1, seq_len, heads)).bfloat16(),
        "h0": randn(1, heads, dim, dim),
    }


def cotangents(x: dict[str, torch.Tensor], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=x["v"].device).manual_seed(seed)
    do = torch.randn(x["v"].shape, generator=gen, device=x["v"].device).to(x["v"].dtype)
    dht = torch.randn(x["h0"].shape, generator=gen, device=x["v"].device)
    return do, dht


def ours(num_segments: int | None) -> Callable:
    backend = TritonBackend(num_segments)

    def run(q, k, v, g, beta, h0):
        return backend.forward(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                               use_qk_l2norm=True, chunk_size=64)
    return run


def eager(q, k, v, g, beta, h0):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  backend="eager")


def load_fla() -> tuple[Callable | None, str]:
    try:
        import fla  # noqa: F401
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except Exception as error:  # noqa: BLE001 - report why and carry on without it
        return None, f"fla not importable: {type(error).__name__}: {error}"
    # fla 0.6.0 refuses its gated backward on Hopper with triton in [3.4, 3.7.1) (a miscompile,
    # gpu/README.md); lift the guard for timing only - its gradients are not checked here.
    chunk_o.TRITON_ABOVE_3_7_1 = True

    def run(q, k, v, g, beta, h0):
        return fla_gdn(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    return run, f"fla {getattr(fla, '__version__', '?')}"


def time_impl(fn: Callable, x: dict[str, torch.Tensor], warmup_only: bool = False) -> dict:
    from triton.testing import do_bench

    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    args = [leaves[n] for n in NAMES]
    grads = list(leaves.values())
    do, dht = cotangents(x)

    def fwd():
        return fn(*args)

    def fwd_bwd():
        o, h = fn(*args)
        torch.autograd.backward((o, h), (do, dht))

    fwd_bwd()  # compile and autotune outside the timings
    torch.cuda.synchronize()
    for t in grads:
        t.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MiB
    for t in grads:
        t.grad = None
    with torch.no_grad():
        t_fwd = do_bench(fwd, warmup=25, rep=100, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    o, h = fn(*args)

    def bwd():
        torch.autograd.backward((o, h), (do, dht), retain_graph=True)
    t_bwd = do_bench(bwd, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    return {"fwd_ms": t_fwd, "bwd_ms": t_bwd, "fwd_bwd_ms": t_fb, "peak_mib": peak}


def autotuned() -> dict[str, list[str]]:
    """The configuration the autotuner picked for each key of every autotuned GDN kernel."""
    from overlap_runtime.ops.gdn.triton import (bwd_chunk, bwd_state, fwd_output, fwd_prepare,
                                                fwd_state)

    out = {}
    for module in (fwd_prepare, fwd_state, fwd_output, bwd_state, bwd_chunk):
        for name, kernel in sorted(vars(module).items()):
            cache = getattr(kernel, "cache", None)
            if name.endswith("_kernel") and isinstance(cache, dict):
                out[name] = [f"{key}: {cfg}" for key, cfg in cache.items()]
    return out


def profile_fwd_bwd(fn: Callable, x: dict[str, torch.Tensor]) -> str:
    """Per-kernel device time of one forward+backward (benchmarks/_timing.py)."""
    from benchmarks._timing import profile_kernels

    leaves = [x[n].detach().clone().requires_grad_() for n in NAMES]
    do, dht = cotangents(x)

    def fwd_bwd():
        o, h = fn(*leaves)
        torch.autograd.backward((o, h), (do, dht))
        for t in leaves:
            t.grad = None
    return profile_kernels(fwd_bwd, x["v"].device, iters=3, top=24)


def accuracy(seq_len: int, heads: int, dim: int, device: torch.device,
             num_segments: int | None, key_heads: int | None = None) -> dict:
    x = make_inputs(seq_len, heads, dim, device, seed=2, key_heads=key_heads)
    x["h0"] = x["h0"] * 0.5
    do, dht = cotangents(x, seed=3)
    results = {}
    for tag, cast in (("triton", lambda t: t), ("eager", lambda t: t.float())):
        leaves = {n: cast(t.detach().clone()).requires_grad_() for n, t in x.items()}
        fn = ours(num_segments) if tag == "triton" else eager
        o, h = fn(*(leaves[n] for n in NAMES))
        torch.autograd.backward((o, h), (do.to(o.dtype), dht))
        results[tag] = {"o": o.detach(), "final_state": h.detach(),
                        **{"d" + n: leaves[n].grad for n in NAMES}}
        del o, h, leaves
        torch.cuda.empty_cache()
    errors = {name: rel_l2(results["triton"][name], results["eager"][name])
              for name in results["eager"]}
    finite = all(torch.isfinite(t).all().item() for t in results["triton"].values())
    return {"errors": errors, "finite": finite,
            "ok": finite and all(e < 1e-2 for e in errors.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=8K and 16K, accuracy at 8K only")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=32, help="value heads")
    parser.add_argument("--key-heads", type=int, default=None,
                        help="q/k heads (a divisor of --heads; default: --heads)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--num-segments", type=int, nargs="+", default=[0],
                        help="segments of our parallel state scan; several values give one "
                             "'triton-nsN' row each (0: chosen from the machine)")
    parser.add_argument("--profile", type=int, nargs="*", default=None,
                        help="per-kernel device times of one forward+backward per impl at these "
                             "T (none given: every T), to stdout and $OUT/gdn_kernels_profile.txt")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--no-accuracy", action="store_true")
    args = parser.parse_args()
    if args.key_heads is not None and (args.key_heads < 1 or args.heads % args.key_heads):
        parser.error(f"--key-heads {args.key_heads} must be a positive divisor of --heads "
                     f"{args.heads}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    seq_lens = args.seq_lens or ([8192, 16384] if args.quick else [8192, 16384, 32768, 65536])
    acc_lens = [8192] if args.quick else [n for n in (8192, 16384, 32768)]
    import triton
    segs = [None if n == 0 else n for n in args.num_segments]
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "heads": args.heads,
                    "key_heads": args.key_heads or args.heads, "dim": args.dim,
                    "num_segments": segs, "speed": [], "accuracy": []}
    impls: dict[str, Callable] = {("triton" if n is None else f"triton-ns{n}"): ours(n)
                                  for n in segs}
    if not args.no_fla:
        fla_fn, note = load_fla()
        report["fla"] = note
        print(note, flush=True)
        if fla_fn is not None:
            impls["fla"] = fla_fn
    if not args.no_eager:
        impls["eager"] = eager

    for seq_len in seq_lens:
        x = make_inputs(seq_len, args.heads, args.dim, device, key_heads=args.key_heads)
        for name, fn in impls.items():
            if name == "eager" and seq_len > 16384:
                continue
            row = {"impl": name, "T": seq_len}
            try:
                row.update(time_impl(fn, x))
            except Exception as error:  # noqa: BLE001 - one failure must not stop the rest
                row["error"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
            report["speed"].append(row)
            print(json.dumps(row), flush=True)
            if (args.profile is not None and (not args.profile or seq_len in args.profile)
                    and "error" not in row):
                text = f"{name} T={seq_len} forward+backward\n" + profile_fwd_bwd(fn, x)
                print(text, flush=True)
                if os.environ.get("OUT"):
                    with open(os.path.join(os.environ["OUT"], "gdn_kernels_profile.txt"),
                              "a") as f:
                        f.write(text + "\n\n")
            torch.cuda.empty_cache()
        del x

    report["autotuned"] = autotuned()
    for name, picks in report["autotuned"].items():
        print(f"autotuned {name}: {picks}", flush=True)

    if not args.no_accuracy:
        for seq_len in acc_lens:
            row = {"T": seq_len}
            try:
                row.update(accuracy(seq_len, args.heads, args.dim, device, segs[0],
                                    args.key_heads))
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {error}"
                row["ok"] = False
                traceback.print_exc()
            report["accuracy"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()

    print(f"\nGDN kernels, {report['device']}, torch {report['torch']}, triton "
          f"{report['triton']}, B=1 H={args.key_heads or args.heads} HV={args.heads} "
          f"K=V={args.dim} bf16")
    print(f"{'impl':8} {'T':>6} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'peak MiB':>9} "
          f"{'f+b vs fla':>10} {'f+b vs eager':>12}")
    by_key = {(r["impl"], r["T"]): r for r in report["speed"]}
    for r in report["speed"]:
        if "error" in r:
            print(f"{r['impl']:8} {r['T']:>6} ERROR {r['error'][:80]}")
            continue
        ratios = []
        for other in ("fla", "eager"):
            ref = by_key.get((other, r["T"]))
            if r["impl"].startswith("triton") and ref and "fwd_bwd_ms" in ref:
                ratios.append(f"{ref['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x")
            else:
                ratios.append("")
        print(f"{r['impl']:8} {r['T']:>6} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
              f"{r['fwd_bwd_ms']:8.3f} {r['peak_mib']:9.0f} {ratios[0]:>10} {ratios[1]:>12}")
    for r in report["accuracy"]:
        if "error" in r:
            print(f"accuracy T={r['T']}: ERROR {r['error'][:100]}")
            continue
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        print(f"accuracy T={r['T']}: {'PASS' if r['ok'] else 'FAIL'} (finite={r['finite']}, "
              f"worst {worst[0]} {worst[1]:.2e}) "
              + " ".join(f"{k}={v:.1e}" for k, v in r["errors"].items()))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gdn_kernels.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")
    failed = any("error" in r for r in report["speed"]) or any(
        not r.get("ok") for r in report["accuracy"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
