"""Measure a short real training run for the simulator: every rank's execution trace of every
step (the trainer clears its trace at each step; :class:`StepArchive` keeps each one) and the
point-to-point latency of the pipeline group.

:func:`traced_training` runs on every rank of an initialised gloo group (under
:func:`overlap_runtime.testing.run_ranks` or ``spawn``) and returns, per rank, a list of steps,
each a list of plain event rows ``[rank, thread, name, cat, start_ns, end_ns]``;
:func:`merge_ranks` turns the per-rank results into per-step event lists of the whole job.
Clocks: ``time.time_ns`` of one host, shared by every rank process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from overlap_runtime.ops.comm import all_gather
from overlap_runtime.pipeline import ExecutionTrace
from overlap_runtime.pipeline.exec_trace import TraceEvent
from overlap_runtime.trainer import config_from_dict, train_distributed


class StepArchive(list):  # type: ignore[type-arg]
    """An event list that keeps what it held each time the trainer clears it (one step)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[Any]] = []

    def clear(self) -> None:
        if len(self):
            self.steps.append(list(self))
        super().clear()

    def finish(self) -> list[list[Any]]:
        self.clear()
        return self.steps


def _ping_latency(rounds: int = 20, timeout_s: float = 60.0) -> float:
    """Median one-way time (s) of a 4-byte gloo message between ranks 0 and 1 of the default
    group (ping-pong; other ranks skip). Every rank returns the same figure."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.zeros(1)
    times = []
    if rank in (0, 1):
        peer = 1 - rank
        for _ in range(rounds):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            times.append((time.perf_counter() - t0) / 2)
    mine = statistics.median(times) if times else 0.0
    return float(all_gather(torch.tensor([mine], dtype=torch.float64), timeout_s=timeout_s).max())


def traced_training(rank: int, world_size: int, config_dict: dict[str, Any]) -> dict[str, Any]:
    """Train ``config_dict`` with an execution trace; return this rank's events per step and
    the measured p2p latency. A rank worker (``fn(rank, world_size, ...)``)."""
    import torch

    torch.set_num_threads(1)
    config = config_from_dict(config_dict)
    latency = _ping_latency()
    trace = ExecutionTrace(rank=rank)
    archive = StepArchive()
    trace.events = archive
    train_distributed(config, torch.device("cpu"), log=lambda line: None, trace=trace)
    steps = [[[e.rank, e.thread, e.name, e.cat, e.start_ns, e.end_ns] for e in step]
             for step in archive.finish()]
    return {"rank": rank, "steps": steps, "latency_s": latency}


def merge_ranks(results: list[dict[str, Any]]) -> list[list[Any]]:
    """Per-step event lists of the whole job (TraceEvent objects, ``rank`` = global rank) from
    every rank's result."""
    n = min(len(r["steps"]) for r in results)
    out = []
    for i in range(n):
        events = []
        for r in results:
            # the pipeline runtime names events by pipeline rank (``trace.rank``); the ranks of
            # one pipeline coordinate (ep, cp, dp peers) would collide: use the global rank
            events.extend(TraceEvent(r["rank"], *row[1:]) for row in r["steps"][i])
        out.append(events)
    return out
