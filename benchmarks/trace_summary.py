"""Where a profiled training step went: a summary of a torch.profiler chrome trace.

    python -m benchmarks.trace_summary profiles/rank0-*.json [--top 25]

Reads one chrome trace (``trainer.profiling`` writes one per rank) and prints, over the whole
window:

- the wall span of the window, the GPU's busy time (the union of every kernel and memcpy /
  memset interval, so overlapping streams count once) and its idle share: a large idle share
  means the step waits on the CPU (launches, Python, DTensor dispatch, host syncs);
- the kernels by total time (name, calls, total ms, share of the busy time);
- the CPU operators by total self time (``cpu_op`` events, exclusive of their children), which
  is where an idle GPU's time went;
- our own ``record_function`` ranges (``user_annotation``) by total time;
- the GPU's idle gaps (``--gaps``): every interval of at least ``--min-gap-us`` with no kernel
  or copy running, each blamed on what the host was doing instead: the CPU ops that enclose the
  launch of the kernel after the gap (matched by the profiler's correlation id), summed by the
  outermost of them and by the innermost, plus the host syncs (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaMemcpy*``) that overlap a gap.

Output: tables on stdout, and JSON under ``$OUT`` when that is set (``trace_summary.json``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (microseconds), overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _self_times(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """``{op name: [self microseconds per call]}`` of nested CPU ops, per thread."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, list[float]] = defaultdict(list)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, child time]
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                done = stack.pop()
                out[done[1]].append(done[3] - done[2])
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([end, e["name"], 0.0, e["dur"]])
        while stack:
            done = stack.pop()
            out[done[1]].append(done[3] - done[2])
    return out


def _gpu_gaps(gpu: list[dict[str, Any]], min_gap_us: float) -> list[tuple[float, float, int]]:
    """``(start, end, index of the GPU event after the gap)`` of every idle interval between
    the first and the last GPU event at least ``min_gap_us`` long (``gpu`` sorted by start)."""
    gaps, end = [], float("-inf")
    for i, e in enumerate(gpu):
        if end != float("-inf") and e["ts"] - end >= min_gap_us:
            gaps.append((end, e["ts"], i))
        end = max(end, e["ts"] + e["dur"])
    return gaps


def _enclosing(ops: list[dict[str, Any]], at: float) -> list[str]:
    """Names of the CPU ops (one thread's, sorted by start) that contain time ``at``,
    outermost first."""
    return [o["name"] for o in ops if o["ts"] <= at <= o["ts"] + o["dur"]]


def gap_report(events: list[dict[str, Any]], min_gap_us: float = 20.0,
               top: int = 25) -> dict[str, Any]:
    """Where the GPU sat idle (module docstring); times in milliseconds."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_of = {e.get("args", {}).get("correlation"): e for e in runtime}
    ops_by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ops_by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for ops in ops_by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    syncs = [e for e in runtime if "Synchronize" in e["name"] or
             (e["name"].startswith("cudaMemcpy") and "Async" not in e["name"])]
    outer: dict[str, list[float]] = defaultdict(list)
    inner: dict[str, list[float]] = defaultdict(list)
    sync_in_gaps: dict[str, list[float]] = defaultdict(list)
    largest = []
    gaps = _gpu_gaps(gpu, min_gap_us)
    for start, end, i in gaps:
        length = end - start
        nxt = gpu[i]
        launch = launch_of.get(nxt.get("args", {}).get("correlation"))
        stack = ([] if launch is None else
                 _enclosing(ops_by_thread.get((launch.get("pid"), launch.get("tid")), []),
                            launch["ts"]))
        outer[stack[0] if stack else "(launch not found)"].append(length)
        inner[stack[-1] if stack else "(launch not found)"].append(length)
        for e in syncs:
            overlap = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
            if overlap > 0:
                sync_in_gaps[e["name"]].append(overlap)
        largest.append({"ms": length / 1e3, "next": nxt["name"][:80],
                        "stack": " > ".join(s[:60] for s in stack[-4:])})
    largest.sort(key=lambda r: -r["ms"])

    def table(d: dict[str, list[float]]) -> list[dict[str, Any]]:
        rows = sorted(d.items(), key=lambda kv: -sum(kv[1]))[:top]
        return [{"name": k[:110], "calls": len(v), "total_ms": sum(v) / 1e3} for k, v in rows]

    return {"gaps": len(gaps), "idle_in_gaps_ms": sum(e - s for s, e, _ in gaps) / 1e3,
            "by_outer_op": table(outer), "by_inner_op": table(inner),
            "host_syncs": table(sync_in_gaps), "largest": largest[:top]}


def summarize(trace: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """The summary of one chrome trace (``{"traceEvents": [...]}``); times in milliseconds."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    if not events:
        raise ValueError("the trace holds no complete ('X') events")
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    busy = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        kernels[e["name"]].append(e["dur"])
    annotated: dict[str, list[float]] = defaultdict(list)
    for e in ranges:
        annotated[e["name"]].append(e["dur"])

    def table(d: dict[str, list[float]], denominator: float) -> list[dict[str, Any]]:
        rows = sorted(d.items(), key=lambda kv: -sum(kv[1]))[:top]
        return [{"name": k[:110], "calls": len(v), "total_ms": sum(v) / 1e3,
                 "share": sum(v) / denominator if denominator else 0.0} for k, v in rows]

    wall = t1 - t0
    return {
        "wall_ms": wall / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_idle_share": 1.0 - busy / wall if wall else 0.0,
        "kernels": table(kernels, busy),
        "cpu_self": table(_self_times(cpu_ops), wall),
        "ranges": table(annotated, wall),
    }


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}\n| calls | total ms | share | name |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['calls']} | {r['total_ms']:.2f} | {r['share']:.1%} | `{r['name']}` |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gaps", action="store_true", help="also blame the GPU's idle gaps")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    args = p.parse_args()
    trace = json.loads(args.trace.read_text())
    s = summarize(trace, args.top)
    print(f"window {s['wall_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms "
          f"(idle {s['gpu_idle_share']:.1%})")
    _print("kernels (share of GPU busy time)", s["kernels"])
    _print("CPU ops, self time (share of the window)", s["cpu_self"])
    _print("record_function ranges (share of the window)", s["ranges"])
    if args.gaps:
        events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
        g = gap_report(events, args.min_gap_us, args.top)
        s["gap_report"] = g
        print(f"\nGPU idle gaps >= {args.min_gap_us:g} us: {g['gaps']}, "
              f"{g['idle_in_gaps_ms']:.2f} ms in all")
        for title, key in (("by the outermost CPU op around the next launch", "by_outer_op"),
                           ("by the innermost CPU op around the next launch", "by_inner_op"),
                           ("host syncs overlapping a gap", "host_syncs")):
            print(f"\n{title}\n| gaps | idle ms | name |\n| --- | --- | --- |")
            for r in g[key]:
                print(f"| {r['calls']} | {r['total_ms']:.2f} | `{r['name']}` |")
        print("\nlargest gaps\n| ms | next kernel | launched inside |\n| --- | --- | --- |")
        for r in g["largest"]:
            print(f"| {r['ms']:.3f} | `{r['next']}` | {r['stack']} |")
    out = os.environ.get("OUT")
    if out:
        Path(out, "trace_summary.json").write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
