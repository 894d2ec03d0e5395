"""benchmarks/trace_summary.py: GPU busy time is a union of intervals, CPU self time excludes
children, on a hand-made chrome trace whose answers are known."""

from __future__ import annotations


import pytest

from benchmarks import trace_summary


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_summary_of_a_known_trace() -> None:
    trace = {"traceEvents": [
        _x("step", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 0, 400),            # self 400 - 100 (child) = 300
        _x("aten::copy_", "cpu_op", 100, 100),       # child of mm
        _x("aten::copy_", "cpu_op", 500, 200),
        _x("gemm", "kernel", 100, 300, tid=7),       # [100, 400]
        _x("gemm", "kernel", 300, 300, tid=8),       # [300, 600]: overlaps, union [100, 600]
        _x("memcpy", "gpu_memcpy", 800, 100, tid=7),  # [800, 900]
        {"ph": "i", "name": "marker", "ts": 5},      # not a complete event: ignored
    ]}
    s = trace_summary.summarize(trace)
    assert s["wall_ms"] == pytest.approx(1.0)
    assert s["gpu_busy_ms"] == pytest.approx(0.6)
    assert s["gpu_idle_share"] == pytest.approx(0.4)
    kernels = {r["name"]: r for r in s["kernels"]}
    assert kernels["gemm"]["calls"] == 2 and kernels["gemm"]["total_ms"] == pytest.approx(0.6)
    cpu = {r["name"]: r["total_ms"] for r in s["cpu_self"]}
    assert cpu == pytest.approx({"aten::mm": 0.3, "aten::copy_": 0.3})
    assert s["ranges"][0]["name"] == "step"


def test_empty_trace_is_an_error() -> None:
    with pytest.raises(ValueError, match="no complete"):
        trace_summary.summarize({"traceEvents": []})
