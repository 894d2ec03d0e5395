"""``overlap-runtime demo``: the trainer on PP=2 x EP=2 with OVERLAP_B_F, checked against itself.

The trainer trains the Qwen3.5-style hybrid (Gated DeltaNet + attention, every MLP a MoE) from a
YAML config, by default :data:`DEFAULT_CONFIG_YAML` (= ``configs/demo_pp2_ep2.yaml``): pp=2 x
dp_shard=2 with EP=2 borrowed from dp_shard, FSDP2, Interleaved 1F1B with two chunks per rank.
On every rank (4 CPU ranks spawned here on gloo, or torchrun's) the config is trained twice from
the same seed, each time by ``trainer.loop.train_distributed`` (which builds meshes and model):

* the **baseline**: ``train.pipeline.overlap_b_f: false`` (plain all-to-alls, no coordinator);
* the **overlapped run**: ``overlap_b_f: true``: in each OVERLAP_B_F step the backward of one
  microbatch (worker thread) and the forward of another (caller thread) hand the EP all-to-alls
  back and forth through the HookCoordinator (``debug=True``: its launch log is kept).

Both runs get an ``ExecutionTrace`` (``trace=``; the last step is kept) and hand their built
model to ``on_model=``. Printed: the schedule grid, each step's loss and grad norm beside the
baseline's (equal within :data:`TOL` relative; every parameter after the last step too), the
launch-order check on every EP group, the measured share of all-to-all time hidden behind the
other thread's compute (last step's trace), the share the task-graph simulator predicts for the
compiled step priced with op costs measured in the baseline's last step, and one merged Chrome
trace (measured and predicted).
A PP x EP job built by hand, without the trainer: ``tests/support/pp_ep_job.py``
(tests/moe/test_moe_pp_ep.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Sequence

from overlap_runtime.cli import demo_arguments as add_arguments
from overlap_runtime.cli import DEMO_CONFIG_NAME as DEFAULT_CONFIG_NAME
from overlap_runtime.config.train import (ConfigError, apply_overrides, config_from_dict,
                                          load_config, schedule_spec)
from overlap_runtime.graph import chrome_trace, format_grid
from overlap_runtime.graph.comm_overlap import simulated_a2a_overlap
from overlap_runtime.launch import check_world, init_from_env, launched_by_torchrun, spawn
from overlap_runtime.models.pipeline_split import split_layers
from overlap_runtime.moe.parallel import moe_layers
from overlap_runtime.moe.step_costs import moe_op_seconds, op_costs_from_trace
from overlap_runtime.ops import comm
from overlap_runtime.pipeline import ExecutionTrace, gather_traces
from overlap_runtime.pipeline.exec_trace import chrome_trace_events
from overlap_runtime.schedules import ActionKind, compile_spec
from overlap_runtime.stepgraph.compose import compile_step
from overlap_runtime.stepgraph.pricing import predict_priced
from overlap_runtime.testing import rel_l2
from overlap_runtime.trainer.a2a_overlap import trace_a2a_overlap
from overlap_runtime.trainer.loop import train_distributed

TOL = 1e-6

# The text of configs/demo_pp2_ep2.yaml (tests/test_demo.py keeps the two equal): embedded so that
# the installed command runs from any directory.
DEFAULT_CONFIG_YAML = """\
# The demo (`make demo` = `overlap-runtime demo`; embedded in overlap_runtime/demo.py, which a
# test keeps equal to this file): the trainer on 4 CPU ranks (gloo), PP=2 x EP=2.
#   layout:   pp=2 x dp_shard=2 (FSDP2 over 2 ranks); EP=2 borrowed from dp_shard
#   model:    Qwen3.5-style hybrid, 4 decoder layers (3 Gated DeltaNet + 1 attention), hidden 32,
#             every MLP a MoE: 4 routed experts (2 per EP rank) + a shared expert
#   schedule: Interleaved 1F1B, 2 chunks per pipeline rank (1 decoder layer each), 4 microbatches,
#             OVERLAP_B_F (the forward of one microbatch and the backward of another on two
#             threads, the EP all-to-alls handed over by the HookCoordinator)
# The demo trains it twice in the same ranks from the same seed, with this overlap_b_f: true and
# with overlap_b_f: false (the baseline), and checks the losses agree within 1e-6 relative.
#
# num_experts_per_tok == num_experts: every token visits every expert, so the router's top-k has
# no near-ties that a last-bit difference could flip (a flip sends a token to other experts and
# the runs drift apart from there on: a multi-step comparison turns chaotic). With it this config
# also matches one device:  overlap-runtime train configs/demo_pp2_ep2.yaml --compare-single
model:
  hidden_size: 32
  num_hidden_layers: 4
  intermediate_size: 64
  mlp: moe
  num_experts: 4
  num_experts_per_tok: 4
  moe_intermediate_size: 32
  shared_expert_intermediate_size: 32
data:
  seq_len: 64                   # tokens per sequence
  batch_size: 4                 # sequences per data-parallel rank per step: 4 microbatches of 1
train:
  steps: 5
  seed: 0
  precision: fp32
  accelerator:
    device: cpu
    world_size: 4
    pp: 2
    ep: 2
    cp: 1
    comm_timeout_s: 60          # every communication wait is bounded
  pipeline:
    schedule: interleaved_1f1b
    microbatches: 4
    virtual_stages: 2
    overlap_b_f: true
"""

# ----------------------------------------------------------------------------- configuration


def demo_problems(config: Any) -> list[str]:
    """The demo's own rules on top of the trainer's (empty: the config is fit for the demo)."""
    acc, pl = config.train.accelerator, config.train.pipeline
    out = []
    if acc.pp < 2:
        out.append(f"train.accelerator.pp={acc.pp}: the demo runs a pipeline, it needs pp >= 2")
    if acc.ep < 2:
        out.append(f"train.accelerator.ep={acc.ep}: the demo overlaps expert-parallel "
                   f"all-to-alls, it needs ep >= 2 (and model.mlp: moe)")
    if not pl.overlap_b_f:
        out.append("train.pipeline.overlap_b_f=false: the demo compares overlap_b_f: true with a "
                   "baseline run without it; set it to true")
    return out


def load_demo_config(path: str | None, steps: int | None = None, pp: int | None = None,
                     ep: int | None = None, timeout_s: float | None = None,
                     world_size: int | None = None, sets: Sequence[str] = ()) -> Any:
    """The validated ``TrainConfig`` of the demo: ``path`` (None: the embedded default) with the
    command line's overrides; every size is checked here, before any rank starts.

    ``sets`` are ``--set DOTTED.FIELD=VALUE`` assignments (``config.train.apply_overrides``),
    applied first; ``steps`` sets ``train.steps``; ``pp`` / ``ep`` set those degrees, ``dp_shard =
    ep`` (EP over the whole data-parallel dimension) and the world size to ``pp x dp_replicate x
    ep x cp``. Everything is validated once, together, by the trainer's rules. ``timeout_s``
    becomes ``train.accelerator.comm_timeout_s`` when the config leaves it unset; ``world_size``
    (torchrun's) fills ``train.accelerator.world_size`` when the config leaves it unset.

    Raises:
        ConfigError: one message naming every broken rule (trainer rules, then the demo's).
    """
    import yaml

    if path is None:
        source = f"(embedded {DEFAULT_CONFIG_NAME})"
        config = config_from_dict(yaml.safe_load(DEFAULT_CONFIG_YAML), source)
    else:
        source = path
        config = load_config(path)
    assignments, flags = list(sets), [f"--set {a}" for a in sets]
    if steps is not None:
        assignments.append(f"train.steps={steps}")
        flags.append(f"--steps {steps}")
    if pp is not None or ep is not None:
        acc = config.train.accelerator
        degree = acc.ep if ep is None else ep
        assignments += [f"train.accelerator.pp={acc.pp if pp is None else pp}",
                        f"train.accelerator.ep={degree}", f"train.accelerator.dp_shard={degree}",
                        "train.accelerator.world_size=null"]  # pp x dp_replicate x ep x cp
        flags += [f"--{k} {v}" for k, v in (("pp", pp), ("ep", ep)) if v is not None]
    if flags:
        source += " with " + " ".join(flags)
        config = apply_overrides(config, assignments, source)
    fill = []
    if config.train.accelerator.world_size is None and world_size is not None:
        fill.append(f"train.accelerator.world_size={world_size}")
    if config.train.accelerator.comm_timeout_s is None and timeout_s is not None:
        fill.append(f"train.accelerator.comm_timeout_s={timeout_s!r}")
    if fill:
        config = apply_overrides(config, fill, source)
    problems = demo_problems(config)
    if problems:
        raise ConfigError(f"{source} does not fit the demo: " + "; ".join(problems))
    return config


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


# ----------------------------------------------------------------------------- on every rank


def _ep_group(pm: Any) -> Any:
    """The process group every MoE dispatcher of ``pm`` all-to-alls over (its launch log's key)."""
    groups = {id(m.dispatcher.group): m.dispatcher.group
              for part in pm.modules() for m in moe_layers(part)}
    if len(groups) != 1:
        raise RuntimeError(f"the overlapped model's MoE layers use {len(groups)} EP groups; the "
                           f"demo checks the launch order on exactly one")
    return next(iter(groups.values()))


def _param_diff(baseline: Any, overlapped: Any) -> tuple[float, int]:
    """Worst relative L2 difference of this rank's parameter shards between the two models."""
    a, b = ({f"S{s}.{n}": p for s, part in sorted(pm.parts.items())
             for n, p in part.named_parameters()} for pm in (baseline, overlapped))
    if a.keys() != b.keys():
        raise RuntimeError(f"the baseline and the overlapped model differ in parameters: "
                           f"{sorted(a.keys() ^ b.keys())[:5]}")

    def local(p: Any) -> Any:
        to_local = getattr(p, "to_local", None)
        return (to_local() if to_local is not None else p).detach()

    worst = 0.0
    for name in a:
        worst = _worse(worst, rel_l2(local(b[name]), local(a[name])))
    return worst, len(a)


def predict_overlap(config: Any, baseline_events: list[Any]) -> dict[str, Any]:
    """The all-to-all overlap the task-graph simulator predicts for ``config``: the compiled
    step (``stepgraph.compile_step``) with ``overlap_b_f`` on and off, each priced with the op
    costs measured in the baseline's trace (``moe.step_costs``) and simulated
    (``stepgraph.pricing``). Returns the predicted shares (OVERLAP_B_F all-to-alls, all
    all-to-alls), both step times, the costs and the overlapped step's timeline."""
    steps = {}
    for name, overlap_b_f in (("baseline", False), ("overlap", True)):
        data = config.model_dump()
        data["train"]["pipeline"]["overlap_b_f"] = overlap_b_f
        steps[name] = compile_step(type(config).model_validate(data))
    layers_of = {s: len(layers) for s, layers in enumerate(steps["overlap"].stage_layers)}
    costs = op_costs_from_trace(baseline_events, layers_of)
    pred = {name: predict_priced(sg, moe_op_seconds(costs, sg)) for name, sg in steps.items()}
    ovl = pred["overlap"].result
    return {"predicted": simulated_a2a_overlap(ovl, paired_only=True).share,
            "predicted_all": simulated_a2a_overlap(ovl).share,
            "predicted_step_s": pred["overlap"].step_s,
            "predicted_serial_step_s": pred["baseline"].step_s,
            "costs": costs.to_dict(),
            "sim_trace": chrome_trace(ovl, time_scale=1e6)}  # seconds -> microseconds


def _demo_rank(config: Any, device: Any, timeout_s: float) -> dict[str, Any] | None:
    """The demo on this rank of the initialised default process group.

    Returns the report on global rank 0 (losses, checks, overlap figures, trace events), None
    elsewhere. Raises whatever the training raises (a mismatch is reported, not raised).
    """
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    # sizes and coordinates only: train_distributed checks the world size and builds the meshes
    dims = config.train.accelerator.layout()
    coords = dims.coordinates(rank)

    runs: dict[str, dict[str, Any]] = {}
    models: dict[str, Any] = {}
    started: dict[str, float] = {}
    for name, overlap_b_f in (("baseline", False), ("overlap", True)):
        data = config.model_dump()
        data["train"]["pipeline"]["overlap_b_f"] = overlap_b_f
        cfg = type(config).model_validate(data)
        trace = ExecutionTrace(rank=rank)

        def on_model(pm: Any, name: str = name) -> None:
            models[name] = pm
            started[name] = time.perf_counter()  # the training, without the build

        result = train_distributed(cfg, device, lambda line: None, trace=trace,
                                   on_model=on_model, debug=True)
        runs[name] = {"steps": [dataclasses.asdict(s) for s in result.steps],
                      "wall_s": time.perf_counter() - started[name],
                      "events": [dataclasses.replace(e, rank=rank) for e in trace.events]}
    ovl = models["overlap"]  # closed by train_distributed; its log and parameters stay readable
    if ovl.overlap is None:
        raise RuntimeError("the overlapped model has no CommComputeOverlap: the demo needs "
                           "ep > 1, pp > 1 and overlap_b_f")
    launches = ovl.overlap.coordinator.serializer.check_launch_order(_ep_group(ovl), timeout_s)
    param_err, n_params = _param_diff(models["baseline"], ovl)
    paired = sum(1 for a in ovl.schedule.program if a.kind is ActionKind.OVERLAP_B_F)

    row = torch.tensor([[rank, coords["pp"], coords["ep"], launches, param_err, n_params,
                         paired]], dtype=torch.float64)
    with torch.no_grad():
        rows = comm.all_gather(row, 0, None, timeout_s).tolist()
    gathered = {name: gather_traces(ExecutionTrace(rank=rank, events=r["events"]), None,
                                    timeout_s) for name, r in runs.items()}
    if rank != 0:
        return None
    return {
        "world": world, "num_parameters": ovl.num_parameters,
        "ranks": [{"rank": int(r[0]), "pp_rank": int(r[1]), "ep_rank": int(r[2]),
                   "launches": int(r[3]), "param_err": r[4], "param_tensors": int(r[5]),
                   "paired_steps": int(r[6])} for r in rows],
        "steps": {name: r["steps"] for name, r in runs.items()},
        "run_wall_s": {name: r["wall_s"] for name, r in runs.items()},
        "measured": trace_a2a_overlap(gathered["overlap"], paired_only=True).to_dict(1e-9),
        "measured_all": trace_a2a_overlap(gathered["overlap"]).to_dict(1e-9),
        "events": gathered["overlap"],
        **predict_overlap(config, gathered["baseline"]),
    }


def _spawned_rank(rank: int, world: int, config_dict: dict[str, Any],
                  timeout_s: float) -> dict[str, Any] | None:
    """Entry point of a spawned rank."""
    config = config_from_dict(config_dict)
    return _demo_rank(config, config.train.accelerator.device, timeout_s)


# ----------------------------------------------------------------------------- printing


def _worse(a: float, b: float) -> float:
    """The larger error; NaN (a non-finite value on either side) counts as infinitely bad."""
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return max(a, b)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _print_header(config: Any, label: str, how: str) -> None:
    """The job's description and the schedule grid (before the ranks run)."""
    m, acc, pl = config.model, config.train.accelerator, config.train.pipeline
    dims = acc.layout()
    types = m.layer_types
    n_gdn = types.count("linear_attention")
    shared = " + a shared expert" if m.shared_expert_intermediate_size else ""
    print(f"overlap-runtime demo: the trainer on PP={dims.pp} x EP={dims.ep}, {dims.world_size} "
          f"{acc.device} ranks {how}")
    print(f"config: {label}")
    print(f"  model: Qwen3.5-style hybrid, {m.num_hidden_layers} decoder layers ({n_gdn} GDN + "
          f"{len(types) - n_gdn} attention), hidden {m.hidden_size}, every MLP a MoE: "
          f"{m.num_experts} experts, {m.num_experts_per_tok} per token{shared}")
    print(f"  layout: {dims.describe()}; FSDP2 over dp_shard x cp")
    counts = sorted({len(r) for r in split_layers(m.num_hidden_layers, dims.pp * pl.virtual_stages,
                                                  pl.layers_per_stage)})
    per_chunk = "/".join(map(str, counts))
    print(f"  pipeline: {pl.schedule}, {_n(pl.virtual_stages, 'chunk')} per rank "
          f"({per_chunk} decoder layer{'' if counts == [1] else 's'} each), {pl.microbatches} "
          f"microbatches of {config.data.batch_size // pl.microbatches} x "
          f"{config.data.seq_len} tokens, OVERLAP_B_F; {_n(config.train.steps, 'step')}, "
          f"{config.train.precision}, AdamW lr {config.optimizer.lr:g}, seed {config.train.seed}")
    compiled = compile_spec(schedule_spec(config))
    programs = {r: [str(a) for a in acts if a is not None and not a.is_comm]
                for r, acts in compiled.lowered.items()}
    print("schedule (compute steps per pipeline rank; every EP replica runs the same):")
    print(format_grid(programs))
    print(f"training it twice in the same ranks from seed {config.train.seed}: the baseline "
          f"(overlap_b_f: false), then overlap_b_f: true ...", flush=True)


def _write_merged_trace(events: list[Any], predicted: dict[str, Any], path: str) -> None:
    """Measured execution trace (a process per rank, a track per thread) plus the simulated
    step (``graph.chrome_trace`` dict; a process per rank, pid 100+) in one Chrome trace
    file."""
    measured = chrome_trace_events(events)
    for ev in predicted["traceEvents"]:
        ev["pid"] = 100 + ev["pid"]
        if ev.get("name") == "process_name":
            ev["args"]["name"] = f"predicted step, rank {ev['pid'] - 100}"
    measured["traceEvents"].extend(predicted["traceEvents"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(measured, fh)


def print_report(report: dict[str, Any], out: str, wall_s: float) -> int:
    """Print the results and write the merged trace; 0 when the runs agree, else 1."""
    base, ovl = report["steps"]["baseline"], report["steps"]["overlap"]
    print(f"\n{'step':>4}  {'loss overlap_b_f':>16}  {'loss baseline':>14}  {'rel diff':>8}  "
          f"{'grad_norm overlap_b_f':>21}  {'grad_norm baseline':>18}  step ms overlap / baseline")
    worst_loss = worst_norm = 0.0
    for o, b in zip(ovl, base):
        rl, rn = _rel(o["loss"], b["loss"]), _rel(o["grad_norm"], b["grad_norm"])
        worst_loss, worst_norm = _worse(worst_loss, rl), _worse(worst_norm, rn)
        print(f"{o['step']:>4}  {o['loss']:>16.8f}  {b['loss']:>14.8f}  {rl:>8.1e}  "
              f"{o['grad_norm']:>21.8e}  {b['grad_norm']:>18.8e}  "
              f"{o['step_time_s'] * 1e3:7.1f} / {b['step_time_s'] * 1e3:.1f}")
    if len(ovl) != len(base):
        worst_loss = float("inf")
    ranks = report["ranks"]
    worst_param = max(r["param_err"] for r in ranks)
    n_param = sum(r["param_tensors"] for r in ranks)
    worst = max(worst_loss, worst_norm, worst_param)
    ok = worst <= TOL
    print(f"vs baseline over {len(ovl)} steps: loss worst rel {worst_loss:.1e}, grad norm "
          f"{worst_norm:.1e}; {n_param} parameter shards after the last step (all ranks) "
          f"{worst_param:.1e}  {'ok' if ok else 'FAIL'} (tol {TOL:g})")
    counts = sorted({r["launches"] for r in ranks})
    paired = {r["pp_rank"]: r["paired_steps"] for r in ranks}
    print(f"launch order: {'/'.join(map(str, counts))} EP all-to-alls per rank in the "
          f"overlap_b_f run ({len(ovl)} steps), the same order on every rank of each EP group "
          f"(checked on all {report['world']} ranks); OVERLAP_B_F steps per step: "
          + ", ".join(f"{n} on pipeline rank {p}" for p, n in sorted(paired.items())))
    m = report["measured"]
    print(f"overlap ratio (measured, last step, all ranks): {m['share']:.1%} of all-to-all time "
          f"inside OVERLAP_B_F steps ran while the rank computed "
          f"({m['hidden_s'] * 1e3:.1f} of {m['a2a_s'] * 1e3:.1f} ms, {int(m['count'])} "
          f"all-to-alls); over the whole step: {report['measured_all']['share']:.1%}")
    print(f"overlap ratio (predicted by the task-graph simulator: the compiled step priced with "
          f"op costs measured in the baseline's last step): {report['predicted']:.1%} inside "
          f"OVERLAP_B_F steps, {report['predicted_all']:.1%} over the whole step; one step "
          f"{report['predicted_step_s'] * 1e3:.2f} ms overlapped vs "
          f"{report['predicted_serial_step_s'] * 1e3:.2f} ms serial (overlap_b_f: false)")
    _write_merged_trace(report["events"], report["sim_trace"], out)
    print(f"merged Chrome trace (measured ranks + predicted step): {os.path.abspath(out)}")
    rw = report["run_wall_s"]
    print(f"wall {wall_s:.1f}s (training: baseline {rw['baseline']:.1f}s, overlap_b_f "
          f"{rw['overlap']:.1f}s; {report['num_parameters']:,} parameters)")
    if not ok:
        print(f"demo FAILED: the overlapped run differs from the baseline (rel {worst:.2e} > "
              f"{TOL:g})")
        return 1
    print("demo OK")
    return 0


# ----------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        print(f"error: --timeout {args.timeout}: must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        torchrun = launched_by_torchrun()
        config = load_demo_config(args.config, args.steps, args.pp, args.ep, args.timeout,
                                  int(os.environ["WORLD_SIZE"]) if torchrun else None, args.set)
        acc = config.train.accelerator
        world = acc.resolved_world_size
        if not torchrun:
            check_world(acc.device, world)  # e.g. 4 ranks on 'cuda' with 2 GPUs
    except (ConfigError, RuntimeError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    label = f"{DEFAULT_CONFIG_NAME} (embedded default)" if args.config is None else args.config
    t0 = time.perf_counter()
    if torchrun:
        return _run_under_torchrun(config, label, args, t0)

    _print_header(config, label, "spawned here (gloo)" if acc.device == "cpu" else "spawned here")
    reports = spawn(_spawned_rank, world, args=(config.model_dump(), args.timeout),
                    device=acc.device, timeout_s=args.timeout)
    return print_report(reports[0], args.out, time.perf_counter() - t0)


def _run_under_torchrun(config: Any, label: str, args: argparse.Namespace, t0: float) -> int:
    """Every torchrun process joins the group; global rank 0 prints."""
    import torch.distributed as dist

    acc = config.train.accelerator
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != acc.resolved_world_size:  # before joining: every process fails the same way
        if rank == 0:
            print(f"error: torchrun started {world} processes but the config asks for "
                  f"train.accelerator.world_size={acc.resolved_world_size}; start "
                  f"--nproc-per-node {acc.resolved_world_size} or change the config",
                  file=sys.stderr)
        return 2
    if rank == 0:
        _print_header(config, label, "started by torchrun")
    ctx = init_from_env(acc.device, timeout_s=args.timeout)
    try:
        report = _demo_rank(config, ctx.device, args.timeout)
        return print_report(report, args.out, time.perf_counter() - t0) if report else 0
    finally:
        dist.destroy_process_group()
