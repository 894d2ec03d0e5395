"""Predict p2p GDN context-parallel efficiency at CP 2..64 from node costs measured on this CPU.

Usage:
    .venv/bin/python -m benchmarks.gdn_cp_predict [--local-seq 2048] [--key-heads 2]
        [--value-heads 4] [--dim 64] [--threads 1] [--repeats 7]
        [--latency-us 10] [--bandwidth-gbs 25] [--cp 2 4 8 16 32 64] [--keep-denormals]

1. Measures, on one process (eager backend, fp32, B=1, chunk 64), the median time of each node
   cost of the eager chain (``context_parallel/gdn/step_costs.py``) on a shard of
   ``--local-seq`` tokens - the same calls ``gdn.p2p.GDNStateChain`` makes:
       gdn_prepare      prepare_chunks                       (no grad)
       gdn_summary      summarize(prep)                      (tree over chunks)
       gdn_apply        M @ H_in + S
       gdn_output       chunk_output(prep, H_in)             (scan + outputs)
       gdn_output_bwd   chunk_gated_delta_rule from H_in + autograd.grad (local backward)
       gdn_apply_bwd    M^T dH_out + dH_in_local
       gdn_summary_bwd  prepare + summarize under autograd + autograd.grad of (M, S)
2. Prices a state message (``B * HV * K * V * 4`` bytes) with ``--latency-us`` and
   ``--bandwidth-gbs`` (defaults: an inter-GPU link, not this CPU).
3. Prices the compiled step of one GDN layer (``stepgraph.compile_step``,
   ``benchmarks/gdn_chain_step.py``) with those costs and simulates its forward + backward for
   each CP size (weak scaling: every rank holds ``--local-seq`` tokens) and prints the
   makespan and the efficiency
   ``T_1(P * L) / (P * T_P)``, where ``T_1(P * L) = P * (prepare + output + output_bwd)`` is one
   device running the whole sequence with the same eager backend (its cost is linear in length).

Denormals: products of many decays (M, and state gradients walking back through the decays)
fall below fp32's normal range; x86 CPUs then run 10-100x slower (the summary backward measured
~390 ms instead of ~90 ms here). GPUs flush them in these kernels, so the script flushes
denormals to zero by default (``torch.set_flush_denormal(True)``); ``--keep-denormals`` measures
without.

The prediction covers the GDN core only (no projections, conv, norm, halo); on a GPU the
node costs change, the graph does not - re-run step 3 with costs measured there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from benchmarks.gdn_chain_step import predict_chain
from overlap_runtime.ops.gdn import (
    apply_summary,
    apply_summary_backward,
    chunk_gated_delta_rule,
    chunk_output,
    prepare_chunks,
    summarize,
)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(local_seq: int, key_heads: int, value_heads: int, dim: int,
                  repeats: int) -> dict[str, float]:
    """Median seconds of every node kind on one shard (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    b, t = 1, local_seq
    q = torch.randn(b, t, key_heads, dim, generator=gen)
    k = torch.randn(b, t, key_heads, dim, generator=gen)
    v = torch.randn(b, t, value_heads, dim, generator=gen)
    g = -torch.rand(b, t, value_heads, generator=gen) * 0.1
    beta = torch.rand(b, t, value_heads, generator=gen)
    h_in = torch.randn(b, value_heads, dim, dim, generator=gen) * 0.1
    do = torch.randn(b, t, value_heads, dim, generator=gen)
    scale = dim**-0.5

    with torch.no_grad():
        prep = prepare_chunks(q, k, v, g, beta, scale, True, 64)
        m, s = summarize(prep)
    costs: dict[str, float] = {}
    with torch.no_grad():
        costs["gdn_prepare"] = _median_s(lambda: prepare_chunks(q, k, v, g, beta, scale, True, 64),
                                         repeats)
        costs["gdn_summary"] = _median_s(lambda: summarize(prep), repeats)
        costs["gdn_apply"] = _median_s(lambda: apply_summary(m, s, h_in), repeats)
        costs["gdn_output"] = _median_s(lambda: chunk_output(prep, h_in), repeats)
        costs["gdn_apply_bwd"] = _median_s(lambda: apply_summary_backward(m, h_in, h_in), repeats)

    def output_bwd() -> None:
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h_in)]
        o, _ = chunk_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                      backend="eager")
        torch.autograd.grad(o, leaves, do)

    def summary_bwd() -> None:
        leaves = [x.detach().requires_grad_(True) for x in (k, v, g, beta)]
        mm, ss = summarize(prepare_chunks(q, *leaves, scale, True, 64))
        torch.autograd.grad((mm, ss), leaves, (h_in @ h_in.transpose(-1, -2), h_in))

    costs["gdn_output_bwd"] = _median_s(output_bwd, repeats)
    costs["gdn_summary_bwd"] = _median_s(summary_bwd, repeats)
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--local-seq", type=int, default=2048)
    ap.add_argument("--key-heads", type=int, default=2)
    ap.add_argument("--value-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--bandwidth-gbs", type=float, default=25.0)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--keep-denormals", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flushed = False if args.keep_denormals else torch.set_flush_denormal(True)

    costs = measure_costs(args.local_seq, args.key_heads, args.value_heads, args.dim,
                          args.repeats)
    state_bytes = 1 * args.value_heads * args.dim * args.dim * 4
    message_s = args.latency_us * 1e-6 + state_bytes / (args.bandwidth_gbs * 1e9)
    print(f"# torch {torch.__version__}, {args.threads} thread(s); B=1, local seq "
          f"{args.local_seq}, H={args.key_heads}, HV={args.value_heads}, K=V={args.dim}, fp32, "
          f"eager; state message {state_bytes} B at {args.latency_us:g} us + "
          f"{args.bandwidth_gbs:g} GB/s; denormals flushed: {flushed}")
    print("| node kind | median ms |")
    print("|---|---:|")
    for kind, sec in costs.items():
        print(f"| {kind} | {sec * 1e3:.3f} |")
    single = costs["gdn_prepare"] + costs["gdn_output"] + costs["gdn_output_bwd"]
    print()
    print(f"one device, per {args.local_seq} tokens (prepare + output + output_bwd): "
          f"{single * 1e3:.2f} ms")
    print()
    print("| CP | makespan ms | efficiency | chain share | exposed comm ms |")
    print("|---:|---:|---:|---:|---:|")
    for p in args.cp:
        res = predict_chain(costs, message_s, p, args.local_seq, key_heads=args.key_heads,
                            value_heads=args.value_heads, head_dim=args.dim).result
        chain = (p - 2) * (costs["gdn_apply"] + costs["gdn_apply_bwd"]) + 2 * (p - 1) * message_s
        print(f"| {p} | {res.makespan * 1e3:.2f} | {single / res.makespan:.3f} | "
              f"{max(chain, 0.0) / res.makespan:.4f} | {res.exposed_comm * 1e3:.3f} |")


if __name__ == "__main__":
    main()
