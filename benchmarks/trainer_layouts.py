"""The 4D trainer on CPU ranks (gloo): every layout of the alignment suite against one device.

For each layout: the worst relative loss and grad-norm difference over the steps, and the
median step time (max over ranks, first step left out) next to the single-device step time of
the same global batch. The layouts and their model are those of tests/trainer/test_trainer_4d.py
(hidden 32, 4 layers, 4 x 64-token sequences per data-parallel rank, fp32).

    .venv/bin/python -m benchmarks.trainer_layouts --steps 8 [--only pp2_1f1b ep2_cp2]

On 2 cores the ranks share the cores: step times compare layouts with each other on this
machine, not with a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


from tests.support.trainer import train_worker  # noqa: E402
from tests.support.layouts import EIGHT_RANKS, FOUR_RANKS, TWO_RANKS  # noqa: E402

from overlap_runtime.testing import run_ranks  # noqa: E402
from overlap_runtime.trainer import TrainResult, compare_runs, config_from_dict, train_single  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for world, group in ((2, TWO_RANKS), (4, FOUR_RANKS), (8, EIGHT_RANKS)):
        for name, cfg in group.items():
            if args.only and name not in args.only:
                continue
            cfg = json.loads(json.dumps(cfg))
            cfg["train"]["steps"] = max(args.steps, cfg["train"]["steps"]) if \
                cfg["train"]["steps"] > 1 else 1
            t0 = time.perf_counter()
            run = TrainResult.from_dict(run_ranks(train_worker, world, timeout_s=900,
                                                  args=([cfg],))[0][0])
            wall = time.perf_counter() - t0
            base = train_single(config_from_dict(cfg))
            diff = compare_runs(run, base)
            steady = run.steps[1:] or run.steps
            bsteady = base.steps[1:] or base.steps
            row = {"layout": name, "ranks": world, "mode": run.mode, "steps": len(run.steps),
                   "max_rel_dloss": diff["max_rel_dloss"],
                   "max_rel_dgrad_norm": diff["max_rel_dgrad_norm"],
                   "step_ms": 1e3 * statistics.median(s.step_time_s for s in steady),
                   "single_step_ms": 1e3 * statistics.median(s.step_time_s for s in bsteady),
                   "wall_s": wall}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'layout':<26} {'ranks':>5} {'steps':>5} {'loss rel':>9} {'gnorm rel':>9} "
          f"{'step ms':>8} {'1 dev ms':>8}")
    for r in rows:
        print(f"{r['layout']:<26} {r['ranks']:>5} {r['steps']:>5} {r['max_rel_dloss']:>9.1e} "
              f"{r['max_rel_dgrad_norm']:>9.1e} {r['step_ms']:>8.1f} {r['single_step_ms']:>8.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
