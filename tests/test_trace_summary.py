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


def _launch(ts: float, corr: int, tid: int = 1) -> dict:
    e = _x("cudaLaunchKernel", "cuda_runtime", ts, 5, tid=tid)
    e["args"] = {"correlation": corr}
    return e


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    e = _x(name, "kernel", ts, dur, tid=7)
    e["args"] = {"correlation": corr}
    return e


def test_gap_report_blames_the_late_launch() -> None:
    events = [
        _x("train.step 1", "user_annotation", 0, 2000),
        _x("aten::mm", "cpu_op", 0, 50),
        _launch(10, 1),
        _kernel("gemm", 20, 100, 1),                   # [20, 120]
        _x("aten::add", "cpu_op", 60, 40),
        _launch(70, 2),
        _kernel("add", 125, 10, 2),                    # gap [120, 125]: 5 us, under the floor
        _x("cudaStreamSynchronize", "cuda_runtime", 150, 400),  # host waits in [150, 550]
        _x("aten::softmax", "cpu_op", 600, 300),
        _launch(880, 3),
        _kernel("softmax", 900, 50, 3),                # gap [135, 900]: 765 us
        _x("aten::add", "cpu_op", 950, 100),
        _launch(1030, 4),
        _kernel("add2", 1050, 10, 4),                  # gap [950, 1050]: 100 us
        _kernel("long", 1060, 400, 5),                 # [1060, 1460] on one stream
        _kernel("short", 1070, 10, 6),                 # inside it on another: no gap after
        _kernel("tail", 1465, 10, 7),
    ]
    g = trace_summary.gap_report(events, min_gap_us=20)
    assert g["gaps"] == 2
    assert g["idle_in_gaps_ms"] == pytest.approx(0.865)
    outer = {r["name"]: r["total_ms"] for r in g["by_outer_op"]}
    assert outer == pytest.approx({"train.step 1": 0.865})
    inner = {r["name"]: r["total_ms"] for r in g["by_inner_op"]}
    assert inner == pytest.approx({"aten::softmax": 0.765, "aten::add": 0.1})
    assert g["host_syncs"][0]["name"] == "cudaStreamSynchronize"
    assert g["host_syncs"][0]["total_ms"] == pytest.approx(0.4)
    assert g["largest"][0]["next"] == "softmax" and g["largest"][0]["ms"] == pytest.approx(0.765)
