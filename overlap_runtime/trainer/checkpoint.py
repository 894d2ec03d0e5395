"""Checkpoint and resume with ``torch.distributed.checkpoint`` (DCP): complete or invisible,
verified before it is read, one run per directory.

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
  layout it was saved under, and ``rng.rank<r>.*`` RNG states per rank;
- ``config.json`` (the model and layout, for tools) and ``manifest.json`` (every file's size and
  SHA-256, written last: ``trainer.manifest``).

DCP reads each rank's slices of every saved tensor whatever layout wrote them, so a checkpoint
saved under one layout loads under another (``cp2 -> cp4``, ``pp2 x ep2 -> pp1``, or into the
single-device baseline); RNG states are restored only under the same world size and layout.

**Complete or invisible.** Every rank writes into ``.tmp-step-00000005`` and hashes the files it
wrote; DCP's coordinator writes ``.metadata`` only after every rank's data is written; rank 0
then writes ``manifest.json`` and renames the directory to ``step-00000005`` (replacing an older
copy without a moment where neither exists: ``trainer.ckpt_dir``). A run killed at any point of
a save leaves at most a ``.tmp-*`` directory, which resume ignores and the next run's rank 0
deletes. ``async_save`` stages the state to host memory, writes in a background thread over a
separate gloo group, and commits when that finishes (waited for, with ``checkpoint.timeout_s``,
before the next save and at the end of the run).

**Verified, and never executed.** Rank 0 alone decides what to resume (``checkpoint.resume``),
verifies every file of it against its manifest before anything is read (falling back, for
``latest`` / ``auto``, to the newest checkpoint that verifies, said in one line) and hands the
choice to every rank (a bounded collective), so all ranks load the same step. The load itself
unpickles nothing outside an allow-list (``trainer.ckpt_reader``).

**One run per directory.** Rank 0 holds an exclusive lock on ``checkpoint.dir`` from start-up
to the end of the run (``trainer.ckpt_lock``); a second run is refused naming the holder.

``OVERLAP_RUNTIME_CHECKPOINT_FAULT=step=<s>,rank=<r>`` (tests only) kills rank ``r`` with SIGKILL
after it has written its data of the save at step ``s`` and before the checkpoint is committed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from overlap_runtime.moe.experts import GroupedExperts
from overlap_runtime.ops import comm
from overlap_runtime.trainer.ckpt_dir import (TMP_PREFIX, checkpoint_step, choose_resume,
                                              commit_directory, latest_checkpoint,
                                              list_checkpoints, prune, recover, resolve_resume,
                                              step_dir_name)
from overlap_runtime.trainer.ckpt_lock import DirectoryLock
from overlap_runtime.trainer.ckpt_reader import SafeFileSystemReader, SafeLoadPlanner
from overlap_runtime.trainer.errors import CheckpointError
from overlap_runtime.trainer.manifest import (MANIFEST_NAME, verify_checkpoint, write_manifest,
                                              write_part)

FAULT_ENV = "OVERLAP_RUNTIME_CHECKPOINT_FAULT"
_EXPERT_SEP = "/expert"


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


class _HashingWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that hashes the files this rank wrote, right after writing them
    (``trainer.manifest.write_part``): the ranks hash their shares in parallel."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path)
        self.rank = rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        results = fut.wait()
        write_part(Path(self.path), self.rank,
                   {r.storage_data.relative_path for r in results})
        return fut


class _FaultWriter(_HashingWriter):
    """A writer that SIGKILLs this process after writing its data (tests only)."""

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


def _reason(exc: BaseException) -> str:
    """One line for what DCP raised: a :class:`CheckpointError` of ours inside its
    ``CheckpointException`` (which derives from ``BaseException``, not ``Exception``) as is,
    otherwise each failing rank's exception type and first line."""
    if isinstance(exc, CheckpointException):
        parts = []
        for rank, (inner, _) in sorted(exc.failures.items()):
            if isinstance(inner, CheckpointError):
                return str(inner)
            parts.append(f"rank {rank}: {_reason(inner)}")
        return "; ".join(parts) or "CheckpointException without failures"
    if isinstance(exc, CheckpointError):
        return str(exc)
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}".rstrip(": ")


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
    and calls :meth:`resume`, :meth:`after_step` and :meth:`close` in the same order. Rank 0
    holds ``checkpoint.dir``'s lock from construction to :meth:`close` / :meth:`release` (also
    released when a method raises, and when the process ends).
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
        self._lock: DirectoryLock | None = None
        self._resumed_from: Path | None = None
        self._async_pg = None
        if config.async_save and self.distributed:
            # DCP's background thread runs its own collectives: never on the training group.
            self._async_pg = dist.new_group(backend="gloo")
        try:
            notes = self._from_rank0(self._take_directory)
        except BaseException:
            self.release()
            raise
        for line in notes:
            self.log(line)

    # ---- rank 0 decides, every rank learns it ----------------------------------------------

    def _take_directory(self) -> list[str]:
        """Rank 0: create ``checkpoint.dir``, lock it, tidy what an interrupted run left."""
        if self.dir is None:
            return []
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint.dir={str(self.dir)!r} cannot be created: "
                                  f"{exc.strerror}") from None
        self._lock = DirectoryLock(self.dir)
        try:
            return recover(self.dir)
        except OSError as exc:
            self.release()
            raise CheckpointError(f"checkpoint.dir={str(self.dir)!r}: cannot clear what an "
                                  f"interrupted run left: {exc}") from None

    def _from_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0 alone, its JSON-able result (or its error, raised as the same
        :class:`CheckpointError` on every rank) handed to every rank by two all-gathers bounded
        by ``checkpoint.timeout_s`` (so every rank waits for rank 0 at most that long)."""
        if not self.distributed:
            return fn()
        if self.rank == 0:
            try:
                payload = {"ok": fn()}
            except Exception as exc:  # noqa: BLE001 - handed to every rank, then raised
                payload = {"error": _reason(exc)}
            blob = json.dumps(payload).encode()
        else:
            blob = b""

        with torch.no_grad():
            size = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
            sizes = comm.all_gather(size, 0, None, self.config.timeout_s).cpu()
            longest = int(sizes.max())
            buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
            if blob:
                buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            rows = comm.all_gather(buf.to(self.device), 0, None, self.config.timeout_s)
        first = bytes(rows.view(self.world, -1)[0, :int(sizes[0])].cpu().tolist())
        payload = json.loads(first.decode())
        if "error" in payload:
            raise CheckpointError(payload["error"])
        return payload["ok"]

    # ---- state ---------------------------------------------------------------------------

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
        when the background write finishes).

        Raises:
            CheckpointError: the save failed on some rank (a full disk, an unwritable
                directory), naming the step, the path and each failing rank's reason.
        """
        assert self.dir is not None
        self._finish_pending()
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        msd, osd = self._model_optim()
        state = self._state(step, msd, osd, with_rng=True)
        writer = (_FaultWriter if _fault_for(step, self.rank) else _HashingWriter)(tmp, self.rank)
        t0 = time.perf_counter()
        try:
            if self.config.async_save and self.distributed:
                resp = dcp.async_save(state, storage_writer=writer, process_group=self._async_pg)
                fut = getattr(resp, "upload_completion", resp)
                self._pending = (fut, step, tmp, t0)
                self.log(f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f} s, "
                         f"writing in the background")
                return
            with _quiet_single_process():
                dcp.save(state, storage_writer=writer, no_dist=not self.distributed)
        except (Exception, CheckpointException) as exc:  # DCP's derives from BaseException
            raise CheckpointError(f"rank {self.rank}: cannot save the checkpoint of step {step} "
                                  f"to {tmp}: {_reason(exc)}") from exc
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
            except (Exception, CheckpointException) as exc:
                raise CheckpointError(f"rank {self.rank}: the asynchronous save of step {step} "
                                      f"to {tmp} failed: {_reason(exc)}") from exc
        assert self.dir is not None
        self._commit(step, tmp, self.dir / step_dir_name(step), t0)

    def _commit(self, step: int, tmp: Path, final: Path, t0: float) -> None:
        """Rank 0 writes ``config.json`` and the manifest, renames the finished directory into
        place and prunes old checkpoints (DCP's ``.metadata`` exists once any rank's save
        returns: it is written after every rank's data, and every rank hashed its files
        before that)."""
        if self.rank != 0:
            return
        if not (tmp / ".metadata").is_file():
            raise CheckpointError(f"checkpoint of step {step}: {tmp}/.metadata is missing after "
                                  f"the save returned")
        try:
            if self.model_config is not None:
                (tmp / "config.json").write_text(json.dumps(
                    {"model": self.model_config, "layout": self.layout,
                     "world_size": self.world, "step": step}, indent=2))
            t_hash = time.perf_counter()
            write_manifest(tmp)
            hashed = time.perf_counter() - t_hash
            commit_directory(tmp, final)
        except OSError as exc:
            raise CheckpointError(f"checkpoint of step {step}: cannot commit {tmp} as {final}: "
                                  f"{exc}") from None
        self.log(f"checkpoint: step {step} saved to {final} in {time.perf_counter() - t0:.2f} s "
                 f"(manifest {hashed:.2f} s)")
        if self.config.keep_last is not None:
            protect = {self._resumed_from} if self._resumed_from is not None else set()
            prune(final.parent, step, self.config.keep_last, protect)

    def close(self) -> None:
        """Wait for (and commit) an asynchronous save still in flight, then release the
        directory's lock."""
        try:
            self._finish_pending()
        finally:
            self.release()

    def release(self) -> None:
        """Release ``checkpoint.dir``'s lock without committing anything (idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ---- resume --------------------------------------------------------------------------

    def resolve_resume(self) -> Path | None:
        """The checkpoint ``checkpoint.resume`` names, from the filesystem alone (see
        :func:`~overlap_runtime.trainer.ckpt_dir.resolve_resume`)."""
        return resolve_resume(self.config)

    def _choose(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        path, lines = choose_resume(self.config)
        # absolute: every rank loads this directory, whatever its working directory
        return {"path": None if path is None else os.path.abspath(path), "lines": lines,
                "verify_s": time.perf_counter() - t0}

    def resume(self) -> ResumeInfo | None:
        """Load the checkpoint ``checkpoint.resume`` names into the model, optimizer, scheduler
        and dataset; returns where training continues (None: a fresh start).

        Rank 0 chooses and verifies the checkpoint; every rank loads that one.

        Raises:
            CheckpointError: nothing to resume, a checkpoint that does not verify or does not
                fit this model / layout / data (the lock is released first).
        """
        try:
            return self._resume()
        except BaseException:
            self.release()
            raise

    def _load(self, state: dict[str, Any], path: Path, what: str) -> None:
        reader = SafeFileSystemReader(path)  # reads .metadata through the allow-list first
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                         no_dist=not self.distributed)
        except (Exception, CheckpointException) as exc:  # DCP's derives from BaseException
            raise CheckpointError(f"checkpoint {path}: {what}: {_reason(exc)}") from exc

    def _resume(self) -> ResumeInfo | None:
        t0 = time.perf_counter()
        choice = self._from_rank0(self._choose)
        for line in choice["lines"]:
            self.log(line)
        if choice["path"] is None:
            return None
        path = Path(choice["path"])
        train = self._train_state(0)
        self._load({"train": train}, path, "cannot read its training state")
        self._check_compatible(train, path)
        same_layout = train["layout"] == self.layout and train["world_size"] == self.world
        msd, osd = self._model_optim()  # initialises the optimizer state (a zero-lr step)
        state = self._state(0, msd, osd, with_rng=same_layout)
        state.pop("train")
        self._load(state, path, "does not fit this model / layout")
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
        self._resumed_from = path
        self.log(f"checkpoint: resumed from {path} (step {step}"
                 + ("" if same_layout else f", saved under {train['layout']} on "
                    f"{train['world_size']} ranks: resharded, RNG states not restored")
                 + f") in {time.perf_counter() - t0:.2f} s (verified in "
                 f"{choice['verify_s']:.2f} s)")
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
