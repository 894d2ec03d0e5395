"""Checkpoints you can trust: verified before they are read, never executed, never lost.

Each test is a case a careful user met (corrupted and hostile files, a second run on the same
directory, an older checkpoint resumed with ``keep_last``, a crash inside a commit, a full disk)
and fails on the trainer without manifests, the allow-list reader, the directory lock and the
commit/prune rules (``trainer.manifest``, ``trainer.ckpt_reader``, ``trainer.ckpt_lock``,
``trainer.ckpt_dir``).

Single-process cases use ``train_single`` (DCP without a process group, the same files); the
multi-rank cases run real gloo ranks (``overlap_runtime.testing``).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import TrainResult, config_from_dict, train_single
from overlap_runtime.trainer.checkpoint import CheckpointError, list_checkpoints
from overlap_runtime.trainer.manifest import verify_checkpoint, write_manifest

CP_MODES = {"linear_attention_cp_mode": "p2p", "full_attention_cp_mode": "ring"}


def cfg(world: int, steps: int, checkpoint: dict[str, Any] | None = None,
        **acc: Any) -> dict[str, Any]:
    accelerator = {"device": "cpu", "cp": 1, "world_size": world, "comm_timeout_s": 60.0, **acc}
    return {
        "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64},
        "data": {"seq_len": 64, "batch_size": 2},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": steps, "seed": 0, "accelerator": accelerator},
        "checkpoint": checkpoint or {},
    }


def losses(run: dict[str, Any] | TrainResult) -> dict[int, float]:
    r = run if isinstance(run, TrainResult) else TrainResult.from_dict(run)
    return {m.step: m.loss for m in r.steps}


def _item(ckpt: Path, fqn: str, shard: str) -> tuple[Path, int, int]:
    """(file, offset, length) of DCP item ``fqn``'s chunk in the file named ``shard*`` (the test
    reads its own trusted metadata)."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = next(v for k, v in md.storage_data.items()
                if k.fqn == fqn and v.relative_path.startswith(shard))
    return ckpt / info.relative_path, info.offset, info.length


def flip_low_bit_of_each_float(ckpt: Path, fqn: str, shard: str = "__0_") -> Path:
    """Flip the lowest mantissa bit of every float of tensor ``fqn`` in place (same size) in
    the file ``shard*`` (``__1_``: rank 1's): the raw data record inside the item's
    ``torch.save`` archive. Returns the file changed."""
    path, offset, length = _item(ckpt, fqn, shard)
    raw = bytearray(path.read_bytes())
    blob = bytes(raw[offset:offset + length])
    archive = zipfile.ZipFile(io.BytesIO(blob))
    record = archive.getinfo(next(n for n in archive.namelist() if "/data/" in n))
    name_len, extra_len = struct.unpack("<HH", blob[record.header_offset + 26:
                                                    record.header_offset + 30])
    start = offset + record.header_offset + 30 + name_len + extra_len
    for i in range(start, start + record.file_size, 4):
        raw[i] ^= 1
    path.write_bytes(raw)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, 6 steps, a checkpoint every 2: step-2, step-4, step-6, and the losses."""
    d = tmp_path_factory.mktemp("trust") / "ckpt"
    run = train_single(config_from_dict(cfg(1, 6, {"dir": str(d), "interval": 2})))
    return {"dir": d, "losses": losses(run)}


@pytest.fixture
def ckpt(saved: dict[str, Any], tmp_path: Path) -> Path:
    """A private copy of the saved checkpoint directory."""
    d = tmp_path / "ckpt"
    shutil.copytree(saved["dir"], d, ignore=shutil.ignore_patterns(".lock"))
    return d


def _resume(d: Path | str, steps: int, resume: str = "latest", lines: list[str] | None = None,
            **checkpoint: Any) -> TrainResult:
    c = cfg(1, steps, {"dir": str(d) if resume in ("latest", "auto") else None,
                       "resume": resume, **checkpoint})
    if c["checkpoint"]["dir"] is None:
        del c["checkpoint"]["dir"]
    return train_single(config_from_dict(c), log=(lines.append if lines is not None else None))


# ---- silent wrong: a flipped bit ---------------------------------------------------------------

def test_a_flipped_bit_in_a_shard_is_refused_naming_the_file(ckpt: Path) -> None:
    step4 = ckpt / "step-00000004"
    changed = flip_low_bit_of_each_float(step4, "model.embed_tokens.weight")
    with pytest.raises(CheckpointError, match=rf"{changed.name} does not match its sha256"):
        _resume(ckpt, 6, resume=str(step4))
    with pytest.raises(CheckpointError, match=changed.name):
        verify_checkpoint(step4)


def test_latest_falls_back_to_the_newest_checkpoint_that_verifies(
        ckpt: Path, saved: dict[str, Any]) -> None:
    flip_low_bit_of_each_float(ckpt / "step-00000006", "model.lm_head.weight")
    shutil.rmtree(ckpt / "step-00000004")
    lines: list[str] = []
    run = _resume(ckpt, 6, lines=lines, save_final=False)
    said = [ln for ln in lines if "verifies" in ln]
    assert len(said) == 1 and "step-00000006" in said[0] and "resuming from step-00000002" \
        in said[0], lines
    assert losses(run) == {s: saved["losses"][s] for s in (3, 4, 5, 6)}  # bitwise


def test_no_checkpoint_verifying_is_an_error_not_a_fresh_start(ckpt: Path) -> None:
    for step in (2, 4, 6):
        (ckpt / f"step-{step:08d}" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no checkpoint in checkpoint.dir=.* verifies"):
        _resume(ckpt, 8, resume="auto")


def test_verify_checkpoint_names_missing_extra_linked_and_unlisted(ckpt: Path) -> None:
    step2 = ckpt / "step-00000002"
    verify_checkpoint(step2)
    (step2 / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="notes.txt is not listed in its manifest"):
        verify_checkpoint(step2)
    (step2 / "notes.txt").unlink()
    shard = next(step2.glob("*.distcp"))
    moved = ckpt / "elsewhere.distcp"
    shard.rename(moved)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is missing"):
        verify_checkpoint(step2)
    shard.symlink_to(moved)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is not a regular file"):
        verify_checkpoint(step2)
    (step2 / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        verify_checkpoint(step2)


# ---- code execution: hostile files ---------------------------------------------------------------

class _Payload:
    """Unpickling this runs ``exec`` (a write to ``marker``): what a hostile file carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("manifest", ["kept", "rewritten"])
def test_a_crafted_metadata_pickle_never_runs(ckpt: Path, tmp_path: Path, manifest: str) -> None:
    """``.metadata`` replaced by a pickle that runs code: refused by the manifest (its hash
    differs) or, when the attacker rewrote the manifest too, by the allow-list reader."""
    marker = tmp_path / "payload-ran"
    step4 = ckpt / "step-00000004"
    (step4 / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    if manifest == "rewritten":
        write_manifest(step4)
        expected = "names builtins.exec, .* refusing to unpickle it"
    else:
        expected = r"\.metadata is \d+ bytes, its manifest says"
    with pytest.raises(CheckpointError, match=expected):
        _resume(ckpt, 6, resume=str(step4))
    assert not marker.exists()


def test_a_crafted_value_never_runs(tmp_path: Path) -> None:
    """A checkpoint whose ``train.step`` value is a pickled call (DCP reads such values with
    ``torch.load(weights_only=False)``): refused by ``weights_only=True``, manifest and all."""
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil" / "step-00000002"
    state = {"train": {"step": _Payload(marker), "scheduler": "{}", "data": "null",
                       "layout": "single", "world_size": 1, "model_config": "null"}}
    dcp.save(state, checkpoint_id=evil, no_dist=True)
    write_manifest(evil)
    with pytest.raises(CheckpointError, match="'train.step' is not plain data"):
        _resume(evil.parent, 6, resume=str(evil))
    assert not marker.exists()


# ---- no data lost ---------------------------------------------------------------------------------

def test_keep_last_never_prunes_the_resumed_or_the_just_written(ckpt: Path) -> None:
    """Resuming step 2 of [2, 4, 6] with keep_last 1: the commit of step 3 may remove nothing
    (2 is resumed from, 3 just written, 4 and 6 are above it); that of step 4 replaces 4, and
    3 (below 4, not resumed from) goes."""
    c = cfg(1, 3, {"dir": str(ckpt), "resume": str(ckpt / "step-00000002"), "interval": 1,
                   "keep_last": 1})
    train_single(config_from_dict(c))
    assert [s for s, _ in list_checkpoints(ckpt)] == [2, 3, 4, 6]
    c["train"]["steps"], c["checkpoint"]["resume"] = 4, str(ckpt / "step-00000003")
    train_single(config_from_dict(c))
    assert [s for s, _ in list_checkpoints(ckpt)] == [3, 4, 6]
    verify_checkpoint(ckpt / "step-00000004")


def test_a_second_run_on_the_same_directory_is_refused_naming_the_holder(ckpt: Path) -> None:
    """Another process holds ``checkpoint.dir`` (a run saving step 8): this run is refused,
    naming its pid, and the other run's in-flight save is left alone."""
    in_flight = ckpt / ".tmp-step-00000008"
    in_flight.mkdir()
    code = ("import sys, time; from overlap_runtime.trainer.ckpt_lock import DirectoryLock; "
            f"lock = DirectoryLock({str(ckpt)!r}); print('locked', flush=True); "
            "sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"is in use by another run \(pid "
                                                  rf"{holder.pid} on host "):
            _resume(ckpt, 8)
        assert in_flight.is_dir()
    finally:
        holder.communicate(input="", timeout=30)  # closes stdin: the holder exits


def test_a_crash_inside_a_commit_loses_no_checkpoint(
        ckpt: Path, saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming step 2 of [2, 4] and saving step 4 again, the process dies where the new copy
    would be renamed in: the next run still finds a complete step 4 and resumes from it."""
    shutil.rmtree(ckpt / "step-00000006")
    real = os.replace

    def crash_on_commit(src: Any, dst: Any) -> None:
        if Path(src).name == ".tmp-step-00000004" and Path(dst).name == "step-00000004":
            raise OSError(errno.EIO, "simulated crash between the renames")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_commit)
    with pytest.raises(CheckpointError, match="simulated crash"):
        train_single(config_from_dict(cfg(1, 4, {"dir": str(ckpt), "interval": 2,
                                                 "resume": str(ckpt / "step-00000002")})))
    monkeypatch.setattr(os, "replace", real)
    lines: list[str] = []
    run = _resume(ckpt, 5, lines=lines, save_final=False)
    assert losses(run) == {5: saved["losses"][5]}, lines  # bitwise: step 4's state
    assert any("restored step-00000004" in ln for ln in lines), lines
    assert [s for s, _ in list_checkpoints(ckpt)] == [2, 4]
    verify_checkpoint(ckpt / "step-00000004")


# ---- one named error, never DCP's BaseException ----------------------------------------------

def test_a_checkpoint_without_manifest_needs_require_manifest_false(ckpt: Path) -> None:
    step4 = ckpt / "step-00000004"
    (step4 / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json.*require_manifest: false"):
        _resume(ckpt, 6, resume=str(step4))
    lines: list[str] = []
    run = _resume(ckpt, 5, resume=str(step4), lines=lines, require_manifest=False)
    assert sorted(losses(run)) == [5]
    assert any("loading it unverified" in ln for ln in lines), lines


@pytest.mark.parametrize("damage", ["truncated shard", "truncated .metadata", "empty .metadata"])
def test_a_damaged_unverified_checkpoint_is_a_checkpoint_error(ckpt: Path, damage: str) -> None:
    """Without a manifest to catch it first, DCP's own failure (``CheckpointException``, a
    ``BaseException``) or an unreadable pickle still ends as one named CheckpointError."""
    step4 = ckpt / "step-00000004"
    (step4 / "manifest.json").unlink()
    target = next(step4.glob("*.distcp")) if damage == "truncated shard" else step4 / ".metadata"
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(0 if damage == "empty .metadata" else size // 2)
    with pytest.raises(CheckpointError, match=str(step4)):
        _resume(ckpt, 6, resume=str(step4), require_manifest=False)


def test_a_full_disk_during_a_save_is_a_checkpoint_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    with pytest.raises(CheckpointError, match=r"cannot save the checkpoint of step 2 to .*"
                                              r"No space left on device"):
        train_single(config_from_dict(cfg(1, 2, {"dir": str(tmp_path / "c")})))


# ---- several ranks: rank 0 decides ----------------------------------------------------------------

def _resume_worker(rank: int, world: int, config: dict[str, Any],
                   cwd_by_rank: list[str] | None) -> tuple[dict[str, Any], list[str]] | None:
    """Train ``config`` on these ranks (each in its own working directory if given); rank 0
    returns the metrics and its log lines."""
    from overlap_runtime.trainer import train_distributed

    if cwd_by_rank is not None:
        os.chdir(cwd_by_rank[rank])
    lines: list[str] = []
    result = train_distributed(config_from_dict(config), torch.device("cpu"), log=lines.append)
    return (result.to_dict(), lines) if rank == 0 else None


CP2 = dict(cp=2, **CP_MODES)


@pytest.fixture(scope="module")
def saved_cp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two cp ranks, 6 steps, a checkpoint every 2 (one shard per rank in each)."""
    d = tmp_path_factory.mktemp("trust_cp2") / "ckpt"
    c = cfg(2, 6, {"dir": str(d), "interval": 2}, **CP2)
    result, _ = run_ranks(_resume_worker, 2, timeout_s=240, args=(c, None))[0]
    return {"dir": d, "losses": losses(result)}


def test_cp2_a_flipped_bit_in_one_ranks_shard_falls_back_on_every_rank(
        saved_cp2: dict[str, Any], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved_cp2["dir"], d, ignore=shutil.ignore_patterns(".lock", "step-00000006"))
    changed = flip_low_bit_of_each_float(d / "step-00000004", "model.lm_head.weight", "__1_")
    c = cfg(2, 6, {"dir": str(d), "resume": "latest", "save_final": False}, **CP2)
    result, lines = run_ranks(_resume_worker, 2, timeout_s=240, args=(c, None))[0]
    said = [ln for ln in lines if "verifies" in ln]
    assert len(said) == 1 and changed.name in said[0] and "resuming from step-00000002" \
        in said[0], lines
    assert losses(result) == {s: saved_cp2["losses"][s] for s in (3, 4, 5, 6)}  # bitwise


def test_cp2_every_rank_loads_the_checkpoint_rank_0_chose(
        saved_cp2: dict[str, Any], tmp_path: Path) -> None:
    """The ranks see different directories under one relative ``checkpoint.dir`` (rank 0: steps
    2 and 4, rank 1: step 2 only), as ranks that listed it on either side of a commit would:
    rank 1 loads rank 0's step 4, and both continue from there."""
    seen = {"a": ("step-00000002", "step-00000004"), "b": ("step-00000002",)}
    for side, steps in seen.items():
        for step in steps:
            shutil.copytree(saved_cp2["dir"] / step, tmp_path / side / "ckpt" / step)
    c = cfg(2, 6, {"dir": "ckpt", "resume": "latest", "save_final": False}, **CP2)
    result, lines = run_ranks(_resume_worker, 2, timeout_s=240,
                              args=(c, [str(tmp_path / "a"), str(tmp_path / "b")]))[0]
    assert any(f"resumed from {tmp_path / 'a' / 'ckpt' / 'step-00000004'}" in ln
               for ln in lines), lines
    assert losses(result) == {s: saved_cp2["losses"][s] for s in (5, 6)}  # bitwise
