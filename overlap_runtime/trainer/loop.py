"""The training loop: pp x dp_replicate x dp_shard x cp (EP borrowed from dp_shard x cp) on
every rank, and the single-device baseline.

:func:`train_distributed` runs on every rank of an initialised process group (spawned on the CPU
by :func:`spawn_training`, or started by torchrun)::

    dims = ParallelDims(...); dims.build_meshes()      every DeviceMesh, one owner
    pm = build_parallel_model(config, dims, ...)       CP, split, EP, FSDP2, schedule (build.py)
    for step: batch = this rank's rows (dp) and contiguous shard (cp)
              pp == 1: loss_r = CE sum over the shard / global tokens;  loss_r.backward()
              pp  > 1: with GatheredStep (FSDP gathers once, hooks suspended, reduces once;
                       fsdp_pipeline.py): schedule.step(microbatches), loss_fn as above
              grad norm over every dimension (grad_norm.py), clip, AdamW step
              loss = all-reduce(sum) of the per-rank loss shares

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
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from overlap_runtime import platform
from overlap_runtime.config.cp import describe_cp_modes
from overlap_runtime.config.train import ConfigError, TrainConfig, config_from_dict
from overlap_runtime.launch import spawn
from overlap_runtime.layers.compile import compile_elementwise
from overlap_runtime.models.parallelize import parameter_count
from overlap_runtime.ops.comm import DEFAULT_TIMEOUT_S
from overlap_runtime.ops.step_record import task_scope
from overlap_runtime.trainer.build import ParallelModel, build_model, build_parallel_model, ce_sum
from overlap_runtime.trainer.checkpoint import CheckpointError, Checkpointer
from overlap_runtime.trainer.data import Batch, build_dataset
from overlap_runtime.trainer.errors import step_context
from overlap_runtime.trainer.fsdp_pipeline import GatheredStep
from overlap_runtime.trainer.grad_norm import clip_grad_norm
from overlap_runtime.trainer.launch_ahead import (LaunchedStep, queue_scalars, to_device,
                                                   wait_for)
from overlap_runtime.trainer.observe import RunObserver, observed_trace
from overlap_runtime.trainer.parallel_dims import ParallelDims
from overlap_runtime.trainer.step_check import StepCheck

if TYPE_CHECKING:
    from overlap_runtime.pipeline import ExecutionTrace

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


def _optimizer(params: list[nn.Parameter], config: TrainConfig
               ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    o = config.optimizer
    # The same implementation on the FSDP (DTensor) and the plain model, so the two runs execute
    # the same update arithmetic; never torch's device-dependent default (foreach=None).
    kernels = {"for_loop": {"foreach": False}, "foreach": {"foreach": True},
               "fused": {"fused": True}}[o.implementation]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay, **kernels)
    warmup = o.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return opt, sched


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
                      log: Log | None = None, *, trace: ExecutionTrace | None = None,
                      on_model: Callable[[ParallelModel], None] | None = None,
                      debug: bool = False) -> TrainResult:
    """Training on this rank of the initialised default process group, any layout.

    Every call builds its own meshes and model, so it can run several times in the same ranks
    (the demo trains a baseline and the overlapped run this way).

    Args:
        config: the validated configuration (``train.accelerator`` gives the degrees).
        device: this rank's device (``cuda:<local rank>`` under torchrun on GPUs).
        log: called with each progress line on global rank 0 (None: print).
        trace: an execution trace, cleared at the start of every step (so it keeps the last
            one), handed to ``schedule.step`` (pp > 1) and to every MoE dispatcher (ep > 1).
        on_model: called with this rank's :class:`ParallelModel` right after it is built (before
            the first step); the model is closed when training ends but stays readable (its
            parameters, schedule and coordinator).
        debug: build the HookCoordinator (OVERLAP_B_F with EP) with its launch log on, for
            ``serializer.check_launch_order`` after training.

    Returns:
        The run's metrics (identical on every rank).

    Raises:
        ConfigError: the layout does not match the process group's world size.
    """
    device = torch.device(device)
    acc = config.train.accelerator
    world, rank = dist.get_world_size(), dist.get_rank()
    if acc.world_size is not None and acc.world_size != world:
        raise ConfigError(f"train.accelerator.world_size={acc.world_size} but the process group "
                          f"has {world} ranks")
    try:
        dims = ParallelDims.of(acc.model_copy(update={"world_size": world}).layout())
    except ValueError as exc:
        raise ConfigError(f"the layout does not fit the {world} ranks of the process group: "
                          f"{exc}") from None
    dims.build_meshes(device.type)
    coords = dims.coordinates(rank)
    trace = observed_trace(config, trace, distributed=True)
    pm = build_parallel_model(config, dims, device, coords["pp"], debug=debug, trace=trace)
    if on_model is not None:
        try:
            on_model(pm)
        except BaseException:
            pm.close()  # the overlap worker thread must not outlive a failing callback
            raise
    optimizer, scheduler = _optimizer(pm.parameters(), config)
    try:  # every rank builds the data, constructs the checkpointer and resumes (collective)
        data = build_dataset(config.data, dims.dp, config.train.seed)
        ckpt = Checkpointer(config.checkpoint, pm.modules(), optimizer, scheduler, data,
                            layout=_mode(config), device=device,
                            model_config=config.model.identity(),
                            log=(log or print) if rank == 0 else None)
        resumed = ckpt.resume()
    except BaseException:
        pm.close()
        raise
    platform.reset_peak_memory_stats(device)
    try:
        check = StepCheck(config, dims, (log or print) if rank == 0 else None)
    except BaseException:
        ckpt.release()
        pm.close()
        raise
    ep_group = dims.mesh("ep").get_group() if dims.ep > 1 else None
    pp_group = dims.mesh("pp").get_group() if dims.pp > 1 else None

    def step_fn(batch: Batch) -> torch.Tensor:
        with check.first_step():
            out = run_step(batch)
        check.check(device, acc.comm_timeout_s)
        return out

    def run_step(batch: Batch) -> torch.Tensor:
        if trace is not None:
            trace.events.clear()
        if pm.schedule is None:  # one stage: the step graph's 0F0 and 0B0
            model = pm.parts[0]
            # every host-to-device copy before the first launch: a copy from pageable memory
            # waits for the stream, so one issued after the forward's launches would leave the
            # GPU idle while the host launches the loss and the backward
            inputs = (to_device(batch.input_ids, device), to_device(batch.position_ids, device))
            kwargs, labels = batch.model_kwargs(device), to_device(batch.labels, device)
            with task_scope("0F0"):
                logits = model(*inputs, **kwargs)
                share = ce_sum(logits, labels) / batch.global_tokens
            with task_scope("0B0"):
                share.backward()
            return share.detach()
        losses: list[torch.Tensor] = []
        inputs = (to_device(batch.input_ids, device),) if pm.has_first else ()
        target = to_device(batch.labels, device) if pm.has_last else None
        with GatheredStep(pm.modules()):
            pm.schedule.step(*inputs, target=target, losses=losses, trace=trace)
        if not losses:
            return torch.zeros((), device=device)
        return torch.stack([l.detach().float() for l in losses]).sum()

    def norm_fn() -> torch.Tensor:
        return clip_grad_norm(pm.other_params, config.optimizer.max_grad_norm,
                              pm.expert_params, ep_group, pp_group, device)

    observer: RunObserver | None = None
    try:
        # the step time's and the metrics' max and sums over ranks on a host-side group: on an
        # NCCL one the host would read the result only after every launch queued before it
        # (under launch-ahead, the next step's forward and backward)
        host_group = (dist.new_group(backend="gloo") if config.train.launch_ahead
                      and device.type != "cpu" and world > 1 else None)
        observer = RunObserver(config, device, rank, world, pm.modules(), trace,
                               (log or print) if rank == 0 else None, True, acc.comm_timeout_s,
                               resume_step=resumed.step if resumed else 0,
                               host_group=host_group)
        steps = _run(config, optimizer, scheduler, device,
                     lambda s: data.rank_batch(s, coords["dp"], coords["cp"], dims.cp), step_fn,
                     norm_fn, distributed=True, log=observer.line_log(),
                     on_step=observer,
                     start_step=resumed.step if resumed else 0, after_step=ckpt.after_step,
                     **_launch_plan(config, observer, ckpt), time_group=host_group,
                     timeout_s=acc.comm_timeout_s or DEFAULT_TIMEOUT_S)
        ckpt.close()
    finally:
        ckpt.release()  # checkpoint.dir's lock, also when a step failed
        if observer is not None:
            observer.close()
        pm.close()
    peak = platform.max_memory_allocated(device)
    if peak is not None:  # cuda/npu: the largest peak of any rank
        peak_t = torch.tensor(float(peak), device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = int(peak_t.item())
    return TrainResult(steps, world, dims.dp, dims.cp, _mode(config), pm.num_parameters, peak)


def _mode(config: TrainConfig) -> str:
    """``pp2(interleaved_1f1b+overlap_b_f) x dp_shard2 x cp2:p2p/ring x ep2``-style label."""
    acc, pl = config.train.accelerator, config.train.pipeline
    dims = acc.layout()
    parts = []
    if dims.pp > 1:
        parts.append(f"pp{dims.pp}({pl.schedule}" + ("+overlap_b_f" if pl.overlap_b_f else "")
                     + (f",v{pl.virtual_stages}" if pl.virtual_stages > 1 else "") + ")")
    if dims.dp_replicate > 1:
        parts.append(f"dp_replicate{dims.dp_replicate}")
    parts.append(f"fsdp{dims.dp_shard * dims.cp}")
    parts.append(f"cp{dims.cp}:{describe_cp_modes(acc, config.model.layer_types)}")
    if dims.ep > 1:
        parts.append(f"ep{dims.ep}")
    return " x ".join(parts)


def train_single(config: TrainConfig, device: torch.device | str = "cpu",
                 log: Log | None = None, *,
                 on_model: Callable[[nn.Module], None] | None = None,
                 grad_microbatches: int = 1) -> TrainResult:
    """The single-device baseline: same model, data (whole global batch), optimizer, clipping.

    Needs no process group. ``dp`` of the global batch is ``config.dp`` (the distributed run's
    data-parallel degree), so both runs see the same tokens each step. ``on_model(model)`` is
    called with the fp32 (master) model right after it is built; it holds the trained weights
    when the call returns (``trainer.numerics.trained_weights``).

    ``grad_microbatches`` > 1: the global batch's rows run forward and backward in that many
    groups and the gradients are summed in fp32 (under bf16: each group's bf16 gradient cast to
    fp32, then added), a reordered sum of the same gradient; the bf16 noise floor of
    ``trainer.numerics`` uses it. It must divide the rows (``dp x data.batch_size``).
    """
    rows_total = config.dp * config.data.batch_size
    if grad_microbatches < 1 or rows_total % grad_microbatches:
        raise ValueError(f"grad_microbatches={grad_microbatches} must be >= 1 and divide the "
                         f"global batch's {rows_total} rows (dp x data.batch_size)")
    if grad_microbatches > 1 and config.data.packing != "concat":
        raise ValueError(f"grad_microbatches={grad_microbatches} needs data.packing='concat' "
                         f"(got {config.data.packing!r}: cu_seqlens spans every row)")
    device = torch.device(device)
    model = build_model(config, device)
    if on_model is not None:
        on_model(model)
    optimizer, scheduler = _optimizer(list(model.parameters()), config)
    dp = config.dp
    data = build_dataset(config.data, dp, config.train.seed)
    compute = model
    if config.train.precision == "bf16":
        compute = copy.deepcopy(model).to(torch.bfloat16)
    if config.train.compile:
        compile_elementwise(compute)
    master_params = list(model.parameters())
    compute_params = list(compute.parameters())
    ckpt = Checkpointer(config.checkpoint, [model], optimizer, scheduler, data,
                        layout="single", device=device,
                        model_config=config.model.identity(), log=log,
                        distributed=False)
    resumed = ckpt.resume()
    platform.reset_peak_memory_stats(device)

    def step_fn(batch: Batch) -> torch.Tensor:
        if compute is not model:
            with torch.no_grad():
                for pc, pm in zip(compute_params, master_params):
                    pc.copy_(pm)
        shares = []
        for rows in _row_groups(batch, grad_microbatches):
            # the host-to-device copies before the forward's launches (see train_distributed)
            inputs = (to_device(batch.input_ids[rows], device),
                      to_device(_rows(batch.position_ids, rows), device))
            kwargs, labels = batch.model_kwargs(device), to_device(batch.labels[rows], device)
            logits = compute(*inputs, **kwargs)
            share = ce_sum(logits, labels) / batch.global_tokens
            share.backward()
            shares.append(share.detach())
            if compute is not model:  # each group's bf16 gradient, summed in fp32
                for pc, pm in zip(compute_params, master_params):
                    if pc.grad is not None:
                        pm.grad = pc.grad.float() if pm.grad is None else pm.grad + pc.grad
                        pc.grad = None
        return torch.stack(shares).sum()

    max_norm = config.optimizer.max_grad_norm

    def norm_fn() -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm if max_norm is not None else math.inf, foreach=False)

    observer = RunObserver.single(config, device, model, log,
                                  resume_step=resumed.step if resumed else 0)
    try:
        steps = _run(config, optimizer, scheduler, device, data.full_batch, step_fn, norm_fn,
                     distributed=False, log=observer.line_log(), on_step=observer,
                     start_step=resumed.step if resumed else 0, after_step=ckpt.after_step,
                     **_launch_plan(config, observer, ckpt))
        ckpt.close()
    finally:
        ckpt.release()  # checkpoint.dir's lock, also when a step failed
        observer.close()
    peak = platform.max_memory_allocated(device)
    return TrainResult(steps, 1, 1, 1, "single", parameter_count(model), peak)


def _row_groups(batch: Batch, groups: int) -> list[slice]:
    """``groups`` equal slices of the batch's rows."""
    n = batch.input_ids.shape[0] // groups
    return [slice(i * n, (i + 1) * n) for i in range(groups)]


def _rows(position_ids: torch.Tensor, rows: slice) -> torch.Tensor:
    """Position ids of some rows: ``[s]`` (shared by every row) as is, ``[b, s]`` sliced."""
    return position_ids if position_ids.dim() == 1 else position_ids[rows]


def _launch_plan(config: TrainConfig, observer: RunObserver, ckpt: Checkpointer
                 ) -> dict[str, Any]:
    """:func:`_run`'s ``launch_ahead`` and ``drain_after`` for a run: launch-ahead as configured
    unless the observers read what the next forward writes; a step is drained before a
    checkpoint save and at the profiler window's edges."""
    return {"launch_ahead": config.train.launch_ahead and not observer.reads_forward_state(),
            "drain_after": lambda s: ckpt.due(s, config.train.steps) or observer.drains_after(s)}


def _run(config: TrainConfig, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LambdaLR, device: torch.device,
         batch_for: Callable[[int], Batch], step_fn: Callable[[Batch], torch.Tensor],
         norm_fn: Callable[[], torch.Tensor], distributed: bool, log: Log | None,
         on_step: Callable[[StepMetrics], None] | None = None,
         start_step: int = 0,
         after_step: Callable[[int, int], None] | None = None, *,
         launch_ahead: bool = False, drain_after: Callable[[int], bool] | None = None,
         time_group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[StepMetrics]:
    """The steps shared by both runs; returns the metrics every rank agrees on.

    ``step_fn`` runs forward and backward and returns this rank's share of the mean loss
    (``CE sum / global tokens``; 0 on ranks without the last pipeline stage); ``norm_fn``
    measures the global gradient norm and clips, returning it as a device tensor (read after the
    optimizer step is queued, so the host does not wait for the backward before launching it).
    ``on_step(m)`` runs on every rank after each
    step, outside its timing, before the finiteness check (trainer.observe: metrics, progress,
    profiler window; it may run collectives, at the same steps on every rank). Steps
    ``start_step + 1 .. train.steps`` run (a resumed run starts after its checkpoint's step);
    ``after_step(step, total)`` runs after each (the checkpointer saves there).

    ``launch_ahead`` (trainer.launch_ahead): step n+1's forward and backward are launched before
    step n is finished (its numbers read, ``on_step``, the check, ``after_step``); steps where
    ``drain_after(step)`` is true, and the last, are finished before the next launch. Step times
    are then host wall times between consecutive finishes. ``time_group``: the process group of
    the step time's max over ranks (a host-side one, so the host never waits for the device
    there; None: the default group). ``timeout_s`` bounds each wait for a step's end.
    """
    total = config.train.steps
    if start_step >= total:
        raise CheckpointError(f"the checkpoint is at step {start_step} and train.steps={total}: "
                              f"nothing left to train (raise train.steps)")
    out: list[StepMetrics] = []
    last_end = 0.0  # host time the previous step finished (or the device was drained)

    def finish(launched: LaunchedStep) -> None:
        nonlocal last_end
        wait_for(launched.done, timeout_s, f"training step {launched.step}")
        now = time.perf_counter()
        elapsed, last_end = now - last_end, now
        if distributed and dist.get_world_size(time_group) > 1:
            t = torch.tensor([elapsed], dtype=torch.float64)
            if time_group is None:
                t = t.to(device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=time_group)
            elapsed = float(t)
        loss, grad_norm = (float(x) for x in launched.scalars)
        m = StepMetrics(launched.step, loss, grad_norm, launched.lr, launched.tokens, elapsed,
                        launched.tokens / elapsed)
        if on_step is not None:
            on_step(m)
        _check_finite(m)
        out.append(m)
        if log is not None and (m.step % config.train.log_every == 0 or m.step == total):
            log(format_step(m, total))
        if after_step is not None:
            after_step(m.step, total)

    pending: LaunchedStep | None = None
    for step in range(start_step, total):
        batch = batch_for(step)
        if pending is None:  # a drained device: this step's time starts here
            platform.synchronize(device)
            last_end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with step_context(step + 1):  # a failure names rank, step, stage, action (errors.py)
            share = step_fn(batch)
        if pending is not None:
            finish(pending)
            pending = None
        with step_context(step + 1):
            norm = norm_fn()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        loss = share.float().reshape(1).clone()
        if distributed:
            dist.all_reduce(loss)
        scalars, done = queue_scalars(loss, norm, device)
        pending = LaunchedStep(step + 1, lr, batch.global_tokens, scalars, done)
        if not launch_ahead or step + 1 == total or (drain_after is not None
                                                     and drain_after(step + 1)):
            finish(pending)
            pending = None
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
    acc = config.train.accelerator
    results = spawn(rank_main, acc.resolved_world_size, args=(config.model_dump(), quiet),
                    device=acc.device, timeout_s=timeout_s)
    return TrainResult.from_dict(results[0])
