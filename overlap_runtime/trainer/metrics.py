"""Streamed training metrics: one record every ``train.log_every`` steps to JSONL and TensorBoard.

A record (one JSON object per line; keys in this order; ``null`` where a number does not apply)::

    step, time            1-based step; unix time the record was made
    loss, grad_norm, lr   mean next-token CE over the global batch; global L2 gradient norm before
                          clipping; the learning rate the step used
    tokens, tokens_per_s, step_time_s
                          labelled tokens of the global batch; tokens / step_time_s; the step's
                          wall time, max over ranks
    peak_memory_bytes, peak_memory_kind
                          accelerators ("allocated"): the largest torch.cuda/npu
                          max_memory_allocated of any rank since training started; CPU ("rss"): the
                          largest peak resident set size of any rank process (getrusage
                          ru_maxrss: the whole process, Python and torch included; never reset);
                          null where neither is available
    flops_per_step, mfu   model FLOPs of a step and their share of the devices' bf16 peak
                          (trainer.flops: formula and table); mfu null on the CPU and on devices
                          not in the table
    moe_balance_worst, moe_balance_mean, moe_balance_per_layer, moe_dropped_tokens
                          per MoE layer max/mean token slots per expert over the logged step,
                          summed over all ranks (moe.load_stats); the worst layer, the mean over
                          layers, {layer index: value}; slots routed but not processed (0: the
                          router drops nothing). null for dense models
    a2a_overlap, a2a_time_s
                          expert all-to-all time hidden behind computation over the time one was
                          in flight, summed over ranks, for the logged step (trainer.a2a_overlap);
                          mean in-flight time per rank. null when ep == 1

Rank 0 writes. The JSONL file is truncated when a new run starts (a resumed run keeps the
records up to its checkpoint's step and appends); each line is flushed and
fsync'd before the step's callback returns, so a crash keeps every line written before it.
TensorBoard gets each number as a scalar (``train/<key>``, ``moe/balance_layer<i>``) through
``torch.utils.tensorboard.SummaryWriter`` (optional: ``pip install overlap_runtime[tensorboard]``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from overlap_runtime import platform
from overlap_runtime.moe.load_stats import ExpertLoadStats, balance_summary
from overlap_runtime.pipeline.exec_trace import ExecutionTrace
from overlap_runtime.trainer.a2a_overlap import a2a_overlap_ns
from overlap_runtime.config.train import ConfigError

TENSORBOARD_HINT = "pip install overlap_runtime[tensorboard]"


def _json_safe(value: Any) -> Any:
    """A non-finite float becomes its string ("nan", "inf"): strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return value


class JsonlWriter:
    """One JSON object per line, flushed and fsync'd per line.

    A new run truncates the file. A run resumed after step ``resume_step`` keeps the records of
    steps ``<= resume_step`` (those of later steps came from the run that crashed after its
    checkpoint, and are trained again) and appends.
    """

    def __init__(self, path: str | os.PathLike[str], resume_step: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if resume_step > 0 and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue  # a line cut short by the crash
                if isinstance(step, int) and step <= resume_step:
                    kept.append(line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class TensorBoardWriter:
    """Scalars of each record through ``torch.utils.tensorboard.SummaryWriter`` (lazy import)."""

    def __init__(self, log_dir: str | os.PathLike[str], resume_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch.utils.tensorboard imports the tensorboard package
            raise ConfigError(f"metrics.tensorboard={str(log_dir)!r} needs the tensorboard "
                              f"package ({TENSORBOARD_HINT}): {exc}") from None
        # a resumed run drops the events of the steps it trains again
        self._writer = SummaryWriter(log_dir=str(log_dir),
                                     purge_step=resume_step + 1 if resume_step > 0 else None)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key in ("step", "time") or isinstance(value, (bool, str)) or value is None:
                continue
            if isinstance(value, dict):
                for layer, v in value.items():
                    if v is not None:
                        self._writer.add_scalar(f"moe/balance_layer{layer}", float(v), step)
                continue
            self._writer.add_scalar(f"train/{key}", float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def peak_memory(device: torch.device) -> tuple[int | None, str | None]:
    """``(bytes, kind)`` of this rank: ``max_memory_allocated`` on an accelerator
    (``"allocated"``), the process's peak RSS on the CPU (``"rss"``), ``(None, None)`` where
    neither can be read."""
    peak = platform.max_memory_allocated(device)
    if peak is not None:
        return int(peak), "allocated"
    try:
        import resource
    except ImportError:  # not a Unix
        return None, None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "rss"  # macOS: bytes; Linux: KiB


class MetricsStream:
    """Per-step callback that builds a record every ``log_every`` steps (collectives on every
    rank, same steps everywhere) and hands it to the writers (rank 0 only).

    Args:
        writers: objects with ``write(record)`` and ``close()`` (empty on ranks other than 0).
        log_every / total: record steps ``s % log_every == 0`` and the last one.
        device: this rank's device (the tensors of the all-reduces live there).
        distributed: all-reduce over the default group (False: the single-device run).
        flops_per_step / peak_flops / devices: for ``mfu`` (trainer.flops).
        load_stats: the sink the MoE layers count into (None: dense model), reset every step.
        trace: the rank's execution trace of the current step (for ``a2a_overlap``; None:
            ep == 1, no number).
        group: a host-side (gloo) process group for the per-record all-reduces, whose tensors
            then stay on the host: reading a device tensor's result would make the host wait for
            every launch queued before it, the next step's too under launch-ahead. None: the
            default group, tensors on ``device``. One rank: no all-reduce at all.
    """

    def __init__(self, writers: list[Any], log_every: int, total: int, device: torch.device,
                 distributed: bool, flops_per_step: float, peak_flops: float | None,
                 devices: int, load_stats: ExpertLoadStats | None = None,
                 trace: ExecutionTrace | None = None, group: Any = None) -> None:
        self.writers = writers
        self.log_every, self.total = log_every, total
        self.device, self.distributed = device, distributed
        self.flops_per_step, self.peak_flops, self.devices = flops_per_step, peak_flops, devices
        self.load_stats, self.trace, self.group = load_stats, trace, group
        self.records: list[dict[str, Any]] = []  # what rank 0 wrote (tests, summaries)

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        if not self.distributed or dist.get_world_size(self.group) == 1:
            return values
        device = self.device if self.group is None else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def __call__(self, m: Any) -> None:
        """``m``: the step's ``StepMetrics``; call once per step on every rank."""
        if m.step % self.log_every and m.step != self.total:
            if self.load_stats is not None:
                self.load_stats.reset()
            return
        peak, kind = peak_memory(self.device)
        peak = None if peak is None else int(self._all_reduce([float(peak)], dist.ReduceOp.MAX)[0])
        record: dict[str, Any] = {
            "step": m.step, "time": time.time(), "loss": m.loss, "grad_norm": m.grad_norm,
            "lr": m.lr, "tokens": m.tokens, "tokens_per_s": m.tokens_per_s,
            "step_time_s": m.step_time_s, "peak_memory_bytes": peak, "peak_memory_kind": kind,
            "flops_per_step": self.flops_per_step,
            "mfu": (None if self.peak_flops is None else
                    self.flops_per_step / (m.step_time_s * self.devices * self.peak_flops)),
            "moe_balance_worst": None, "moe_balance_mean": None, "moe_balance_per_layer": None,
            "moe_dropped_tokens": None, "a2a_overlap": None, "a2a_time_s": None,
        }
        if self.load_stats is not None:
            loads = self.load_stats.reduce(self.device, across_ranks=self.distributed)
            self.load_stats.reset()
            summary = balance_summary(loads)
            if summary is not None:
                record.update(moe_balance_worst=summary["worst"], moe_balance_mean=summary["mean"],
                              moe_balance_per_layer=summary["per_layer"],
                              moe_dropped_tokens=summary["dropped"])
        if self.trace is not None:
            with self.trace._lock:
                events = list(self.trace.events)
            flight, hidden = a2a_overlap_ns(events)
            flight_all, hidden_all, ranks = self._all_reduce(
                [float(flight), float(hidden), 1.0], dist.ReduceOp.SUM)
            if flight_all > 0:
                record.update(a2a_overlap=hidden_all / flight_all,
                              a2a_time_s=flight_all / ranks / 1e9)
        for w in self.writers:
            w.write(record)
        if self.writers:
            self.records.append(record)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def make_writers(jsonl: str | None, tensorboard: str | None,
                 resume_step: int = 0) -> list[Any]:
    """The writers a ``metrics`` section asks for (call on rank 0 only); ``resume_step``: the
    checkpoint step a resumed run continues after (0: a new run)."""
    writers: list[Any] = []
    if jsonl:
        writers.append(JsonlWriter(jsonl, resume_step))
    if tensorboard:
        writers.append(TensorBoardWriter(tensorboard, resume_step))
    return writers

