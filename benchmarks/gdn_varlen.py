"""The fla drop-in and packed variable-length GDN on one GPU: same results as fla, and speed.

Usage (on the H200, with fla-core 0.6.0 from the wheels, gpu/README.md):
    PYTHONPATH=$PWD python3 -m benchmarks.gdn_varlen [--tokens 65536] [--seed 0] [--no-equality]
        [--cases training packed long] [--profile]

1. **Drop-in equality**: the same call through ``overlap_runtime.ops.gdn.fla_compat`` and through
   fla's ``chunk_gated_delta_rule`` (its Hopper guard lifted: the gradient comparison is what
   tells whether fla's own backward is right here), on bf16 inputs: dense (B=2, T=2048) and
   packed (``cu_seqlens``, B=1), ``use_qk_l2norm_in_kernel`` False and True, H=16 / HV=32 value
   heads, with initial and final states. Reported: rel-L2 of o, the final state and every
   gradient between the two, and of each against the fp32 eager backend (the independent
   reference) on the same bf16-valued inputs.
2. **Speed**, ``triton.testing.do_bench`` medians after a warm-up call, forward and
   forward+backward, peak memory of one forward+backward:
   - packed: ``--tokens`` tokens of documents with lengths drawn uniformly from 256..16K (the
     last one cut to fit), H=HV=32, K=V=128;
   - the training geometry: B=8, T=4K, H=16 / HV=32; and B=1, T=32K, H=16 / HV=32.

Prints tables and writes ``$OUT/gdn_varlen.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F


from benchmarks.gdn_kernels import load_fla  # noqa: E402  (lifts fla's Hopper guard)

from overlap_runtime.ops.gdn import fla_compat  # noqa: E402
from overlap_runtime.testing import rel_l2  # noqa: E402

MiB = 2**20


def documents(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Document lengths drawn uniformly from ``[low, high]``, summing to ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(torch.randint(low, high + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def inputs(batch: int, seq_len: int, heads: int, value_heads: int, dim: int, states: int,
           device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    return {
        "q": randn(batch, seq_len, heads, dim).bfloat16(),
        "k": randn(batch, seq_len, heads, dim).bfloat16(),
        "v": randn(batch, seq_len, value_heads, dim).bfloat16(),
        "g": F.logsigmoid(randn(batch, seq_len, value_heads) + 2.0),
        "beta": torch.sigmoid(randn(batch, seq_len, value_heads)).bfloat16(),
        "h0": randn(states, value_heads, dim, dim) * 0.1,
    }


def call(fn: Callable, x: dict[str, torch.Tensor], cu: torch.Tensor | None, l2: bool,
         **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
              output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, **extra)


def with_grads(fn: Callable, x: dict[str, torch.Tensor], cu: torch.Tensor | None, l2: bool,
               seed: int, **extra: Any) -> dict[str, torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, h = call(fn, leaves, cu, l2, **extra)
    gen = torch.Generator(device=o.device).manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype)
    dh = torch.randn(h.shape, generator=gen, device=o.device)
    torch.autograd.backward((o, h), (do, dh))
    out = {"o": o.detach().float(), "state": h.detach().float()}
    out.update({f"d{n}": t.grad.float() for n, t in leaves.items()})
    return out


def equality(fla_fn: Callable, device: torch.device, seed: int) -> list[dict[str, Any]]:
    rows = []
    lens = [1, 63, 64, 65, 700, 1157]
    cases = [("dense B=2 T=2048", 2, 2048, None), ("packed " + "/".join(map(str, lens)), 1,
                                                   sum(lens), lens)]
    for name, batch, t, docs in cases:
        for l2 in (False, True):
            states = batch if docs is None else len(docs)
            x = inputs(batch, t, 16, 32, 128, states, device, seed)
            if not l2:  # unit-norm keys, as a caller normalising outside passes (raw Gaussian
                for n in ("q", "k"):  # keys, |k|^2 = 128, make the recurrence diverge)
                    x[n] = F.normalize(x[n].float(), dim=-1).bfloat16()
            cu = None if docs is None else torch.tensor(
                [0, *torch.tensor(docs).cumsum(0).tolist()], device=device, dtype=torch.int32)
            ours = with_grads(fla_compat.chunk_gated_delta_rule, x, cu, l2, seed)
            theirs = with_grads(fla_fn, x, cu, l2, seed)
            ref = with_grads(fla_compat.chunk_gated_delta_rule,
                             {n: v.float() for n, v in x.items()}, cu, l2, seed,
                             backend="eager")
            for key in ours:
                rows.append({"case": name, "l2norm": l2, "tensor": key,
                             "ours_vs_fla": rel_l2(ours[key], theirs[key]),
                             "ours_vs_fp32": rel_l2(ours[key], ref[key]),
                             "fla_vs_fp32": rel_l2(theirs[key], ref[key]),
                             "finite": bool(torch.isfinite(ours[key]).all())})
    return rows


def timing(fn: Callable, x: dict[str, torch.Tensor], cu: torch.Tensor | None,
           profile: str | None = None) -> dict[str, float]:
    """Medians of forward and forward+backward, peak memory; with ``profile`` (a label) also
    the per-kernel device times of one forward+backward, printed and appended to
    ``$OUT/gdn_varlen_profile.txt``."""
    from triton.testing import do_bench

    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    grads = list(leaves.values())
    o, h = call(fn, leaves, cu, True)
    do, dh = torch.randn_like(o), torch.randn_like(h)

    def fwd_bwd() -> None:
        o, h = call(fn, leaves, cu, True)
        torch.autograd.backward((o, h), (do, dh))

    fwd_bwd()
    torch.cuda.synchronize()
    for t in grads:
        t.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MiB
    with torch.no_grad():
        t_f = do_bench(lambda: call(fn, leaves, cu, True), warmup=25, rep=100,
                       return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    if profile is not None:
        from benchmarks._timing import profile_kernels, write_out

        text = f"{profile}\n" + profile_kernels(fwd_bwd, o.device, iters=3, top=24)
        print(text, flush=True)
        write_out("gdn_varlen_profile.txt", text)
    return {"fwd_ms": t_f, "fwd_bwd_ms": t_fb, "peak_mib": peak}


CASES = ("training", "packed", "long")


def speed(fla_fn: Callable | None, tokens: int, device: torch.device, seed: int,
          cases: tuple[str, ...] = CASES, profile: bool = False) -> list[dict[str, Any]]:
    """The speed rows, each printed as it completes (a failing row is reported, the rest run)."""
    docs = documents(tokens, 256, 16384, seed)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=device,
                      dtype=torch.int32)
    geometries = {
        "training": ("B=8 T=4K H=16 HV=32", 8, 4096, 16, 32, None),
        "packed": (f"packed {tokens} tokens, {len(docs)} docs 256..16K, H=HV=32", 1, tokens, 32,
                   32, cu),
        "long": ("B=1 T=32K H=16 HV=32", 1, 32768, 16, 32, None),
    }
    rows = []
    for case in cases:
        name, batch, t, h, hv, c = geometries[case]
        states = batch if c is None else len(docs)
        x = inputs(batch, t, h, hv, 128, states, device, seed)
        row: dict[str, Any] = {"case": name}
        try:
            row["ours"] = timing(fla_compat.chunk_gated_delta_rule, x, c,
                                 f"ours, {name}" if profile else None)
            if fla_fn is not None:
                row["fla"] = timing(fla_fn, x, c, f"fla, {name}" if profile else None)
                row["ratio_fwd"] = row["ours"]["fwd_ms"] / row["fla"]["fwd_ms"]
                row["ratio_fwd_bwd"] = row["ours"]["fwd_bwd_ms"] / row["fla"]["fwd_bwd_ms"]
        except Exception as error:  # noqa: BLE001 - one failure must not stop the rest
            row["error"] = f"{type(error).__name__}: {error}"
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   help="speed cases, in this order (training: B=8 T=4K H=16/HV=32; packed: "
                        "--tokens of documents; long: B=1 T=32K H=16/HV=32)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel device times of one forward+backward per case and impl")
    p.add_argument("--no-equality", action="store_true",
                   help="speed only (the equality rows are also tests/ops/test_gdn_fla_compat.py's "
                        "GPU test)")
    args = p.parse_args()
    device = torch.device("cuda")
    fla_fn, label = load_fla()
    print(label, flush=True)
    if fla_fn is None:
        return 1
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_raw

    eq = [] if args.no_equality else equality(fla_raw, device, args.seed)
    if eq:
        print("\n| case | l2norm | tensor | ours vs fla | ours vs fp32 | fla vs fp32 | finite |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in eq:
            print(f"| {r['case']} | {r['l2norm']} | {r['tensor']} | {r['ours_vs_fla']:.2e} | "
                  f"{r['ours_vs_fp32']:.2e} | {r['fla_vs_fp32']:.2e} | {r['finite']} |",
                  flush=True)
    sp = speed(fla_raw, args.tokens, device, args.seed, tuple(args.cases), args.profile)
    print("\n| case | ours fwd | fla fwd | ratio | ours fwd+bwd | fla fwd+bwd | ratio | "
          "peak MiB ours / fla |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sp:
        if "error" in r:
            print(f"| {r['case']} | ERROR {r['error'][:100]} |")
            continue
        o, f = r["ours"], r["fla"]
        print(f"| {r['case']} | {o['fwd_ms']:.2f} | {f['fwd_ms']:.2f} | {r['ratio_fwd']:.2f} | "
              f"{o['fwd_bwd_ms']:.2f} | {f['fwd_bwd_ms']:.2f} | {r['ratio_fwd_bwd']:.2f} | "
              f"{o['peak_mib']:.0f} / {f['peak_mib']:.0f} |")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gdn_varlen.json").write_text(json.dumps({"equality": eq, "speed": sp},
                                                           indent=1))
    return 1 if any("error" in r for r in sp) else 0


if __name__ == "__main__":
    raise SystemExit(main())
