"""Benchmark the eager GDN backend on CPU: memory-lean autograd function vs plain autograd.

Usage:
    .venv/bin/python -m benchmarks.gdn_eager [--seq-len 4096] [--heads 4] [--dim 64]
        [--threads 1] [--repeats 5] [--block-chunks 1 4 16]

Variants (same chunked WY math, fp32, chunk size 64, no initial state):
    plain    chunk.chunk_forward with autograd on: the graph keeps every chunk's intermediates.
    lean/b   chunk_gated_delta_rule(backend="eager") with block_chunks=b: forward under no_grad,
             saves inputs + one state per b chunks, backward recomputes b chunks at a time.

Time: median of --repeats runs (after one warm-up) of the forward (inputs require grad) and of
the backward (o.backward(do)), measured with time.perf_counter.

Memory: torch.profiler(profile_memory=True) records every CPU-allocator allocation and free
(signed byte counts); their running sum is the memory allocated since the profile started (the
inputs exist before it, so they are not counted). From two profiles per variant:
    retained  bytes still allocated when the forward returns (o + final state + saved graph);
    fwd peak  max Total Allocated during the forward;
    bwd peak  retained + max Total Allocated during the backward (gradients included).
tracemalloc cannot see tensor storage (torch allocates outside Python's allocator), hence the
profiler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from overlap_runtime.ops.gdn import EagerBackend
from overlap_runtime.ops.gdn.chunk import chunk_forward

MiB = 2**20


def make_inputs(batch: int, seq_len: int, heads: int, dim: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq_len, heads, dim, generator=gen)
    k = torch.randn(batch, seq_len, heads, dim, generator=gen)
    v = torch.randn(batch, seq_len, heads, dim, generator=gen)
    g = F.logsigmoid(torch.randn(batch, seq_len, heads, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(batch, seq_len, heads, generator=gen))
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)]


def plain(inputs: list[torch.Tensor]) -> torch.Tensor:
    return chunk_forward(*inputs, None, None, True, 64)[0]


def lean(block_chunks: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    backend = EagerBackend(block_chunks)

    def run(inputs: list[torch.Tensor]) -> torch.Tensor:
        scale = inputs[0].shape[-1] ** -0.5
        return backend.forward(*inputs, scale=scale, initial_state=None, use_qk_l2norm=True,
                               chunk_size=64)[0]

    return run


def allocated_trace(fn: Callable[[], object]) -> tuple[object, int, int]:
    """Run fn under the memory profiler; return (result, peak bytes, final bytes)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    # Running sum of the signed allocation sizes in event order (frees are negative); the
    # profiler's own "Total Allocated" column can come out of order when timestamps tie.
    mem.sort(key=lambda a: a.get("Ev Idx", 0))
    running, peak = 0, 0
    for a in mem:
        running += a["Bytes"]
        peak = max(peak, running)
    return result, peak, running


def measure(name: str, fn: Callable, inputs: list[torch.Tensor], repeats: int) -> dict:
    do = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(1))
    fwd_times, bwd_times = [], []
    for i in range(repeats + 1):  # first run is a warm-up
        for x in inputs:
            x.grad = None
        t0 = time.perf_counter()
        o = fn(inputs)
        t1 = time.perf_counter()
        o.backward(do)
        t2 = time.perf_counter()
        if i:
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
        del o
    for x in inputs:
        x.grad = None
    o, fwd_peak, retained = allocated_trace(lambda: fn(inputs))
    _, bwd_extra, _ = allocated_trace(lambda: o.backward(do))
    del o
    return {
        "variant": name,
        "fwd_ms": 1e3 * statistics.median(fwd_times),
        "bwd_ms": 1e3 * statistics.median(bwd_times),
        "retained_mib": retained / MiB,
        "fwd_peak_mib": fwd_peak / MiB,
        "bwd_peak_mib": (retained + bwd_extra) / MiB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-chunks", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    inputs = make_inputs(args.batch, args.seq_len, args.heads, args.dim)
    input_mib = sum(x.numel() * x.element_size() for x in inputs) / MiB
    rows = [measure("plain autograd", plain, inputs, args.repeats)]
    for b in args.block_chunks:
        rows.append(measure(f"lean, block_chunks={b}", lean(b), inputs, args.repeats))

    print(f"B={args.batch} T={args.seq_len} H=HV={args.heads} K=V={args.dim} fp32 chunk=64 "
          f"threads={torch.get_num_threads()} torch={torch.__version__} "
          f"repeats={args.repeats} inputs={input_mib:.1f} MiB")
    print("| variant | forward ms | backward ms | retained after fwd MiB | fwd peak MiB "
          "| bwd peak MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | "
              f"{r['retained_mib']:.1f} | {r['fwd_peak_mib']:.1f} | {r['bwd_peak_mib']:.1f} |")


if __name__ == "__main__":
    main()
