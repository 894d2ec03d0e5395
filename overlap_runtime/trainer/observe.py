"""What the training loop reports besides its result: streamed metrics, progress, profiler window.

The loop (``trainer.loop``) touches this module in four places only::

    trace = observed_trace(config, trace, distributed=True)   before the model is built
    observer = RunObserver(config, device, ...)                 after it is built
    _run(..., log=observer.line_log(), on_step=observer)        once per step, every rank
    observer.close()                                            finally

:class:`RunObserver` owns a :class:`~.metrics.MetricsStream` (``metrics.jsonl`` /
``metrics.tensorboard``), rank 0's :class:`~.progress.Progress` (``metrics.progress``) and a
:class:`~.profiling.ProfilerWindow` (``profiling``), and installs the MoE layers' load counter.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from overlap_runtime.moe.layer import MoE
from overlap_runtime.moe.load_stats import ExpertLoadStats
from overlap_runtime.pipeline.exec_trace import ExecutionTrace
from overlap_runtime.config.train import TrainConfig
from overlap_runtime.models.spec import get_model_spec
from overlap_runtime.trainer.flops import device_peak_flops
from overlap_runtime.trainer.metrics import MetricsStream, make_writers
from overlap_runtime.trainer.profiling import ProfilerWindow
from overlap_runtime.trainer.progress import Progress, resolve_progress_mode

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _streams_metrics(config: TrainConfig) -> bool:
    return bool(config.metrics.jsonl or config.metrics.tensorboard)


def observed_trace(config: TrainConfig, trace: ExecutionTrace | None,
                   distributed: bool) -> ExecutionTrace | None:
    """The execution trace to build the model with: the caller's, else a new one when the
    profiler window keeps our trace (pp > 1 or ep > 1) or the metrics measure the all-to-all
    overlap (ep > 1), else None (no spans recorded at all)."""
    if trace is not None or not distributed:
        return trace
    acc = config.train.accelerator
    wants = (config.profiling.enable and (acc.pp > 1 or acc.ep > 1)) or \
        (_streams_metrics(config) and acc.ep > 1)
    return ExecutionTrace() if wants else None


def _count_moe_loads(config: TrainConfig, modules: list[nn.Module]) -> ExpertLoadStats | None:
    """Give every MoE layer of ``modules`` one load counter, under its decoder-layer index."""
    if config.model.mlp != "moe":
        return None
    stats = ExpertLoadStats(config.model.num_hidden_layers, config.model.num_experts)
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, MoE):
                found = _LAYER.search(name)
                if found is None:
                    raise RuntimeError(f"MoE layer {name!r} is not inside layers.<index>; cannot "
                                       f"name it in the load-balance metrics")
                sub.count_load(stats, int(found.group(1)))
    return stats


class RunObserver:
    """Per-step callback of one rank (module doc); ``observer(m)`` after every step.

    Args:
        config: the run's configuration.  device: this rank's device.
        rank / world: global rank and size (0 / 1 for the single-device run).
        modules: this rank's model parts (MoE layers get the load counter).
        trace: from :func:`observed_trace` (None: no overlap number, no ``exec_trace.json``).
        log: rank 0's line printer (None elsewhere).
        distributed: collectives over the default group at log steps and window end.
        timeout_s: bound of the execution-trace gather.
        resume_step: the checkpoint step a resumed run continues after (0: a new run); the
            metric files keep what earlier steps wrote.
        host_group: a gloo group for the metrics' all-reduces (``MetricsStream``'s ``group``);
            None: the default group.
    """

    def __init__(self, config: TrainConfig, device: torch.device, rank: int, world: int,
                 modules: list[nn.Module], trace: ExecutionTrace | None,
                 log: Callable[[str], None] | None, distributed: bool,
                 timeout_s: float | None = None, resume_step: int = 0,
                 host_group: Any = None) -> None:
        total, every = config.train.steps, config.train.log_every
        self.trace = trace
        self.metrics: MetricsStream | None = None
        self.profiler: ProfilerWindow | None = None
        self.progress: Progress | None = None
        try:
            if _streams_metrics(config):
                tokens = config.data.batch_size * config.dp * config.data.seq_len
                overlap_trace = trace if config.train.accelerator.ep > 1 else None
                self.metrics = MetricsStream(
                    make_writers(config.metrics.jsonl, config.metrics.tensorboard,
                                 resume_step)
                    if rank == 0 else [],
                    every, total, device, distributed,
                    get_model_spec("qwen3_5").flops_per_step(config.model, config.data.seq_len,
                                                               tokens),
                    device_peak_flops(device), world,
                    _count_moe_loads(config, modules), overlap_trace, host_group)
            if rank == 0 and log is not None:
                mode = resolve_progress_mode(config.metrics.progress)
                self.progress = Progress(mode, total, every, log)
            self._log = self.progress.line_log() if self.progress is not None else None
            p = config.profiling
            if p.enable:
                start, end = p.steps
                self.profiler = ProfilerWindow(start, end, p.dir, rank, device, trace,
                                               distributed, timeout_s)
        except BaseException:
            self.close()
            raise

    @classmethod
    def single(cls, config: TrainConfig, device: torch.device, model: nn.Module,
               log: Callable[[str], None] | None, resume_step: int = 0) -> "RunObserver":
        """The observer of the single-device run (``train_single``, often the baseline of a
        distributed run with the same configuration): its outputs get a ``single`` suffix so
        they never overwrite the distributed run's: ``run.jsonl`` -> ``run.single.jsonl``,
        TensorBoard ``dir`` -> ``dir/single``, profiling ``dir`` -> ``dir/single``."""
        m, p = config.metrics, config.profiling
        jsonl = None
        if m.jsonl:
            path = Path(m.jsonl)
            jsonl = str(path.with_name(f"{path.stem}.single{path.suffix or '.jsonl'}"))
        update = {
            "metrics": m.model_copy(update={
                "jsonl": jsonl,
                "tensorboard": str(Path(m.tensorboard) / "single") if m.tensorboard else None}),
            "profiling": p.model_copy(update={"dir": str(Path(p.dir) / "single")}),
        }
        return cls(config.model_copy(update=update), device, 0, 1, [model], None, log, False,
                   resume_step=resume_step)

    def reads_forward_state(self) -> bool:
        """Whether a step's callbacks read what the next step's forward writes (the execution
        trace, the MoE load counters): then no step is launched before the previous one is
        finished (trainer.launch_ahead)."""
        m = self.metrics
        return self.trace is not None or (m is not None and m.load_stats is not None)

    def drains_after(self, step: int) -> bool:
        """Whether step ``step`` must be finished before the next launch: the profiler window
        opens right after it or closes with it (its edges see whole steps)."""
        p = self.profiler
        return p is not None and step in (p.start - 1, p.end)

    def line_log(self) -> Callable[[str], None] | None:
        """The loop's per-step line printer (None: no lines: not rank 0, bar or off)."""
        return self._log

    def __call__(self, m: Any) -> None:
        """After step ``m.step`` (its ``StepMetrics``), on every rank."""
        if self.metrics is not None:
            self.metrics(m)
        if self.progress is not None:
            self.progress(m)
        if self.profiler is not None:
            self.profiler.step_done(m.step)

    def close(self) -> None:
        """Stop the profiler, close the bar and the writers (idempotent, also after errors)."""
        for part in (self.profiler, self.progress, self.metrics):
            if part is not None:
                part.close()
