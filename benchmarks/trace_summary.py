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
- our own ``record_function`` ranges (``user_annotation``) by total time.

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
    args = p.parse_args()
    s = summarize(json.loads(args.trace.read_text()), args.top)
    print(f"window {s['wall_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms "
          f"(idle {s['gpu_idle_share']:.1%})")
    _print("kernels (share of GPU busy time)", s["kernels"])
    _print("CPU ops, self time (share of the window)", s["cpu_self"])
    _print("record_function ranges (share of the window)", s["ranges"])
    out = os.environ.get("OUT")
    if out:
        Path(out, "trace_summary.json").write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
