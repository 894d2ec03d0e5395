"""One-line summaries of benchmarks/gpu_pair.sh's results (issue #26), printed as each run ends.

Every figure is read back from the JSON / JSONL a run wrote (``overlap-runtime train
--metrics``, ``metrics.jsonl``, ``overlap-runtime simulate --json``), so the line printed is
what the file holds. A missing or unreadable file prints ``NAME: no result (why)`` and exits 1:
a killed run is visible as such, and the script carries on with the next run.

::

    python -m benchmarks.gpu_pair_summary train NAME METRICS.json [STEPS.jsonl]
    python -m benchmarks.gpu_pair_summary sim NAME PREDICTION.json METRICS.json
    python -m benchmarks.gpu_pair_summary ratio NAME A.json B.json      # A's step / B's step
    python -m benchmarks.gpu_pair_summary resume NAME STRAIGHT.json RESUMED.json

Step times are the median over steps 2..N (``overlap_runtime.trainer.cli``'s summary, the max
over ranks of each step); a2a figures are the medians over the JSONL's steps 2..N of
``a2a_time_s`` (mean in-flight time per rank) and ``a2a_overlap`` (share hidden).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["train_line", "sim_line", "ratio_line", "resume_line", "main"]


class NoResult(Exception):
    """A result file is missing or does not hold what the summary needs."""


def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise NoResult(f"{path} missing")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise NoResult(f"{path} is not JSON ({exc})") from exc


def _steps(metrics: dict[str, Any], path: str) -> list[dict[str, Any]]:
    steps = metrics.get("run", {}).get("steps")
    if not steps:
        raise NoResult(f"{path} holds no training steps")
    return steps


def _median_step_s(metrics: dict[str, Any], path: str) -> float:
    steps = _steps(metrics, path)
    return statistics.median(s["step_time_s"] for s in (steps[1:] or steps))


def _jsonl_medians(path: str) -> dict[str, float]:
    p = Path(path)
    if not p.is_file():
        return {}
    records = [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
    records = records[1:] or records
    out = {}
    for key in ("a2a_time_s", "a2a_overlap", "mfu"):
        vals = [r[key] for r in records if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def train_line(name: str, metrics_path: str, jsonl_path: str | None = None) -> str:
    """``NAME: step .. ms, .. tokens/s, peak .. MiB, final loss ..`` plus the all-to-all share
    and the hidden share (ep > 1, from the JSONL) and the single-device comparison if run."""
    m = _load(metrics_path)
    step_s = _median_step_s(m, metrics_path)
    s = m.get("summary", {})
    parts = [f"step {step_s * 1e3:.1f} ms", f"{s.get('median_tokens_per_s', 0):,.0f} tokens/s"]
    if s.get("peak_memory_bytes") is not None:
        parts.append(f"peak {s['peak_memory_bytes'] / 2**20:,.0f} MiB")
    parts.append(f"final loss {_steps(m, metrics_path)[-1]['loss']:.4f}")
    extra = _jsonl_medians(jsonl_path) if jsonl_path else {}
    if "a2a_time_s" in extra:
        parts.append(f"a2a in flight {extra['a2a_time_s'] * 1e3:.1f} ms = "
                     f"{extra['a2a_time_s'] / step_s:.1%} of the step")
    if "a2a_overlap" in extra:
        parts.append(f"a2a hidden {extra['a2a_overlap']:.1%}")
    if "mfu" in extra:
        parts.append(f"MFU {extra['mfu']:.1%}")
    cmp = m.get("comparison")
    if cmp:
        parts.append(f"vs one device over {cmp['steps']} steps: max rel dloss "
                     f"{cmp['max_rel_dloss']:.2e}, max rel dgrad-norm {cmp['max_rel_dgrad_norm']:.2e}")
    return f"{name}: " + ", ".join(parts)


def sim_line(name: str, prediction_path: str, metrics_path: str) -> str:
    """``NAME: predicted .. ms (bubble ..) vs measured .. ms: error ..%`` (goal within 10%)."""
    pred = _load(prediction_path)
    measured = _median_step_s(_load(metrics_path), metrics_path)
    err = pred["step_s"] / measured - 1.0
    return (f"{name}: predicted step {pred['step_s'] * 1e3:.1f} ms (bubble {pred['bubble']:.3f}, "
            f"exposed comm {pred['exposed_comm_s'] * 1e3:.1f} ms) vs measured "
            f"{measured * 1e3:.1f} ms: error {err:+.1%} ({'within' if abs(err) <= 0.10 else 'outside'}"
            f" the 10% goal)")


def ratio_line(name: str, a_path: str, b_path: str) -> str:
    """``NAME: .. ms / .. ms = ..x`` of two runs' median steps."""
    a = _median_step_s(_load(a_path), a_path)
    b = _median_step_s(_load(b_path), b_path)
    return f"{name}: {a * 1e3:.1f} ms / {b * 1e3:.1f} ms = {a / b:.3f}x"


def resume_line(name: str, straight_path: str, resumed_path: str) -> str:
    """``NAME: steps a..b resumed, max rel dloss ..`` against the straight run's same steps."""
    straight = {s["step"]: s["loss"] for s in _steps(_load(straight_path), straight_path)}
    resumed = {s["step"]: s["loss"] for s in _steps(_load(resumed_path), resumed_path)}
    common = sorted(set(straight) & set(resumed))
    if not common:
        raise NoResult(f"no step of {resumed_path} is in {straight_path}")
    rel = max(abs(resumed[k] - straight[k]) / abs(straight[k]) for k in common)
    return (f"{name}: steps {common[0]}..{common[-1]} after resume, loss {resumed[common[-1]]:.5f}"
            f" vs straight {straight[common[-1]]:.5f}, max rel dloss {rel:.2e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["train", "sim", "ratio", "resume"])
    p.add_argument("name")
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    fn = {"train": train_line, "sim": sim_line, "ratio": ratio_line, "resume": resume_line}
    try:
        print(fn[args.kind](args.name, *args.files), flush=True)
    except (NoResult, KeyError, TypeError) as exc:
        print(f"{args.name}: no result ({type(exc).__name__}: {exc})", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
