"""The fused GDN forward against the kernel chain and flash-linear-attention, in one process.

Usage (on the GPU machine, fla-core 0.6.0 installed from the wheels, gpu/README.md):
    PYTHONPATH=$PWD python3 -m benchmarks.gdn_fused [--parts accuracy grad_accuracy profile table variants]
        [--rows b1_8k b1_16k b1_32k ...] [--budget-s 420]

Implementations (bf16, K = V = 128, l2norm in the op, random initial states, fp32 g):
``fla`` (fla-core 0.6.0 ``chunk_gated_delta_rule``, Hopper guard lifted for timing only),
``chain`` (our Triton backend, the five-kernel forward), ``fused`` (our Triton backend with
``fused_forward=True``: the chain's prep kernels, then the walks of fused_fwd.py; under
``no_grad`` the walks write nothing for a backward).

Parts, in the order given (default: accuracy profile table variants; each row guarded: a failure is printed and the rest runs; no new row starts
once ``--budget-s`` seconds have passed):
* ``accuracy``: rel-L2 against the float64 eager backend at full size: forward (o, final
  state) of every implementation at B=1 T=8K H=32 and T=32K H=16/HV=32, and the packed 64K row.
* ``grad_accuracy`` (not a default part: slow): forward and every gradient of ``chain`` and
  ``fused`` (and fla's, guard lifted) at B=1 T=8K H=16/HV=32.
* ``variants``: forward-only medians of the fused walks' launch choices at B=1 T=32K H=32
  (``--variants``: which; each with rel-L2 of o and the final state against the chain's).
* ``table``: forward (no_grad) and forward+backward medians (``do_bench``, median) and peak
  memory of fla / chain / fused in the issue's rows.
* ``profile``: per-kernel device times of one forward (no_grad) and of one forward +
  backward of chain, fused and fla at B=1 T=32K H=32.
Prints markdown tables last; writes ``$OUT/gdn_fused.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F


from overlap_runtime.ops.gdn import chunk_gated_delta_rule  # noqa: E402
from overlap_runtime.ops.gdn.triton.function import (  # noqa: E402
    chunk_gated_delta_rule_triton, gdn_forward)
from overlap_runtime.ops.gdn.triton.fused_fwd import FusedConfig  # noqa: E402
from overlap_runtime.testing import rel_l2  # noqa: E402

MiB = 2**20
NAMES = ("q", "k", "v", "g", "beta", "h0")
START = time.time()

# name: (B, T, H, HV, packed documents or 0)
ROWS = {
    "b1_8k": (1, 8192, 32, 32, 0),
    "b1_16k": (1, 16384, 32, 32, 0),
    "b1_32k": (1, 32768, 32, 32, 0),
    "b8_4k_h32": (8, 4096, 32, 32, 0),
    "b8_4k_gqa": (8, 4096, 16, 32, 0),
    "b1_32k_gqa": (1, 32768, 16, 32, 0),
    "b1_64k_gqa": (1, 65536, 16, 32, 0),
    "packed_64k": (1, 65536, 16, 32, 20),
    "b1_8k_gqa": (1, 8192, 16, 32, 0),  # the gradient check's row
}
TABLE_ROWS = [r for r in ROWS if r != "b1_8k_gqa"]


def documents(tokens: int, count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` lengths, log-uniform in ``[low, high]``, rescaled to sum to ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(math.log(low) + torch.rand(count, generator=gen)
                    * (math.log(high) - math.log(low)))
    lens = (raw / raw.sum() * tokens).round().long().clamp(min=1)
    lens[-1] += tokens - int(lens.sum())
    return lens.tolist()


def make_row(name: str, device: torch.device, seed: int = 0
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    batch, seq_len, heads, value_heads, docs = ROWS[name]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    cu = None
    states = batch
    if docs:
        lens = documents(seq_len, docs, 290, 12567, seed)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device,
                          dtype=torch.int32)
        states = len(lens)
    x = {
        "q": randn(batch, seq_len, heads, 128).bfloat16(),
        "k": randn(batch, seq_len, heads, 128).bfloat16(),
        "v": randn(batch, seq_len, value_heads, 128).bfloat16(),
        "g": F.logsigmoid(randn(batch, seq_len, value_heads) + 2.0),
        "beta": torch.sigmoid(randn(batch, seq_len, value_heads)).bfloat16(),
        "h0": randn(states, value_heads, 128, 128),
    }
    return x, cu


def impl(name: str, config: FusedConfig | None = None, segments: int | None = None
         ) -> Callable:
    """``fn(q, k, v, g, beta, h0, cu) -> (o, final)``."""
    if name == "fla":
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        # fla 0.6.0 refuses its gated backward on Hopper with triton in [3.4, 3.7.1)
        # (gpu/README.md); lifted for timing, its gradients are reported, not trusted
        chunk_o.TRITON_ABOVE_3_7_1 = True

        def run(q, k, v, g, beta, h0, cu):
            return fla_gdn(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                           output_final_state=True, use_qk_l2norm_in_kernel=True,
                           cu_seqlens=cu)
        return run
    if name == "fused_cfg":
        def run(q, k, v, g, beta, h0, cu):
            o, final, _, _ = gdn_forward(q, k, v, g, beta, h0, q.shape[-1] ** -0.5, True,
                                         segments,
                                         cu_seqlens=cu, fused=True, save=False,
                                         fused_config=config)
            return o, final
        return run
    fused = name == "fused"

    def run(q, k, v, g, beta, h0, cu):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, q.shape[-1] ** -0.5, h0, True,
                                             None, cu_seqlens=cu, fused_forward=fused)
    return run


def over_budget(args: argparse.Namespace) -> bool:
    return time.time() - START > args.budget_s


def reference(x: dict[str, torch.Tensor], cu: torch.Tensor | None, grads: bool,
              do: torch.Tensor | None = None, dh: torch.Tensor | None = None
              ) -> dict[str, torch.Tensor]:
    """float64 eager backend: o, final state (and input gradients with ``grads``)."""
    leaves = {n: t.detach().double().requires_grad_(grads) for n, t in x.items()}
    with torch.set_grad_enabled(grads):
        o, h = chunk_gated_delta_rule(*(leaves[n] for n in NAMES[:5]), initial_state=leaves["h0"],
                                      output_final_state=True, cu_seqlens=cu, backend="eager")
        out = {"o": o.detach(), "final": h.detach()}
        if grads:
            torch.autograd.backward((o, h), (do.double(), dh.double()))
            out.update({"d" + n: leaves[n].grad for n in NAMES})
    return out


def run_impl(fn: Callable, x: dict[str, torch.Tensor], cu: torch.Tensor | None, grads: bool,
             do: torch.Tensor | None = None, dh: torch.Tensor | None = None
             ) -> dict[str, torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_(grads) for n, t in x.items()}
    with torch.set_grad_enabled(grads):
        o, h = fn(*(leaves[n] for n in NAMES), cu)
        out = {"o": o.detach(), "final": h.detach()}
        if grads:
            torch.autograd.backward((o, h), (do, dh))
            out.update({"d" + n: leaves[n].grad for n in NAMES})
    return out


def accuracy(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    fwd_cases = [("b1_8k", ("fla", "chain", "fused")),
                 ("b1_32k_gqa", ("fla", "chain", "fused")),
                 ("packed_64k", ("fla", "chain", "fused"))]
    for case, names in fwd_cases:
        if over_budget(args):
            break
        try:
            x, cu = make_row(case, device, seed=11)
            ref = reference(x, cu, grads=False)
            for name in names:
                got = run_impl(impl(name), x, cu, grads=False)
                row = {"case": case, "impl": name, "pass": "fwd",
                       **{t: rel_l2(got[t], ref[t]) for t in ("o", "final")},
                       "finite": all(bool(torch.isfinite(v).all()) for v in got.values())}
                print(json.dumps(row), flush=True)
                rows.append(row)
            del ref, x
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"case": case, "error": f"{type(error).__name__}: {error}"})
        torch.cuda.empty_cache()
    return rows


def grad_accuracy(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Every gradient of fla, the chain and the fused forward's saved set (through the
    unchanged backward) against the float64 eager backend at B=1 T=8K H=16/HV=32. Slow: on an H100
    this part (the float64 reference with gradients and three first compiles of a backward)
    did not finish in about four minutes, so it is not in the default parts (tests/ops/test_gdn_triton_fused.py -k gpu checks the gradients at
    T=4K against fp32)."""
    rows = []
    for case in ("b1_8k_gqa",):
        if over_budget(args):
            break
        try:
            x, cu = make_row(case, device, seed=12)
            gen = torch.Generator(device=device).manual_seed(13)
            do = torch.randn(x["v"].shape, generator=gen, device=device).bfloat16()
            dh = torch.randn(x["h0"].shape, generator=gen, device=device)
            ref = reference(x, cu, True, do, dh)
            for name in ("fla", "chain", "fused"):
                got = run_impl(impl(name), x, cu, True, do, dh)
                row = {"case": case, "impl": name, "pass": "fwd+bwd",
                       **{t: rel_l2(got[t], ref[t]) for t in got},
                       "finite": all(bool(torch.isfinite(v).all()) for v in got.values())}
                print(json.dumps(row), flush=True)
                rows.append(row)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"case": case, "error": f"{type(error).__name__}: {error}"})
        torch.cuda.empty_cache()
    return rows


def timing(fn: Callable, x: dict[str, torch.Tensor], cu: torch.Tensor | None,
           backward: bool = True) -> dict[str, float]:
    from triton.testing import do_bench

    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    args = [leaves[n] for n in NAMES]
    grads = list(leaves.values())
    with torch.no_grad():
        fn(*args, cu)  # compile outside the timings
        t_fwd = do_bench(lambda: fn(*args, cu), warmup=25, rep=100, return_mode="median")
    out = {"fwd_ms": t_fwd}
    if not backward:
        return out
    o, h = fn(*args, cu)
    do, dh = torch.randn_like(o), torch.randn_like(h)

    def fwd_bwd() -> None:
        o, h = fn(*args, cu)
        torch.autograd.backward((o, h), (do, dh))

    fwd_bwd()
    torch.cuda.synchronize()
    for t in grads:
        t.grad = None
    del o, h
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MiB
    out["fwd_bwd_ms"] = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=grads,
                                 return_mode="median")
    return out


# name: (launch choices, segments per sequence or None for the default)
VARIANTS = {
    "default": (FusedConfig(), None),
    "walk_w8": (FusedConfig(walk_warps=8, summary_warps=8), None),
    "summary_s1": (FusedConfig(summary_stages=1), None),
    "walk_s2": (FusedConfig(walk_stages=2), None),  # the default before 2026-12-07
    "bv32": (FusedConfig(block=32), None),
    "ns1": (FusedConfig(), 1),
    "ns1_bv32": (FusedConfig(block=32), 1),
    "ns2": (FusedConfig(), 2),
    "ns8_bv32": (FusedConfig(block=32), 8),
}


def variants(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Forward-only medians of the fused walks' launch choices at B=1 T=32K H=32, each
    with rel-L2 of o and the final state against the chain's (a miscompile shows here)."""
    rows = []
    x, cu = make_row("b1_32k", device)
    with torch.no_grad():
        base = impl("chain")(*(x[n] for n in NAMES), cu)
    for name, (cfg, segments) in VARIANTS.items():
        if name not in args.variants or over_budget(args):
            continue
        try:
            t0 = time.time()
            fn = impl("fused_cfg", cfg, segments)
            with torch.no_grad():
                o, h = fn(*(x[n] for n in NAMES), cu)
            errs = {"o_vs_chain": rel_l2(o, base[0]), "final_vs_chain": rel_l2(h, base[1])}
            del o, h
            r = timing(fn, x, cu, backward=False)
            row = {"variant": name, **r, **errs, "first_call_s": time.time() - t0}
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            row = {"variant": name, "error": f"{type(error).__name__}: {error}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


TABLE_HEADER = ("| case | fla fwd | chain fwd | fused fwd | fused/fla fwd | fla f+b | chain f+b "
                "| fused f+b | fused/fla f+b | peak MiB fla / chain / fused |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table_line(r: dict[str, Any]) -> str:
    """One markdown row of the table from one row's timings (nan where a part is missing)."""
    def get(n: str, k: str) -> float:
        return r.get(n, {}).get(k, float("nan"))
    return (f"| {r['case']} | {get('fla', 'fwd_ms'):.2f} | {get('chain', 'fwd_ms'):.2f} | "
            f"{get('fused', 'fwd_ms'):.2f} | {get('fused', 'fwd_ms') / get('fla', 'fwd_ms'):.2f} | "
            f"{get('fla', 'fwd_bwd_ms'):.2f} | {get('chain', 'fwd_bwd_ms'):.2f} | "
            f"{get('fused', 'fwd_bwd_ms'):.2f} | "
            f"{get('fused', 'fwd_bwd_ms') / get('fla', 'fwd_bwd_ms'):.2f} | "
            f"{get('fla', 'peak_mib'):.0f} / {get('chain', 'peak_mib'):.0f} / "
            f"{get('fused', 'peak_mib'):.0f} |")


def table(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """fla, the chain and the fused forward per row; each row's json and markdown line are
    printed as soon as the row is done (a command cut short by its time limit keeps them)."""
    rows = []
    for case in args.rows:
        if over_budget(args):
            print(f"budget: {case} and later rows skipped", flush=True)
            break
        x, cu = make_row(case, device)
        row: dict[str, Any] = {"case": case}
        for name in ("fla", "chain", "fused"):
            try:
                row[name] = timing(impl(name), x, cu)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                row[name] = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(row), flush=True)
        print(table_line(row), flush=True)
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def profile(args: argparse.Namespace, device: torch.device) -> dict[str, str]:
    from benchmarks._timing import profile_kernels

    out = {}
    x, cu = make_row("b1_32k", device)
    args_ = [x[n] for n in NAMES]
    gen = torch.Generator(device=device).manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen, device=device).to(x["v"].dtype)
    dh = torch.randn(x["h0"].shape, generator=gen, device=device)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in args_]
    for name in ("chain", "fused", "fla"):
        if over_budget(args):
            break
        fn = impl(name)

        def fwd_bwd() -> None:
            o, h = fn(*leaves, cu)
            torch.autograd.backward((o, h), (do, dh))
            for t in leaves:
                t.grad = None

        with torch.no_grad():
            fn(*args_, cu)  # compile and autotune outside the profile
            text = profile_kernels(lambda: fn(*args_, cu), device, iters=3, top=12)
        print(f"--- {name}, forward, B=1 T=32K H=32\n{text}", flush=True)
        fwd_bwd()
        text_b = profile_kernels(fwd_bwd, device, iters=3, top=20)
        print(f"--- {name}, forward + backward, B=1 T=32K H=32\n{text_b}", flush=True)
        out[name], out[name + "_fwd_bwd"] = text, text_b
    return out


def resources() -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled fused walk in this process."""
    from overlap_runtime.ops.gdn.triton.fused_fwd import fused_walk_kernel

    rows = []
    for fn in (fused_walk_kernel,):
        for caches in getattr(fn, "device_caches", {}).values():
            for kernel in caches[0].values():
                try:
                    kernel._init_handles()
                    md = kernel.metadata
                    rows.append({"kernel": fn.fn.__name__, "warps": md.num_warps,
                                 "stages": md.num_stages, "regs": kernel.n_regs,
                                 "spills": kernel.n_spills, "shared": md.shared})
                except Exception as error:  # noqa: BLE001
                    rows.append({"error": f"{type(error).__name__}: {error}"})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["accuracy", "profile", "table", "variants"],
                   choices=["accuracy", "grad_accuracy", "variants", "table", "profile"])
    p.add_argument("--rows", nargs="+", default=TABLE_ROWS, choices=list(ROWS))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    results: dict[str, Any] = {}
    for part in args.parts:
        if over_budget(args):
            print(f"budget: part {part} skipped", flush=True)
            continue
        results[part] = globals()[part](args, device)
        print(f"[{time.time() - START:.0f} s] {part} done", flush=True)
    results["resources"] = resources()
    for r in results["resources"]:
        print("fused kernel:", json.dumps(r))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gdn_fused.json").write_text(json.dumps(results, indent=1))
    checks = results.get("accuracy", []) + results.get("grad_accuracy", [])
    if checks:
        print("\n| case | impl | pass | rel-L2 vs float64 |")
        print("| --- | --- | --- | --- |")
        for r in checks:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in r.items()
                             if isinstance(v, float))
            print(f"| {r.get('case')} | {r.get('impl')} | {r.get('pass')} | "
                  f"{errs or r.get('error')} |")
    if "variants" in results:
        print("\n| variant (B=1 T=32K H=32) | fwd ms | o / final rel-L2 vs chain |")
        print("| --- | --- | --- |")
        for r in results["variants"]:
            print(f"| {r['variant']} | {r.get('fwd_ms', r.get('error'))} | "
                  f"{r.get('o_vs_chain', float('nan')):.1e} / "
                  f"{r.get('final_vs_chain', float('nan')):.1e} |")
    if "table" in results:
        print("\n" + TABLE_HEADER)
        for r in results["table"]:
            print(table_line(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
