"""A torch.profiler window over steps ``[start, end]`` of a run, per rank, plus our own trace.

``profiling: {enable: true, steps: [5, 7], dir: prof}`` writes, in ``dir``:

* ``rank<r>.pt.trace.json``: every rank's torch.profiler chrome trace of steps 5..7 only
  (``torch.profiler.schedule``: waiting before, one warm-up step when ``start > 1``, then
  recording), CPU activities plus CUDA on GPUs. Worker threads (the OVERLAP_B_F FWD/BWD
  threads) are recorded too (``profile_all_threads`` where torch has it). Each step is the
  range ``train.step <n>``; our ranges (``ops.profile_range``) name pipeline actions
  (``pp.1F3``, ``pp.wait 0RECV_B2``), expert all-to-alls (``ep.dispatch
  S1.L0``, ``a2a S1.L0.combine fwd|bwd``), sync hooks (``hook A forward L0``), point-to-point
  messages (``p2p.send ...``, ``comm.wait ...``) and the GDN state chain (``gdn.p2p ...``).
* ``exec_trace.json`` (pp > 1 or ep > 1): the runtime's own :class:`ExecutionTrace` of the same
  steps, gathered from every rank by rank 0 (one all-gather of JSON bytes) and written as one
  chrome trace: one process per global rank, one track per thread, F/B/I/W actions, waits,
  all-to-alls and hooks with their wall times.

Open either in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from overlap_runtime.ops import comm
from overlap_runtime.pipeline.exec_trace import (ExecutionTrace, TraceEvent,
                                                 chrome_trace_events, decode_events,
                                                 encode_events)


def _experimental_config() -> Any:
    """``_ExperimentalConfig(profile_all_threads=True)`` where torch supports it, else None
    (then only the thread that started the profiler and autograd's threads are recorded)."""
    cls = getattr(torch._C._profiler, "_ExperimentalConfig", None)
    if cls is None:
        return None
    try:
        return cls(profile_all_threads=True)
    except TypeError:
        return None


def _gather_rank_events(events: list[TraceEvent], device: torch.device,
                       timeout_s: float | None = None) -> list[TraceEvent]:
    """Every rank's ``events`` on every rank, each relabelled with its global rank (two bounded
    all-gathers over the default group, on ``device``: lengths, then the padded JSON bytes)."""
    raw = encode_events(events)
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
        torch.zeros(0, dtype=torch.uint8)
    n = comm.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device),
                        timeout_s=timeout_s).cpu()
    width = max(1, int(n.max()))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    rows = comm.all_gather(padded[None].to(device), dim=0, timeout_s=timeout_s).cpu()
    out: list[TraceEvent] = []
    for r in range(rows.shape[0]):
        for e in decode_events(rows[r, : int(n[r])].numpy().tobytes(), f"the trace of rank {r}"):
            out.append(TraceEvent(r, e.thread, e.name, e.cat, e.start_ns, e.end_ns))
    return out


class ProfilerWindow:
    """Profile steps ``start..end`` (1-based, inclusive) of this rank (module doc).

    Call :meth:`step_done` after every step (on every rank: the end of the window gathers the
    execution traces) and :meth:`close` at the end (also after a failure: the profiler stops,
    whatever was recorded is written, nothing is gathered).

    Args:
        start, end: the window.  out_dir: where the files go.  rank: this global rank.
        device: this rank's device.  trace: the rank's execution trace (cleared at the start of
            every step by the loop), or None (no ``exec_trace.json``).
        distributed: gather the execution traces over the default group (False: write this
            rank's only).
    """

    def __init__(self, start: int, end: int, out_dir: str | os.PathLike[str], rank: int,
                 device: torch.device, trace: ExecutionTrace | None = None,
                 distributed: bool = True, timeout_s: float | None = None) -> None:
        if not 1 <= start <= end:
            raise ValueError(f"profiling.steps=[{start}, {end}]: need 1 <= start <= end")
        self.start, self.end, self.rank, self.device = start, end, rank, device
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trace, self.distributed, self.timeout_s = trace, distributed, timeout_s
        self.events: list[TraceEvent] = []
        self.trace_path = self.dir / f"rank{rank}.pt.trace.json"
        self.exec_trace_path = self.dir / "exec_trace.json"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warmup = 1 if start > 1 else 0
        # profiler step k (0-based) is training step k + 1
        schedule = torch.profiler.schedule(wait=start - 1 - warmup, warmup=warmup,
                                           active=end - start + 1, repeat=1)
        self._prof = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._write,
            experimental_config=_experimental_config())
        self._prof.start()
        self._range: Any = None
        self._open_range(1)
        self._done = False

    def _open_range(self, step: int) -> None:
        if self.start <= step <= self.end:
            self._range = record_function(f"train.step {step}")
            self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _write(self, prof: Any) -> None:
        prof.export_chrome_trace(str(self.trace_path))

    def step_done(self, step: int) -> None:
        """Step ``step`` (1-based) finished on this rank."""
        if self._done:
            return
        if self.trace is not None and self.start <= step <= self.end:
            with self.trace._lock:
                self.events.extend(self.trace.events)
        self._close_range()
        self._prof.step()
        self._open_range(step + 1)
        if step >= self.end:
            self._finish(gather=True)

    def _finish(self, gather: bool) -> None:
        self._done = True
        self._close_range()
        self._prof.stop()
        if self.trace is None:
            return
        events = self.events
        if gather and self.distributed:
            events = _gather_rank_events(events, self.device, self.timeout_s)
        elif not self.distributed:
            events = [TraceEvent(self.rank, e.thread, e.name, e.cat, e.start_ns, e.end_ns)
                      for e in events]
        if self.rank == 0 or not gather:
            path = self.exec_trace_path if gather else self.dir / f"exec_trace_rank{self.rank}.json"
            path.write_text(json.dumps(chrome_trace_events(events)))

    def close(self) -> None:
        """Stop the profiler if the window is still open (a run shorter than the window, or a
        failure): the profiler's partial trace and this rank's own events are written."""
        if not self._done:
            self._finish(gather=False)
