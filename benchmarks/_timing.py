"""Timing shared by the multi-rank benchmarks: the median of the slowest rank.

Each iteration: synchronise the device, barrier, time ``fn()`` (CUDA events on cuda,
``perf_counter`` on the CPU), then take the max over ranks. Warm-up iterations are dropped.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


def rank_device(kind: str, rank: int) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) or the CPU."""
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(x: float, device: torch.device) -> float:
    """The largest ``x`` over the ranks of the default group."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed_slowest_rank(fn: Callable[[], Any], device: torch.device, warmup: int,
                       iters: int) -> tuple[float, float | None]:
    """``(median ms of the slowest rank, peak GiB allocated over the run, max over ranks)``;
    the peak is None on the CPU."""
    samples = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + iters):
        sync(device)
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        worst = max_over_ranks(ms, device)
        if i >= warmup:
            samples.append(worst)
    peak = None
    if device.type == "cuda":
        peak = max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30, device)
    return statistics.median(samples), peak


def timed_local_ms(fn: Callable[[], Any], device: torch.device, iters: int = 10) -> float:
    """Median ms of ``fn()`` on this CUDA device alone (CUDA events, no ranks involved), after
    two warm-up calls."""
    samples = []
    for i in range(iters + 2):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def profile_kernels(fn: Callable[[], Any], device: torch.device, iters: int = 2,
                    top: int = 18) -> str:
    """Device time per kernel of ``fn()`` (``iters`` calls under ``torch.profiler``), the
    ``top`` largest, as text: total ms per call, share, launches per call, name. CPU: the
    operators' self CPU time instead. Call it after the timed runs (warm caches, no compile)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or (cuda and e.device_type.name != "CUDA"):
            continue
        rows.append((us / iters / 1e3, e.count / iters, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1.0
    lines = [f"{'ms/call':>8} {'share':>6} {'n/call':>6}  kernel (device total {total:.3f} "
             f"ms/call)"]
    for ms, n, key in rows[:top]:
        lines.append(f"{ms:8.3f} {ms / total:6.1%} {n:6.1f}  {key[:110]}")
    return "\n".join(lines)


def write_out(name: str, text: str) -> None:
    """Append ``text`` to ``$OUT/name`` when OUT is set (the device tool brings it back)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "a") as f:
            f.write(text.rstrip() + "\n\n")
