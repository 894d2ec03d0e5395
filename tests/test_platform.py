"""Device kinds, backends, errors and the CPU no-op stream/event helpers."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from overlap_runtime import platform


def test_backend_table() -> None:
    assert platform.backend_for("cpu") == "gloo"
    assert platform.backend_for("cuda:1") == "nccl"
    assert platform.backend_for("npu") == "hccl"  # no torch_npu needed to know the backend
    assert platform.device_kind(torch.device("cpu")) == "cpu"


def test_unknown_kind_names_it_and_the_supported_kinds() -> None:
    with pytest.raises(ValueError, match=r"unknown device kind 'tpu'.*\['cpu', 'cuda', 'npu'\]"):
        platform.resolve_device("tpu")
    with pytest.raises(ValueError, match="index 'x'"):
        platform.resolve_device("cuda:x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_unavailable_cuda_says_what_exists() -> None:
    with pytest.raises(platform.DeviceUnavailableError, match=r"'cuda'.*available kinds: \['cpu'"):
        platform.resolve_device("cuda")


def test_npu_without_torch_npu_is_a_clear_error() -> None:
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu present")
    with pytest.raises(platform.DeviceUnavailableError, match="torch_npu"):
        platform.resolve_device("npu:0")
    assert "torch_npu" not in sys.modules


def test_import_is_light() -> None:
    import subprocess

    code = ("import sys, overlap_runtime, overlap_runtime.platform, overlap_runtime.ops.comm;"
            "print(any(m in sys.modules for m in ('triton', 'torch_npu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cpu_streams_and_events_are_noops() -> None:
    s = platform.new_stream("cpu")
    e = platform.new_event("cpu")
    with platform.stream_context(s):
        y = torch.ones(3) * 2
    e.record(s)
    s.wait_event(e)
    e.synchronize()
    assert e.query() and y.sum().item() == 6.0
    assert isinstance(platform.current_stream("cpu"), type(s))
    platform.synchronize("cpu")
    with pytest.raises(RuntimeError, match="perf_counter"):
        e.elapsed_time(e)


def test_set_device_per_thread_on_cpu() -> None:
    seen = []

    def worker() -> None:
        seen.append(platform.set_device("cpu"))

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert seen == [torch.device("cpu")]


def test_platform_info_lists_cpu() -> None:
    info = platform.platform_info()
    assert "cpu" in info.kinds and info.backends["cpu"] == "gloo" and info.counts["cpu"] == 1


def test_cpu_memory_statistics_and_synchronize() -> None:
    platform.reset_peak_memory_stats("cpu")
    platform.synchronize(torch.device("cpu"))
    assert platform.max_memory_allocated("cpu") is None  # the CPU keeps no such statistic
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        platform.max_memory_allocated("tpu:0")


def test_accelerator_memory_statistics_go_to_the_kind_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda and npu share one path (the kind's torch module): a fake module records the calls."""
    calls: list[tuple[str, torch.device]] = []

    class FakeAccel:
        @staticmethod
        def reset_peak_memory_stats(dev: torch.device) -> None:
            calls.append(("reset", dev))

        @staticmethod
        def max_memory_allocated(dev: torch.device) -> int:
            calls.append(("max", dev))
            return 1234

        @staticmethod
        def synchronize(dev: torch.device) -> None:
            calls.append(("sync", dev))

    monkeypatch.setattr(platform, "_accel_module", lambda kind: FakeAccel if kind == "cuda" else None)
    platform.reset_peak_memory_stats("cuda:1")
    assert platform.max_memory_allocated(torch.device("cuda", 1)) == 1234
    platform.synchronize("cuda:1")
    assert calls == [("reset", torch.device("cuda:1")), ("max", torch.device("cuda:1")),
                     ("sync", torch.device("cuda:1"))]
