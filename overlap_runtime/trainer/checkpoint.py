"""Checkpoint and resume with ``torch.distributed.checkpoint`` (DCP), complete or invisible.

What a checkpoint holds (one DCP checkpoint directory, ``<checkpoint.dir>/step-00000005``):

- ``model.*``: every parameter under its global name (pipeline stages keep the whole model's
  names, ``models.pipeline_split``), as the FSDP2 DTensor shard each rank holds;
- ``optim.*``: the AdamW state, flattened per parameter name
  (``StateDictOptions(flatten_optimizer_state_dict=True)``, so pipeline ranks holding different
  parameters never collide on one key);
- routed experts one entry per *global* expert (``...experts.w1/expert00003``): an EP rank holds
  ``num_experts / ep`` consecutive experts and FSDP2 shards those again, so no single DTensor
  describes the global ``[E, ...]`` tensor; per-expert rows do, under any ep x efsdp split;
- ``train.*``: the step, the LR scheduler, the data position (``dataset.state_dict()``), the
  layout it was saved under, and ``rng.rank<r>.*`` RNG states per rank.

DCP reads each rank's slices of every saved tensor whatever layout wrote them, so a checkpoint
saved under one layout loads under another (``cp2 -> cp4``, ``pp2 x ep2 -> pp1``, or into the
single-device baseline); RNG states are restored only under the same world size and layout.

**Complete or invisible.** Every rank writes into ``.tmp-step-00000005``; DCP's coordinator writes
``.metadata`` only after every rank's data is written, and rank 0 then renames the directory to
``step-00000005`` (an atomic rename on one filesystem) and fsyncs the parent. A run killed at any
point of a save leaves at most a ``.tmp-*`` directory, which resume ignores and the next run's
rank 0 deletes. ``async_save`` stages the state to host memory, writes in a background thread
over a separate gloo group, and commits when that finishes (waited for, with
``checkpoint.timeout_s``, before the next save and at the end of the run).

``OVERLAP_RUNTIME_CHECKPOINT_FAULT=step=<s>,rank=<r>`` (tests only) kills rank ``r`` with SIGKILL
after it has written its data of the save at step ``s`` and before the checkpoint is committed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from overlap_runtime.moe.experts import GroupedExperts

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "FAULT_ENV",
    "checkpoint_step",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_resume",
    "step_dir_name",
]

FAULT_ENV = "OVERLAP_RUNTIME_CHECKPOINT_FAULT"
_STEP_RE = re.compile(r"^step-(\d{8})$")
_TMP_PREFIX = ".tmp-"
_EXPERT_SEP = "/expert"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or resumed; the message names the path and the rule."""


def step_dir_name(step: int) -> str:
    """``step-00000005``: the directory of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``directory`` as ``(step, path)``, oldest first.

    Complete: named ``step-NNNNNNNN`` (committed by rename) and holding DCP's ``.metadata``.
    ``.tmp-*`` directories of an interrupted save are never listed.
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for child in d.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / ".metadata").is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``directory`` (None: none)."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def resolve_resume(config: Any) -> Path | None:
    """The checkpoint that ``checkpoint.resume`` names (None: start fresh); reads only the
    filesystem, so launchers check it before starting ranks.

    ``None``: start fresh, and refuse a ``checkpoint.dir`` that already holds checkpoints (they
    would be overwritten); ``"latest"``: the newest complete one (error if none); ``"auto"``: the
    newest if any, else fresh; another string: that checkpoint directory.

    Raises:
        CheckpointError: naming the field and the path.
    """
    d = Path(config.dir) if config.dir is not None else None
    if config.resume is None:
        if d is not None and (found := latest_checkpoint(d)) is not None:
            raise CheckpointError(
                f"checkpoint.dir={str(d)!r} already holds checkpoints (newest {found.name}): "
                f"resume with --resume (checkpoint.resume: latest or auto) or choose another "
                f"checkpoint.dir")
        return None
    if config.resume in ("latest", "auto"):
        found = latest_checkpoint(d) if d is not None else None
        if found is None and config.resume == "latest":
            raise CheckpointError(f"checkpoint.resume=latest: no complete checkpoint in "
                                  f"checkpoint.dir={str(d)!r}")
        return found
    path = Path(config.resume)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint.resume={config.resume!r}: not a complete checkpoint "
                              f"(no .metadata in it)")
    return path


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-NNNNNNNN`` (None: another name)."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


class _Parts(nn.Module):
    """This rank's pipeline stages as one module whose parameter names are the whole model's
    (each ``Qwen3_5Stage`` keeps global names; the stages of one rank never share a name)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        layers = nn.ModuleDict()
        for part in parts:
            for name, child in part.named_children():
                if name == "layers":
                    for key, layer in child.items():
                        layers[key] = layer
                elif child is not None:
                    if name in self._modules:
                        raise CheckpointError(f"two pipeline stages of this rank both hold "
                                              f"{name!r}")
                    self.add_module(name, child)
        self.add_module("layers", layers)


def _expert_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    """``{parameter name: module}`` of every routed-expert weight in ``model``."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            for w in ("w1", "w2", "w3"):
                out[f"{name}.{w}" if name else w] = mod
    return out


def _local_rows(value: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local tensor of ``value`` and the index of its first row within the (EP-local)
    tensor: FSDP2 shards dim 0, possibly unevenly."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                          value.placements)
        return value.to_local(), int(offset[0])
    return value, 0


def _split_experts(sd: dict[str, Any], experts: dict[str, GroupedExperts],
                   key_of: Callable[[str], list[str]]) -> dict[str, Any]:
    """``sd`` with each routed-expert tensor replaced by one view per global expert
    (``<key>/expert<e>``), so the keys describe the global ``[E, ...]`` weight."""
    out = dict(sd)
    for fqn, mod in experts.items():
        for key in key_of(fqn):
            if key not in out:
                continue
            local, first = _local_rows(out.pop(key))
            for i in range(local.shape[0]):
                e = mod.expert_offset + first + i
                out[f"{key}{_EXPERT_SEP}{e:05d}"] = local[i]
    return out


def _optim_keys(fqn: str) -> list[str]:
    return [f"state.{fqn}.exp_avg", f"state.{fqn}.exp_avg_sq"]


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(),
                             "python": repr(random.getstate())}
    if device.type == "cuda" and torch.cuda.is_available():
        state["torch_device"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    if "torch_device" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["torch_device"], device)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes" a single process even when ``no_dist=True`` says so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _FaultWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that SIGKILLs this process after writing its data (tests only)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        fut.wait()
        os.kill(os.getpid(), signal.SIGKILL)
        return fut  # not reached


def _fault_for(step: int, rank: int) -> bool:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    try:
        fields = dict(part.split("=", 1) for part in spec.split(","))
        return int(fields["step"]) == step and int(fields["rank"]) == rank
    except (KeyError, ValueError):
        raise CheckpointError(f"{FAULT_ENV}={spec!r}: expected 'step=<s>,rank=<r>'") from None


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resumed run starts: ``step`` optimizer steps already taken, from ``path``."""

    step: int
    path: Path
    same_layout: bool


class Checkpointer:
    """Saves and restores one run's state (see the module docstring).

    Args:
        config: the ``checkpoint`` section (``CheckpointConfig``).
        modules: this rank's model parts (pipeline stages in order, or the one model).
        optimizer, scheduler: the run's AdamW and LR scheduler.
        dataset: the data source; its ``state_dict()`` / ``load_state_dict(d)`` (if it has them)
            are saved and checked on resume.
        layout: a label of the parallel layout (RNG states are restored only under the same
            label and world size).
        device: this rank's device (its RNG state is saved).
        log: rank 0's progress lines (None: silent).
        distributed: False for a single-process run, even inside a process group (no
            collective, DCP's ``no_dist``).

    Collective: every rank of the default process group (if one is initialised) constructs it
    and calls :meth:`resume`, :meth:`after_step` and :meth:`close` in the same order.
    """

    def __init__(self, config: Any, modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                 scheduler: Any, dataset: Any, *, layout: str, device: torch.device,
                 model_config: dict[str, Any] | None = None,
                 log: Callable[[str], None] | None = None, distributed: bool = True) -> None:
        self.config = config
        self.dir = Path(config.dir) if config.dir is not None else None
        self.model = modules[0] if len(modules) == 1 else _Parts(modules)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataset = dataset
        self.layout = layout
        self.device = device
        self.model_config = model_config
        self.log = log or (lambda line: None)
        # the single-device run (train_single) may run inside an initialised process group (a
        # baseline on rank 0 alone): it must never enter a collective
        self.distributed = distributed and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._experts = _expert_modules(self.model)
        self._pending: tuple[Any, int, Path, float] | None = None
        self._async_pg = None
        if config.async_save and self.distributed:
            # DCP's background thread runs its own collectives: never on the training group.
            self._async_pg = dist.new_group(backend="gloo")
        if self.dir is not None and self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for child in self.dir.iterdir():  # leftovers of an interrupted save
                if child.name.startswith(_TMP_PREFIX):
                    shutil.rmtree(child, ignore_errors=True)
        self._barrier()

    # ---- state ---------------------------------------------------------------------------

    def _barrier(self) -> None:
        """Every rank reached this point (bounded: ``checkpoint.timeout_s``, then an error
        naming the wait, never a hang)."""
        if self.distributed:
            from overlap_runtime.ops import comm

            probe = torch.zeros(1, device=self.device)
            comm.all_gather(probe, 0, None, self.config.timeout_s)

    def _model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        msd, osd = get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
        return msd, osd

    def _train_state(self, step: int) -> dict[str, Any]:
        data_state = self.dataset.state_dict() if hasattr(self.dataset, "state_dict") else None
        return {"step": step, "scheduler": json.dumps(self.scheduler.state_dict()),
                "data": json.dumps(data_state), "layout": self.layout, "world_size": self.world,
                "model_config": json.dumps(self.model_config)}

    def _state(self, step: int, msd: dict[str, Any], osd: dict[str, Any],
               with_rng: bool) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": _split_experts(msd, self._experts, lambda f: [f]),
            "optim": _split_experts(osd, self._experts, _optim_keys),
            "train": self._train_state(step),
        }
        if with_rng:
            state["rng"] = {f"rank{self.rank}": _rng_state(self.device)}
        return state

    # ---- save ----------------------------------------------------------------------------

    def due(self, step: int, total: int) -> bool:
        """Whether :meth:`after_step` saves after ``step`` of ``total`` steps."""
        c = self.config
        if self.dir is None:
            return False
        return bool((c.interval and step % c.interval == 0) or (c.save_final and step == total))

    def after_step(self, step: int, total: int) -> None:
        """Save after optimizer step ``step`` when ``checkpoint.interval`` or the final step asks
        for it (every rank calls it after every step)."""
        if self.due(step, total):
            self.save(step)

    def save(self, step: int) -> None:
        """Write the checkpoint of ``step`` (sync: committed on return; async: staged, committed
        when the background write finishes)."""
        assert self.dir is not None
        self._finish_pending()
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}"
        msd, osd = self._model_optim()
        state = self._state(step, msd, osd, with_rng=True)
        writer: dcp.FileSystemWriter = (_FaultWriter(tmp) if _fault_for(step, self.rank)
                                        else dcp.FileSystemWriter(tmp))
        t0 = time.perf_counter()
        if self.config.async_save and self.distributed:
            resp = dcp.async_save(state, storage_writer=writer, process_group=self._async_pg)
            fut = getattr(resp, "upload_completion", resp)
            self._pending = (fut, step, tmp, t0)
            self.log(f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f} s, "
                     f"writing in the background")
            return
        with _quiet_single_process():
            dcp.save(state, storage_writer=writer, no_dist=not self.distributed)
        self._commit(step, tmp, final, t0)

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        fut, step, tmp, t0 = self._pending
        self._pending = None
        if isinstance(fut, Future):
            try:
                fut.result(timeout=self.config.timeout_s)
            except TimeoutError:
                raise CheckpointError(
                    f"rank {self.rank}: the asynchronous save of step {step} to {tmp} did not "
                    f"finish within checkpoint.timeout_s={self.config.timeout_s} s") from None
        assert self.dir is not None
        self._commit(step, tmp, self.dir / step_dir_name(step), t0)

    def _commit(self, step: int, tmp: Path, final: Path, t0: float) -> None:
        """Rank 0 renames the finished directory into place and prunes old checkpoints (DCP's
        ``.metadata`` exists once any rank's save returns: it is written after every rank's
        data)."""
        if self.rank != 0:
            return
        if not (tmp / ".metadata").is_file():
            raise CheckpointError(f"checkpoint of step {step}: {tmp}/.metadata is missing after "
                                  f"the save returned")
        if self.model_config is not None:
            (tmp / "config.json").write_text(json.dumps(
                {"model": self.model_config, "layout": self.layout, "world_size": self.world,
                 "step": step}, indent=2))
        if final.exists():  # an earlier run's checkpoint of the same step
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.log(f"checkpoint: step {step} saved to {final} in {time.perf_counter() - t0:.2f} s")
        keep = self.config.keep_last
        if keep is not None:
            for _, old in list_checkpoints(final.parent)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Wait for (and commit) an asynchronous save still in flight."""
        self._finish_pending()

    # ---- resume --------------------------------------------------------------------------

    def resolve_resume(self) -> Path | None:
        """The checkpoint ``checkpoint.resume`` names (see :func:`resolve_resume`)."""
        return resolve_resume(self.config)

    def resume(self) -> ResumeInfo | None:
        """Load the checkpoint ``checkpoint.resume`` names into the model, optimizer, scheduler
        and dataset; returns where training continues (None: a fresh start)."""
        path = self.resolve_resume()
        if path is None:
            return None
        t0 = time.perf_counter()
        no_dist = not self.distributed
        train = self._train_state(0)
        try:
            with _quiet_single_process():
                dcp.load({"train": train}, checkpoint_id=path, no_dist=no_dist)
        except Exception as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
        self._check_compatible(train, path)
        same_layout = train["layout"] == self.layout and train["world_size"] == self.world
        msd, osd = self._model_optim()  # initialises the optimizer state (a zero-lr step)
        state = self._state(0, msd, osd, with_rng=same_layout)
        state.pop("train")
        try:
            with _quiet_single_process():
                dcp.load(state, checkpoint_id=path, no_dist=no_dist)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this model / layout: "
                                  f"{exc}") from exc
        # DCP copies tensors in place (the per-expert views write into msd / osd's storage)
        # but *replaces* non-tensor values (the optimizer's lr, betas...) in the dict it loaded
        for whole, loaded in ((msd, state["model"]), (osd, state["optim"])):
            for key in whole:
                if key in loaded:
                    whole[key] = loaded[key]
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd,
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
        self.scheduler.load_state_dict(json.loads(train["scheduler"]))
        data_state = json.loads(train["data"])
        step = int(train["step"])
        if data_state is not None and hasattr(self.dataset, "load_state_dict"):
            try:
                self.dataset.load_state_dict(data_state)
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {path}: the data is not the data of the run "
                                      f"that saved it: {exc}") from None
            position = getattr(self.dataset, "position", step)
            if position != step:
                raise CheckpointError(f"checkpoint {path}: saved at step {step} but its data "
                                      f"position is step {position}")
        if same_layout:
            _set_rng_state(state["rng"][f"rank{self.rank}"], self.device)
        self.log(f"checkpoint: resumed from {path} (step {step}"
                 + ("" if same_layout else f", saved under {train['layout']} on "
                    f"{train['world_size']} ranks: resharded, RNG states not restored")
                 + f") in {time.perf_counter() - t0:.2f} s")
        return ResumeInfo(step, path, same_layout)

    def _check_compatible(self, train: dict[str, Any], path: Path) -> None:
        saved = json.loads(train["model_config"])
        if saved is not None and self.model_config is not None and saved != self.model_config:
            diff = sorted(k for k in set(saved) | set(self.model_config)
                          if saved.get(k) != self.model_config.get(k))
            raise CheckpointError(
                f"checkpoint {path} was saved for another model: "
                + ", ".join(f"model.{k}={saved.get(k)!r} there, {self.model_config.get(k)!r} "
                            f"here" for k in diff))
