"""The training loop: FSDP2 + context parallelism on every rank, and the single-device baseline.

:func:`train_distributed` runs on every rank of an initialised process group (spawned on the CPU
by :func:`spawn_training`, or started by torchrun)::

    mesh = ("dp", "cp") over all ranks
    model = Qwen3_5ForCausalLM(config.model)          same seed -> same weights on every rank
    parallelize_qwen3_5_cp(model, mesh["cp"], ...)    GDN CP + full-attention CP, contiguous
    apply_fsdp(model, mesh["dp","cp"] flattened)      FSDP2, gradients summed
    for step: batch = this rank's rows (dp) and contiguous shard (cp)
              loss_r = sum of CE over the shard / global tokens;  loss_r.backward()
              grad norm (clip), AdamW step
              loss = all-reduce(sum) of the per-rank CE sums / global tokens

:func:`train_single` is the baseline: the same model, data, optimizer and clipping on one device
with no process group and the whole global batch.

Precision. ``fp32``: everything in fp32. ``bf16``: fp32 master weights and optimizer, bf16
parameters and activations in forward/backward, fp32 gradient reduction - under FSDP through
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, on one device by running a bf16
copy of the model whose gradients are cast back to fp32 (the same casts FSDP makes), so the two
runs differ by reduction order only.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from overlap_runtime import platform
from overlap_runtime.models.parallelize import (
    apply_fsdp,
    build_dp_cp_mesh,
    flat_data_mesh,
    parallelize_qwen3_5_cp,
    parameter_count,
)
from overlap_runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from overlap_runtime.trainer.config import ConfigError, TrainConfig, config_from_dict
from overlap_runtime.trainer.data import Batch, TextDataset

__all__ = [
    "StepMetrics",
    "TrainResult",
    "build_model",
    "compare_runs",
    "format_step",
    "rank_main",
    "spawn_training",
    "train_distributed",
    "train_single",
]

Log = Callable[[str], None]


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, as every rank agrees on it.

    Attributes:
        step: 1-based step number.  loss: mean next-token cross entropy over the global batch.
        grad_norm: global L2 norm of the gradient before clipping.  lr: learning rate used.
        tokens: labelled tokens in the global batch.  step_time_s: wall time of the step (max
        over ranks).  tokens_per_s: ``tokens / step_time_s``.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float
    tokens_per_s: float


@dataclass
class TrainResult:
    """A whole run: per-step metrics and what it ran on."""

    steps: list[StepMetrics]
    world_size: int
    dp: int
    cp: int
    mode: str
    parameters: int
    peak_memory_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps": [asdict(s) for s in self.steps]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainResult":
        d = dict(data)
        d["steps"] = [StepMetrics(**s) for s in d["steps"]]
        return cls(**d)


def build_model(config: TrainConfig, device: torch.device | str = "cpu") -> Qwen3_5ForCausalLM:
    """The model of ``config.model`` initialised from ``config.train.seed`` (fp32, on ``device``).

    Every rank builds it whole from the same seed before FSDP shards it, so the initial weights
    equal the baseline's.
    """
    torch.manual_seed(config.train.seed)
    model = Qwen3_5ForCausalLM(config.model)
    model.set_activation_checkpointing(config.train.activation_checkpoint)
    return model.to(device)


def _optimizer(model: nn.Module, config: TrainConfig
               ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    o = config.optimizer
    # foreach=False: the per-parameter loop on both the FSDP (DTensor) and the plain model, so the
    # two runs execute the same update arithmetic.
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    warmup = o.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return opt, sched


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropy in fp32: logits ``[B, S, V]``, labels ``[B, S]`` int64."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")


def _to_float(x: torch.Tensor) -> float:
    full = getattr(x, "full_tensor", None)
    return float(full() if full is not None else x)


def format_step(m: StepMetrics, total: int) -> str:
    """The progress line of one step."""
    return (f"step {m.step:>{len(str(total))}}/{total}  loss {m.loss:.6f}  "
            f"grad_norm {m.grad_norm:.6e}  lr {m.lr:.2e}  tok/s {m.tokens_per_s:,.0f}  "
            f"({m.step_time_s * 1e3:.1f} ms)")


def _check_finite(m: StepMetrics) -> None:
    if not (math.isfinite(m.loss) and math.isfinite(m.grad_norm)):
        raise FloatingPointError(f"step {m.step}: loss {m.loss} / grad norm {m.grad_norm} is not "
                                 f"finite")


def train_distributed(config: TrainConfig, device: torch.device | str = "cpu",
                      log: Log | None = None) -> TrainResult:
    """FSDP2 + CP training on this rank of the initialised default process group.

    Args:
        config: the validated configuration; ``world_size / cp`` data-parallel groups.
        device: this rank's device (``cuda:<local rank>`` under torchrun on GPUs).
        log: called with each progress line on global rank 0 (None: print).

    Returns:
        The run's metrics (identical on every rank).

    Raises:
        ConfigError: ``train.accelerator.cp`` does not divide the process group's world size.
    """
    device = torch.device(device)
    acc = config.train.accelerator
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % acc.cp:
        raise ConfigError(f"train.accelerator.cp={acc.cp} does not divide the world size {world}")
    dp = world // acc.cp
    mesh = build_dp_cp_mesh(device.type, dp, acc.cp)
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()

    model = build_model(config, device)
    n_params = parameter_count(model)
    parallelize_qwen3_5_cp(
        model, mesh["cp"], ulysses_degree=acc.ulysses_degree,
        linear_attention_cp_mode=acc.linear_attention_cp_mode,
        linear_attention_gdn_backend=acc.linear_attention_gdn_backend,
        full_attention_cp_mode=acc.full_attention_cp_mode, timeout_s=acc.comm_timeout_s,
    )
    mp_policy = None
    if config.train.precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_fsdp(model, flat_data_mesh(mesh), mp_policy)
    optimizer, scheduler = _optimizer(model, config)
    data = TextDataset(config.data.seq_len, config.data.batch_size, dp, config.train.seed,
                       config.data.corpus)
    platform.reset_peak_memory_stats(device)

    def step_fn(batch: Batch) -> torch.Tensor:
        logits = model(batch.input_ids.to(device), batch.position_ids.to(device))
        ce = _ce_sum(logits, batch.labels.to(device))
        (ce / batch.global_tokens).backward()
        return ce.detach()

    steps = _run(config, model, optimizer, scheduler, device,
                 lambda s: data.rank_batch(s, dp_rank, cp_rank, acc.cp), step_fn,
                 distributed=True, log=(log or print) if rank == 0 else None)
    peak = platform.max_memory_allocated(device)
    if peak is not None:  # cuda/npu: the largest peak of any rank
        peak_t = torch.tensor(float(peak), device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = int(peak_t.item())
    mode = (f"fsdp{world}+cp{acc.cp}:{acc.linear_attention_cp_mode}/"
            f"{acc.full_attention_cp_mode}")
    return TrainResult(steps, world, dp, acc.cp, mode, n_params, peak)


def train_single(config: TrainConfig, device: torch.device | str = "cpu",
                 log: Log | None = None) -> TrainResult:
    """The single-device baseline: same model, data (whole global batch), optimizer, clipping.

    Needs no process group. ``dp`` of the global batch is ``config.dp`` (the distributed run's
    data-parallel degree), so both runs see the same tokens each step.
    """
    device = torch.device(device)
    model = build_model(config, device)
    optimizer, scheduler = _optimizer(model, config)
    dp = config.dp
    data = TextDataset(config.data.seq_len, config.data.batch_size, dp, config.train.seed,
                       config.data.corpus)
    compute = model
    if config.train.precision == "bf16":
        compute = copy.deepcopy(model).to(torch.bfloat16)
    master_params = list(model.parameters())
    compute_params = list(compute.parameters())
    platform.reset_peak_memory_stats(device)

    def full_batch(step: int) -> Batch:
        inputs, labels = data.global_batch(step)
        return Batch(inputs, labels, torch.arange(config.data.seq_len), labels.numel())

    def step_fn(batch: Batch) -> torch.Tensor:
        if compute is not model:
            with torch.no_grad():
                for pc, pm in zip(compute_params, master_params):
                    pc.copy_(pm)
        logits = compute(batch.input_ids.to(device), batch.position_ids.to(device))
        ce = _ce_sum(logits, batch.labels.to(device))
        (ce / batch.global_tokens).backward()
        if compute is not model:
            for pc, pm in zip(compute_params, master_params):
                pm.grad = None if pc.grad is None else pc.grad.float()
                pc.grad = None
        return ce.detach()

    steps = _run(config, model, optimizer, scheduler, device, full_batch, step_fn,
                 distributed=False, log=log)
    peak = platform.max_memory_allocated(device)
    return TrainResult(steps, 1, 1, 1, "single", parameter_count(model), peak)


def _run(config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LambdaLR, device: torch.device,
         batch_for: Callable[[int], Batch], step_fn: Callable[[Batch], torch.Tensor],
         distributed: bool, log: Log | None) -> list[StepMetrics]:
    """The steps shared by both runs; returns the metrics every rank agrees on."""
    max_norm = config.optimizer.max_grad_norm
    total = config.train.steps
    out: list[StepMetrics] = []
    for step in range(total):
        batch = batch_for(step)
        platform.synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        ce_sum = step_fn(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm if max_norm is not None else math.inf, foreach=False)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        ce_total = ce_sum.float().reshape(1).clone()
        if distributed:
            dist.all_reduce(ce_total)
        platform.synchronize(device)
        elapsed = time.perf_counter() - t0
        if distributed:
            t = torch.tensor(elapsed, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed = float(t)
        m = StepMetrics(step + 1, float(ce_total) / batch.global_tokens, _to_float(grad_norm), lr,
                        batch.global_tokens, elapsed, batch.global_tokens / elapsed)
        _check_finite(m)
        out.append(m)
        if log is not None and ((step + 1) % config.train.log_every == 0 or step + 1 == total):
            log(format_step(m, total))
    return out


def compare_runs(run: TrainResult, baseline: TrainResult) -> dict[str, float]:
    """Largest per-step differences of loss and grad norm between two runs of equal length.

    Returns ``max_abs_dloss``, ``max_rel_dloss`` (``|dloss| / |loss_baseline|``),
    ``max_abs_dgrad_norm``, ``max_rel_dgrad_norm`` and ``steps``.
    """
    if len(run.steps) != len(baseline.steps):
        raise ValueError(f"runs differ in length: {len(run.steps)} vs {len(baseline.steps)} steps")
    dl = [abs(a.loss - b.loss) for a, b in zip(run.steps, baseline.steps)]
    rl = [abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(run.steps, baseline.steps)]
    dg = [abs(a.grad_norm - b.grad_norm) for a, b in zip(run.steps, baseline.steps)]
    rg = [abs(a.grad_norm - b.grad_norm) / abs(b.grad_norm)
          for a, b in zip(run.steps, baseline.steps)]
    return {"steps": len(dl), "max_abs_dloss": max(dl), "max_rel_dloss": max(rl),
            "max_abs_dgrad_norm": max(dg), "max_rel_dgrad_norm": max(rg)}


def rank_main(rank: int, world_size: int, config_dict: dict[str, Any],
              quiet: bool = False) -> dict[str, Any] | None:
    """Entry point of a spawned CPU rank: train, return the metrics from rank 0 (else None)."""
    config = config_from_dict(config_dict)
    log = (lambda line: None) if quiet else (lambda line: print(line, flush=True))
    result = train_distributed(config, torch.device(config.train.accelerator.device), log)
    return result.to_dict() if rank == 0 else None


def spawn_training(config: TrainConfig, quiet: bool = False,
                   timeout_s: float = 3600.0) -> TrainResult:
    """Run :func:`train_distributed` on ``train.accelerator.world_size`` ranks spawned here.

    The embedded default: CPU ranks on gloo (``launch.spawn``); each rank uses one thread.
    """
    from overlap_runtime.launch import spawn

    acc = config.train.accelerator
    results = spawn(rank_main, acc.resolved_world_size, args=(config.model_dump(), quiet),
                    device=acc.device, timeout_s=timeout_s)
    return TrainResult.from_dict(results[0])
