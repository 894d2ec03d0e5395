"""Device kinds, their collective backends, and stream/event helpers.

One table decides everything device-specific in the runtime::

    device kind  torch device   process-group backend   extra import
    -----------  ------------   ---------------------   ------------
    cpu          cpu            gloo                     -
    cuda         cuda:<i>       nccl                     -
    npu          npu:<i>        hccl                     torch_npu (lazily, only when asked for)

Streams, events, synchronisation and memory statistics are real on cuda/npu and no-ops (or None)
on the CPU, so the same overlap and training code runs in CI (gloo, CPU ranks) and on
accelerators. The current device is per thread in torch: every worker
thread that launches kernels must call :func:`set_device` itself.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

DeviceKind = Literal["cpu", "cuda", "npu"]

DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "npu")
BACKEND_FOR_KIND: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

_npu_lock = threading.Lock()
_npu_module: Any = None


class DeviceUnavailableError(RuntimeError):
    """A device kind or index was asked for that this machine does not have."""


def _import_torch_npu() -> Any:
    """Import torch_npu once, on first use; never at package import."""
    global _npu_module
    with _npu_lock:
        if _npu_module is None:
            try:
                _npu_module = importlib.import_module("torch_npu")
            except ImportError as exc:  # pragma: no cover - no NPU in CI
                raise DeviceUnavailableError(
                    f"device kind 'npu' needs the torch_npu package, which is not importable "
                    f"({exc}); available kinds here: {available_kinds()}"
                ) from exc
    return _npu_module


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    _import_torch_npu()  # pragma: no cover - no NPU in CI
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]  # pragma: no cover


def available_kinds() -> list[str]:
    """Device kinds usable in this process, always including ``cpu``."""
    kinds = ["cpu"]
    if torch.cuda.is_available():
        kinds.append("cuda")
    if _npu_available():  # pragma: no cover - no NPU in CI
        kinds.append("npu")
    return kinds


def _device_count(kind: str) -> int:
    if kind == "cpu":
        return 1
    if kind == "cuda":
        return torch.cuda.device_count()
    _import_torch_npu()  # pragma: no cover - no NPU in CI
    return int(torch.npu.device_count())  # type: ignore[attr-defined]  # pragma: no cover


def _check_kind(kind: str) -> None:
    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device kind {kind!r}; supported kinds are {list(DEVICE_KINDS)}")


def _parse(device: str | torch.device) -> tuple[str, int | None]:
    """Split a device into (kind, index) without asking torch to know the kind.

    ``torch.device("npu")`` only parses once torch_npu is imported, so strings are parsed here.
    """
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    else:
        text = str(device).strip()
        kind, _, idx = text.partition(":")
        if idx and not idx.isdigit():
            raise ValueError(f"device {text!r}: index {idx!r} is not a non-negative integer")
        index = int(idx) if idx else None
    _check_kind(kind)
    return kind, index


def resolve_device(device: str | torch.device | None = None, local_rank: int = 0) -> torch.device:
    """Turn ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"npu"`` or a torch.device into a checked device.

    A bare accelerator kind becomes ``<kind>:<local_rank>``. An unknown kind, an unavailable kind
    or an index past the device count raises, naming what was asked and what exists.
    """
    kind, index = _parse("cpu" if device is None else device)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        _import_torch_npu()
    avail = available_kinds()
    if kind not in avail:
        raise DeviceUnavailableError(
            f"device {str(device)!r} asked for, but kind {kind!r} is not available here; "
            f"available kinds: {avail}"
        )
    index = index if index is not None else local_rank
    count = _device_count(kind)
    if index >= count:
        raise DeviceUnavailableError(
            f"device {kind}:{index} asked for, but only {count} {kind} device(s) exist"
        )
    return torch.device(kind, index)


def device_kind(device: str | torch.device) -> str:
    """The kind (``cpu``/``cuda``/``npu``) of a device or device string; unknown kinds raise."""
    return _parse(device)[0]


def backend_for(device: str | torch.device) -> str:
    """Process-group backend for a device: cpu->gloo, cuda->nccl, npu->hccl."""
    return BACKEND_FOR_KIND[device_kind(device)]


def set_device(device: str | torch.device) -> torch.device:
    """Make ``device`` current for *this thread* (torch keeps the current device per thread).

    Returns the resolved device. A no-op for the CPU.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "npu":  # pragma: no cover - no NPU in CI
        torch.npu.set_device(dev)  # type: ignore[attr-defined]
    return dev


def _accel_module(kind: str) -> Any:
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":  # pragma: no cover - no NPU in CI
        _import_torch_npu()
        return torch.npu  # type: ignore[attr-defined]
    return None


class _NullStream:
    """Stands in for a stream on the CPU, where every op is synchronous."""

    device = torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


class _NullEvent:
    """Stands in for an event on the CPU; ``query`` is always true."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_NullEvent") -> float:
        raise RuntimeError("elapsed_time is not defined for CPU events; time with time.perf_counter")


def new_stream(device: str | torch.device) -> Any:
    """A new side stream on ``device``; a null stream on the CPU."""
    kind = device_kind(device)
    mod = _accel_module(kind)
    if mod is None:
        return _NullStream()
    return mod.Stream(device=torch.device(device))


def current_stream(device: str | torch.device) -> Any:
    """The current stream of ``device`` for this thread; a null stream on the CPU."""
    kind = device_kind(device)
    mod = _accel_module(kind)
    if mod is None:
        return _NullStream()
    return mod.current_stream(torch.device(device))


def new_event(device: str | torch.device, enable_timing: bool = False) -> Any:
    """A new event on ``device``'s kind; a null event (always complete) on the CPU."""
    kind = device_kind(device)
    mod = _accel_module(kind)
    if mod is None:
        return _NullEvent()
    return mod.Event(enable_timing=enable_timing)


@contextlib.contextmanager
def stream_context(stream: Any) -> Iterator[None]:
    """``with stream_context(s):`` runs kernels on ``s``; does nothing for a null stream."""
    if isinstance(stream, _NullStream):
        yield
        return
    kind = stream.device.type
    mod = _accel_module(kind)
    with mod.stream(stream):
        yield


def synchronize(device: str | torch.device) -> None:
    """Wait for all work on ``device``; a no-op on the CPU."""
    kind = device_kind(device)
    mod = _accel_module(kind)
    if mod is not None:
        mod.synchronize(torch.device(device))


def reset_peak_memory_stats(device: str | torch.device) -> None:
    """Start a new peak of allocated device memory on ``device``; a no-op on the CPU."""
    mod = _accel_module(device_kind(device))
    if mod is not None:
        mod.reset_peak_memory_stats(torch.device(device))


def max_memory_allocated(device: str | torch.device) -> int | None:
    """Peak bytes allocated by tensors on ``device`` since the last reset (the caching
    allocator's figure on cuda/npu); None on the CPU, which keeps no such statistic."""
    mod = _accel_module(device_kind(device))
    if mod is None:
        return None
    return int(mod.max_memory_allocated(torch.device(device)))


@dataclass(frozen=True)
class PlatformInfo:
    """What this process can run on: kinds, device counts, backends."""

    kinds: tuple[str, ...]
    counts: dict[str, int]
    backends: dict[str, str]


def platform_info() -> PlatformInfo:
    """Summarise the kinds available in this process."""
    kinds = tuple(available_kinds())
    return PlatformInfo(
        kinds=kinds,
        counts={k: _device_count(k) for k in kinds},
        backends={k: BACKEND_FOR_KIND[k] for k in kinds},
    )
