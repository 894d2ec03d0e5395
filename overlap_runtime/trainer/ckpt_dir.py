"""The checkpoint directory: naming, listing, committing, pruning, and choosing what to resume.

Layout of ``checkpoint.dir``::

    .lock                      the run holding the directory (trainer.ckpt_lock)
    step-00000004/             complete checkpoints: DCP files, config.json, manifest.json
    step-00000006/
    .tmp-step-00000008/        a save in progress (or interrupted): never listed
    .old-step-00000006/        a replaced checkpoint during a commit (see commit_directory)
    .trash-step-00000002/      a pruned checkpoint being deleted

Rules, each kept by one function here:

* **No window without a copy** (:func:`commit_directory`): committing ``step-N`` over an existing
  ``step-N`` (a run resumed from an older step saves it again) renames the old one to
  ``.old-step-N``, renames the new one in, fsyncs the directory and only then deletes the old
  one. A run killed between the two renames leaves ``.old-step-N`` and no ``step-N``;
  :func:`recover` (rank 0, under the lock, at start-up) renames it back.
* **Pruning keeps what a run needs** (:func:`prune`): after committing step ``s`` with
  ``keep_last = k``, only checkpoints of steps below ``s`` may go, the newest ``k`` of those up
  to ``s`` stay, and so does the one the run resumed from. A checkpoint above ``s`` (an earlier
  run's, newer than this run's position) is never touched. A pruned directory is renamed to
  ``.trash-*`` before it is deleted, so a half-deleted checkpoint is never listed.
* **Resume only what verifies** (:func:`choose_resume`): ``latest`` / ``auto`` take the newest
  complete checkpoint that verifies against its manifest (trainer.manifest) and say in one line
  which newer ones did not; an explicit path that fails is an error naming the file.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from overlap_runtime.trainer.errors import CheckpointError
from overlap_runtime.trainer.manifest import has_manifest, verify_checkpoint

_STEP_RE = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
TRASH_PREFIX = ".trash-"


def step_dir_name(step: int) -> str:
    """``step-00000005``: the directory of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-NNNNNNNN`` (None: another name)."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``directory`` as ``(step, path)``, oldest first.

    Complete: named ``step-NNNNNNNN`` (committed by rename) and holding DCP's ``.metadata``.
    ``.tmp-*``, ``.old-*`` and ``.trash-*`` directories are never listed. Complete is not
    verified: :func:`choose_resume` checks the manifest.
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


def _fsync_directory(path: Path) -> None:
    """Make the renames inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_directory(tmp: Path, final: Path) -> None:
    """Rename the finished save ``tmp`` to ``final``; an existing ``final`` is kept (as
    ``.old-<name>``) until the new one is in place and durable (module docstring)."""
    parent = final.parent
    old = parent / f"{OLD_PREFIX}{final.name}"
    if old.exists():  # left by a commit killed after its second rename: final is complete
        shutil.rmtree(old)
    replaced = final.exists()
    if replaced:
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_directory(parent)
    if replaced:
        shutil.rmtree(old)


def _trash(path: Path) -> None:
    """Delete checkpoint ``path``: renamed out of the listing first, then removed."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def recover(directory: Path) -> list[str]:
    """Tidy ``directory`` after an interrupted run (rank 0, holding the lock); returns one line
    per checkpoint restored.

    ``.old-step-N`` without ``step-N`` (a commit killed between its renames) is renamed back;
    with ``step-N`` present it is removed. ``.tmp-*`` (an interrupted save) and ``.trash-*`` (an
    interrupted prune) are removed.
    """
    notes = []
    for child in sorted(directory.iterdir()):
        name = child.name
        if name.startswith(OLD_PREFIX) and child.is_dir():
            final = directory / name[len(OLD_PREFIX):]
            if final.exists():
                shutil.rmtree(child)
            else:
                os.replace(child, final)
                notes.append(f"checkpoint: restored {final.name} (a commit replacing it was "
                             f"interrupted)")
        elif name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)
    if notes:
        _fsync_directory(directory)
    return notes


def prune(directory: Path, committed: int, keep_last: int, protect: set[Path]) -> list[int]:
    """Delete the checkpoints that ``keep_last`` lets go after committing step ``committed``
    (module docstring); ``protect`` (the checkpoint resumed from) is kept. Returns the steps
    deleted."""
    kept = {p.resolve() for p in protect}
    upto = [(s, p) for s, p in list_checkpoints(directory) if s <= committed]
    gone = []
    for step, path in upto[:-keep_last]:
        if step < committed and path.resolve() not in kept:
            _trash(path)
            gone.append(step)
    return gone


def resolve_resume(config: Any) -> Path | None:
    """The checkpoint that ``checkpoint.resume`` names (None: start fresh), from the filesystem
    alone (nothing is verified or read), so launchers check it before starting ranks.

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


def check_loadable(path: Path, require_manifest: bool) -> str | None:
    """Verify checkpoint ``path`` against its manifest; without one, refuse it when
    ``require_manifest`` and otherwise return the line saying it loads unverified.

    Raises:
        CheckpointError: naming the file that differs, or the missing manifest.
    """
    if has_manifest(path):
        verify_checkpoint(path)
        return None
    if require_manifest:
        raise CheckpointError(f"checkpoint {path} has no manifest.json, so its files cannot be "
                              f"verified before loading (saved by an older version?); set "
                              f"checkpoint.require_manifest: false to load it unverified, only "
                              f"if you trust where it came from")
    return (f"checkpoint: {path} has no manifest.json: loading it unverified "
            f"(checkpoint.require_manifest: false)")


def choose_resume(config: Any) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume (None: fresh) after verifying it, and the lines to log.

    Like :func:`resolve_resume`, but every candidate is verified (:func:`check_loadable`):
    ``latest`` / ``auto`` fall back to the newest complete checkpoint that verifies, saying in
    one line which newer ones do not and why; none verifying is an error (``auto`` too: a
    directory of corrupt checkpoints must not silently become a fresh start). An explicit path
    that does not verify is an error.

    Raises:
        CheckpointError: naming the checkpoint and the file.
    """
    first = resolve_resume(config)
    if first is None:
        return None, []
    require = bool(getattr(config, "require_manifest", True))
    if config.resume not in ("latest", "auto"):
        note = check_loadable(first, require)
        return first, [note] if note else []
    failures: list[str] = []
    for _, path in reversed(list_checkpoints(Path(config.dir))):
        try:
            note = check_loadable(path, require)
        except CheckpointError as exc:
            failures.append(str(exc))
            continue
        lines = [note] if note else []
        if failures:
            lines.insert(0, f"checkpoint: {'; '.join(failures)}; resuming from {path.name}, the "
                            f"newest checkpoint that verifies")
        return path, lines
    raise CheckpointError(f"checkpoint.resume={config.resume}: no checkpoint in checkpoint.dir="
                          f"{config.dir!r} verifies; the newest: {failures[0]}")
