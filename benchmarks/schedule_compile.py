"""Time build + lower + validate + compile + simulate of a pipeline schedule.

    .venv/bin/python -m benchmarks.schedule_compile                 # pp=32, v=2, m=256, 5 runs
    .venv/bin/python -m benchmarks.schedule_compile --pp 8 --virtual 2 --microbatches 64 --runs 7

Each run starts from the spec and does every pass in a fresh state; the table shows the median
time of each pass over the runs (wall clock, seconds) and the median of the totals.
"""

from __future__ import annotations

import argparse
import statistics
import time

from overlap_runtime.graph import CostModel, simulate, validate_graph
from overlap_runtime.schedules import (
    ScheduleSpec,
    build_schedule,
    compile_schedule,
    lower,
    validate_schedule,
)

PASSES = ["build", "lower", "validate (pipeline rules)", "compile (task graph)",
          "validate (graph, deadlock)", "simulate"]


def one_run(spec: ScheduleSpec) -> tuple[list[float], dict[str, float]]:
    times: list[float] = []
    t = time.perf_counter()

    def lap() -> None:
        nonlocal t
        now = time.perf_counter()
        times.append(now - t)
        t = now

    mapping = spec.stage_mapping()
    compute = build_schedule(spec)
    lap()
    lowered = lower(compute, mapping, num_stages=spec.num_stages)
    lap()
    validate_schedule(lowered, num_microbatches=spec.num_microbatches,
                      num_stages=spec.num_stages, stage_to_rank=mapping, check_deadlock=False)
    lap()
    graph = compile_schedule(lowered, stage_to_rank=mapping, num_stages=spec.num_stages,
                             overlap_p2p=spec.overlap_p2p)
    lap()
    matching = validate_graph(graph)
    lap()
    result = simulate(graph, CostModel(F=1.0, B=2.0), matching=matching)
    lap()
    stats = {"tasks": len(graph), "edges": graph.num_edges(), "makespan": result.makespan,
             "bubble": result.bubble_ratio}
    return times, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="interleaved_1f1b")
    parser.add_argument("--pp", type=int, default=32)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--overlap-b-f", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    spec = ScheduleSpec(kind=args.kind, pp_size=args.pp, num_microbatches=args.microbatches,
                        virtual_stages=args.virtual, overlap_b_f=args.overlap_b_f)
    runs = []
    stats: dict[str, float] = {}
    for _ in range(args.runs):
        times, stats = one_run(spec)
        runs.append(times)
    print(f"{spec.kind} pp={spec.pp_size} v={spec.virtual_stages} m={spec.num_microbatches} "
          f"overlap_b_f={spec.overlap_b_f}: {stats['tasks']} tasks, {stats['edges']} edges, "
          f"bubble {stats['bubble']:.4f} (F=1, B=2)")
    print(f"{'pass':<28} {'median s':>9} {'min s':>7} {'max s':>7}")
    for k, name in enumerate(PASSES):
        col = [r[k] for r in runs]
        print(f"{name:<28} {statistics.median(col):>9.3f} {min(col):>7.3f} {max(col):>7.3f}")
    totals = [sum(r) for r in runs]
    print(f"{'total':<28} {statistics.median(totals):>9.3f} {min(totals):>7.3f} "
          f"{max(totals):>7.3f}   ({args.runs} runs)")


if __name__ == "__main__":
    main()
