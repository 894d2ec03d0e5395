"""``overlap-runtime train CONFIG.yaml``: FSDP2 + CP training of the Qwen3.5-style model.

Without torchrun's environment it spawns ``train.accelerator.world_size`` ranks itself (the
embedded CPU default, gloo); under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set:
``launch.launched_by_torchrun``; only some of them set is an error, exit code 2) every process
joins the group with ``launch.init_from_env``. Rank 0 prints one progress line per step (loss,
grad norm, tokens/s). ``--compare-single`` then trains the single-device baseline on the same
data and prints the largest loss and grad-norm differences; ``--metrics PATH`` (or
``train.metrics``) writes everything as JSON.

Errors are raised, never printed here: ``overlap_runtime.cli`` prints each as one line with its
exit code (``overlap_runtime.failure``). What can fail before a rank starts is checked first
(:func:`_check_before_ranks`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from overlap_runtime.config.cp import describe_cp_modes
from overlap_runtime.config.run import check_output_path
from overlap_runtime.config.train import ConfigError, apply_overrides, load_config
from overlap_runtime.launch import check_world, init_from_env, launched_by_torchrun
from overlap_runtime.trainer.checkpoint import CheckpointError, checkpoint_step, resolve_resume
from overlap_runtime.trainer.ckpt_lock import check_unlocked
from overlap_runtime.trainer.cli_args import add_train_arguments as add_arguments
from overlap_runtime.trainer.documents import check_first_records
from overlap_runtime.trainer.loop import (compare_runs, spawn_training, train_distributed,
                                          train_single)


def _summary(result: Any) -> dict[str, Any]:
    steady = result.steps[1:] or result.steps
    return {
        "final_loss": result.steps[-1].loss,
        "median_step_time_s": statistics.median(s.step_time_s for s in steady),
        "median_tokens_per_s": statistics.median(s.tokens_per_s for s in steady),
        "peak_memory_bytes": result.peak_memory_bytes,
    }


def _report(config: Any, result: Any, baseline: Any, metrics_path: str | None) -> None:
    summary = _summary(result)
    peak = summary["peak_memory_bytes"]
    print(f"{result.mode}: {len(result.steps)} steps, final loss {summary['final_loss']:.6f}, "
          f"median step {summary['median_step_time_s'] * 1e3:.1f} ms, "
          f"{summary['median_tokens_per_s']:,.0f} tokens/s"
          + (f", peak memory {peak / 2**20:.1f} MiB" if peak is not None else ""), flush=True)
    payload: dict[str, Any] = {"config": config.model_dump(mode="json"),
                               "run": result.to_dict(), "summary": summary}
    if baseline is not None:
        diff = compare_runs(result, baseline)
        payload["baseline"] = baseline.to_dict()
        payload["comparison"] = diff
        print(f"vs single device over {diff['steps']} steps: max |dloss| "
              f"{diff['max_abs_dloss']:.3e} (rel {diff['max_rel_dloss']:.3e}), max |dgrad_norm| "
              f"{diff['max_abs_dgrad_norm']:.3e} (rel {diff['max_rel_dgrad_norm']:.3e})",
              flush=True)
    if metrics_path:
        path = Path(metrics_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
        print(f"metrics written to {path}", flush=True)


def _config(args: argparse.Namespace) -> Any:
    """The validated configuration with the command line's overrides; any problem (a field, a
    device count, a half-set torchrun environment) is a ConfigError."""
    try:
        config = load_config(args.config)
        flags = {f"--set {a}": a for a in args.set}  # each flag validated with the rest, once
        flags.update({f"--{k.replace('_', '-')} {v}": f"{field}={v}" for k, field, v in (
            ("steps", "train.steps", args.steps),
            ("init_from", "model.init_from", args.init_from),
            ("world_size", "train.accelerator.world_size", args.world_size),
            ("resume", "checkpoint.resume", args.resume)) if v is not None})
        if flags:
            config = apply_overrides(config, list(flags.values()),
                                     f"{args.config} with {' '.join(flags)}")
        if not launched_by_torchrun():  # ranks spawned here: enough devices, before any starts
            check_world(config.train.accelerator.device,
                        config.train.accelerator.resolved_world_size)
    except ConfigError:
        raise
    except (ValueError, RuntimeError) as exc:  # DeviceUnavailableError, a torchrun half-set
        raise ConfigError(str(exc)) from exc
    return config


def _check_before_ranks(config: Any, metrics_path: str | None,
                        resume_and_lock: bool = True) -> None:
    """What can fail before any rank starts, checked now: the metrics file can be written, the
    checkpoint to resume exists (and has steps left), no other run holds ``checkpoint.dir``
    (``resume_and_lock``: under torchrun, rank 0 checks those two itself), and the data files'
    first records read (naming file and line)."""
    if metrics_path:
        try:
            check_output_path("--metrics" if metrics_path != config.train.metrics
                              else "train.metrics", metrics_path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if resume_and_lock:
        resume_from = resolve_resume(config.checkpoint)
        done = checkpoint_step(resume_from) if resume_from is not None else None
        if done is not None and done >= config.train.steps:
            raise CheckpointError(f"{resume_from} is at step {done} and train.steps="
                                  f"{config.train.steps}: nothing left to train (raise "
                                  f"train.steps)")
        if config.checkpoint.dir is not None:
            check_unlocked(config.checkpoint.dir)
    if config.data.files is not None:
        check_first_records(config.data)


def run(args: argparse.Namespace) -> int:
    """``overlap-runtime train``. Errors are raised (``overlap_runtime.cli`` prints each as one
    line: ConfigError, CheckpointError and DataError exit 2, a rank's runtime fault 1)."""
    import torch

    config = _config(args)
    metrics_path = args.metrics or config.train.metrics
    acc = config.train.accelerator
    log = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))

    if launched_by_torchrun():
        import torch.distributed as dist

        _check_before_ranks(config, metrics_path, resume_and_lock=False)  # rank 0 does those
        ctx = init_from_env(acc.device)
        result = train_distributed(config, ctx.device, log)
        dist.barrier()
        if ctx.rank != 0:
            dist.destroy_process_group()  # every rank leaves the group (torchrun aborts otherwise)
            return 0
        baseline = train_single(config, ctx.device) if args.compare_single else None
        _report(config, result, baseline, metrics_path)
        dist.destroy_process_group()
        return 0

    _check_before_ranks(config, metrics_path)
    dims = acc.layout()
    print(f"spawning {acc.resolved_world_size} {acc.device} ranks: {dims.describe()}, "
          f"dp={dims.dp}, cp modes (GDN/attention or per layer)="
          f"{describe_cp_modes(acc, config.model.layer_types)}"
          + (f", pipeline {config.train.pipeline.schedule}" if dims.pp > 1 else ""), flush=True)
    result = spawn_training(config, quiet=args.quiet)
    baseline = None
    if args.compare_single:
        device = torch.device("cuda:0" if acc.device == "cuda" else acc.device)
        print("single-device baseline:", flush=True)
        baseline = train_single(config, device, log)
    _report(config, result, baseline, metrics_path)
    return 0
