"""The run-time sections of ``TrainConfig``: ``checkpoint`` (``trainer.checkpoint``), ``metrics``
(``trainer.metrics``, ``trainer.progress``) and ``profiling`` (``trainer.profiling``).

Each section validates its own fields at load (paths that cannot be created, an optional package
that is missing), naming the dotted field; rules across sections live in ``config.train``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The longest wait a configuration may ask for: one week. Every wait of the runtime is
#: bounded; ``inf`` (or a number too large for a deadline) would make one unbounded.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class _Strict(BaseModel):
    """Frozen, and unknown keys are errors (a typo must not fall back to a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointConfig(_Strict):
    """Checkpoint and resume (``checkpoint``), with ``torch.distributed.checkpoint``
    (``trainer.checkpoint``).

    ``dir``: where ``step-NNNNNNNN`` checkpoints go (None: no checkpointing). ``interval``: save
    every that many steps (None: only the final one, if ``save_final``). ``keep_last``: keep the
    newest that many (None: all). ``async_save``: write in a background thread (staged to host
    memory first). ``resume``: None (fresh; a ``dir`` that already holds checkpoints is an
    error), ``latest`` (the newest in ``dir``; error if none), ``auto`` (the newest if any, else
    fresh) or the path of one checkpoint directory. ``timeout_s``: the longest wait for an
    asynchronous save to finish, and for rank 0 to verify the checkpoint to resume.
    ``require_manifest``: refuse to resume a checkpoint without a ``manifest.json`` (one saved by
    an older version); False loads it unverified, saying so (docs/training.md, "Trusting a
    checkpoint").
    """

    dir: str | None = None
    interval: int | None = Field(None, ge=1)
    keep_last: int | None = Field(None, ge=1)
    async_save: bool = False
    save_final: bool = True
    resume: str | None = None
    timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    require_manifest: bool = True

    @field_validator("dir")
    @classmethod
    def _dir_writable(cls, path: str | None) -> str | None:
        if path is not None:
            _check_output_dir("checkpoint.dir", path, "dir")
        return path

    @model_validator(mode="after")
    def _needs_dir(self) -> "CheckpointConfig":
        if self.dir is None:
            asked = [f"checkpoint.{k}={v!r}" for k, v in (
                ("interval", self.interval), ("keep_last", self.keep_last),
                ("resume", self.resume if self.resume in ("latest", "auto") else None))
                if v is not None] + (["checkpoint.async_save=True"] if self.async_save else [])
            if asked:
                raise ValueError(f"{', '.join(asked)} needs checkpoint.dir (where the "
                                 f"checkpoints are)")
        return self


def _check_output_dir(field: str, path: str, what: str) -> None:
    """``path`` (``what``: a ``file`` or a ``dir``) can be written: it is a writable directory,
    or its nearest existing ancestor is one (nothing is created at load)."""
    target = Path(path).expanduser()
    if what == "file" and target.is_dir():
        raise ValueError(f"{field}={path!r} is a directory; it must name a file")
    if what == "file" and target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{field}={path!r} exists and is not writable")
    if what == "dir" and target.exists() and not target.is_dir():
        raise ValueError(f"{field}={path!r} exists and is not a directory")
    d = target.parent if what == "file" else target
    d = d if str(d) else Path(".")
    while not d.exists():
        d = d.parent
    if not d.is_dir():
        raise ValueError(f"{field}={path!r}: its directory cannot be created ({d} is not a "
                         f"directory)")
    if not os.access(d, os.W_OK | os.X_OK):
        verb = "is not writable" if d == target else f"cannot be created ({d} is not writable)"
        raise ValueError(f"{field}={path!r} {verb}" if d == target else
                         f"{field}={path!r}: its directory {verb}")


def check_output_path(field: str, path: str) -> None:
    """Raise ValueError naming ``field`` unless the file ``path`` can be written (its directory
    exists writable or can be created); for command-line paths such as ``--metrics``."""
    _check_output_dir(field, path, "file")


class MetricsConfig(_Strict):
    """``metrics``: streamed per-step records (``trainer.metrics``) and rank 0's progress
    display (``trainer.progress``). Records go out every ``train.log_every`` steps."""

    jsonl: str | None = Field(None, description="JSONL file, one record per logged step")
    tensorboard: str | None = Field(None, description="TensorBoard log directory")
    progress: Literal["auto", "bar", "lines", "off"] = "auto"

    @field_validator("jsonl")
    @classmethod
    def _jsonl_writable(cls, path: str | None) -> str | None:
        if path is not None:
            _check_output_dir("metrics.jsonl", path, "file")
        return path

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_usable(cls, path: str | None) -> str | None:
        if path is None:
            return path
        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError(f"metrics.tensorboard={path!r} needs the tensorboard package: "
                             "pip install overlap_runtime[tensorboard] (or metrics.tensorboard: "
                             "null)")
        _check_output_dir("metrics.tensorboard", path, "dir")
        return path


class ProfilingConfig(_Strict):
    """``profiling``: a torch.profiler window over training steps ``steps = [start, end]``
    (1-based, inclusive), one chrome trace per rank in ``dir`` (``trainer.profiling``)."""

    enable: bool = False
    steps: tuple[int, int] = (2, 3)
    dir: str = "profiles"

    @model_validator(mode="after")
    def _window(self) -> "ProfilingConfig":
        start, end = self.steps
        if not 1 <= start <= end:
            raise ValueError(f"profiling.steps=[{start}, {end}]: need 1 <= start <= end")
        if self.enable:
            _check_output_dir("profiling.dir", self.dir, "dir")
        return self
