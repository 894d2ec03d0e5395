"""Export a checkpoint of ours (any layout) as a Hugging Face model directory.

``overlap-runtime export <checkpoint dir> --hf <out dir>`` writes ``config.json``
(``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM``), sharded ``model-0000i-of-0000n.safetensors``
and ``model.safetensors.index.json``; ``transformers.AutoModelForCausalLM.from_pretrained(out)``
then computes our logits. A checkpoint directory (``trainer.checkpoint``) holds every parameter
under its global name whatever layout saved it (routed experts one row per global expert), and
its ``config.json`` the model; the export reads the tensors of one output shard at a time
through ``torch.distributed.checkpoint`` in this one process (``no_dist``), so its memory is
one shard (``--max-shard-size``), never the whole model.

Nothing is read from a checkpoint before it is verified against its manifest
(``trainer.manifest.verify_checkpoint``; ``allow_unverified=True`` reads one without a manifest,
never one whose manifest disagrees), and ``.metadata`` is unpickled only through the allow-list
reader of ``trainer.ckpt_reader``.

Tensors are written in the dtype the weights came in (``model.hf_dtype``, recorded at import;
``--dtype`` overrides; float32 when neither): a model imported from bf16 safetensors, trained
in fp32 master weights and exported is bf16 again, and an export of an import before any step
is bitwise the original tensors.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from overlap_runtime.config.hf import hf_config_from
from overlap_runtime.models.qwen3_5 import Qwen3_5Config
from overlap_runtime.models.spec import get_model_spec
from overlap_runtime.trainer.ckpt_reader import SafeFileSystemReader, SafeLoadPlanner
from overlap_runtime.trainer.errors import CheckpointError
from overlap_runtime.trainer.manifest import MANIFEST_NAME, verify_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT_RE = re.compile(r"^(.*)/expert(\d+)$")
_MODEL = "model."


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message names the path and the rule."""


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_checkpoint` wrote: ``tensors``, ``shards``, ``bytes``, ``dtype``."""

    tensors: int
    shards: int
    bytes: int
    dtype: str


def _checkpoint_model_config(checkpoint: str | Path) -> Any:
    """The :class:`~overlap_runtime.models.Qwen3_5Config` a checkpoint was saved with (its
    ``config.json``).

    Raises:
        ExportError: no readable ``config.json`` with a ``model`` entry.
    """
    path = Path(checkpoint) / "config.json"
    try:
        model = json.loads(path.read_text())["model"]
        return Qwen3_5Config.model_validate(model)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{path}: not the config.json of a checkpoint of ours ({exc})") from None


def _model_entries(checkpoint: Path) -> list[tuple[str, torch.Size, torch.dtype]]:
    """``(DCP key, size, dtype)`` of every model tensor of the checkpoint, in name order."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(str(checkpoint)).read_metadata()
    out = []
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata):
            out.append((key, md.size, md.properties.dtype))
    if not out:
        raise ExportError(f"{checkpoint}: the checkpoint holds no model tensors")
    return sorted(out)


def _load(checkpoint: Path, entries: list[tuple[str, torch.Size, torch.dtype]]
          ) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(size, dtype=dtype) for key, size, dtype in entries}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)),
                 planner=SafeLoadPlanner(), no_dist=True)
    return state


def _verify(checkpoint: Path, allow_unverified: bool, log: Callable[[str], None] | None) -> None:
    if allow_unverified and not (checkpoint / MANIFEST_NAME).exists():
        if log is not None:
            log(f"export: {checkpoint} has no manifest: read unverified (allow_unverified)")
        return
    verify_checkpoint(checkpoint)


def read_checkpoint_tensors(checkpoint: str | Path, max_bytes: int = 2 ** 30, *,
                            allow_unverified: bool = False
                            ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """``(our parameter name, expert or None, tensor)`` of every model tensor of a checkpoint
    (verified first), read ``max_bytes`` at a time (a routed expert weight comes one global
    expert at a time).

    Raises:
        CheckpointError: the checkpoint fails verification (named file and rule).
    """
    _verify(Path(checkpoint), allow_unverified, None)
    entries = _model_entries(Path(checkpoint))
    for group in _groups(entries, lambda e: e[1].numel() * e[2].itemsize, max_bytes):
        for key, value in _load(Path(checkpoint), group).items():
            name = key[len(_MODEL):]
            m = _EXPERT_RE.match(name)
            if m:
                yield m.group(1), int(m.group(2)), value
            else:
                yield name, None, value


def _groups(items: list[Any], size: Callable[[Any], int], limit: int) -> list[list[Any]]:
    out: list[list[Any]] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if out[-1] and total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *,
                      dtype: str | None = None, max_shard_bytes: int = 5 * 2 ** 30,
                      allow_unverified: bool = False,
                      log: Callable[[str], None] | None = None) -> ExportReport:
    """Write the Hugging Face directory of ``checkpoint`` to ``out_dir`` (module docstring).

    Args:
        checkpoint: a complete checkpoint directory (``step-NNNNNNNN``).
        out_dir: created if missing; must not already hold a model.
        dtype: ``float32`` / ``bfloat16`` / ``float16``; None: ``model.hf_dtype`` or float32.
        max_shard_bytes: largest shard written (and read) at once.
        allow_unverified: read a checkpoint that has no manifest (one whose manifest
            disagrees is refused whatever this says).

    Raises:
        CheckpointError: the checkpoint fails verification; ExportError: a checkpoint without
            a model config or tensors, an existing model in ``out_dir``, an unknown dtype;
            HFConfigError: a model transformers cannot represent.
    """
    from safetensors.torch import save_file

    ckpt, out = Path(checkpoint), Path(out_dir)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: no such checkpoint directory")
    _verify(ckpt, allow_unverified, log)
    config = _checkpoint_model_config(ckpt)
    spec = get_model_spec("qwen3_5")
    hf_config = spec.hf_config_from(config)
    name = dtype or config.hf_dtype or "float32"
    if name not in _DTYPES:
        raise ExportError(f"--dtype {name!r}: one of {sorted(_DTYPES)}")
    if out.exists() and any((out / f).exists() for f in ("config.json", "model.safetensors",
                                                         "model.safetensors.index.json")):
        raise ExportError(f"{out} already holds a model (config.json / safetensors): choose an "
                          f"empty directory")
    out.mkdir(parents=True, exist_ok=True)
    hf_config["dtype"] = name
    target = _DTYPES[name]
    entries = _model_entries(ckpt)
    if config.tie_word_embeddings:
        entries = [e for e in entries if e[0] != "model.lm_head.weight"]
    groups = _groups(entries, lambda e: e[1].numel() * target.itemsize, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = count = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for key, value in _load(ckpt, group).items():
            ours = key[len(_MODEL):]
            m = _EXPERT_RE.match(ours)
            pairs = (spec.export_tensors(m.group(1), value, config, int(m.group(2))) if m
                     else spec.export_tensors(ours, value, config))
            for hf_key, tensor in pairs:
                tensors[hf_key] = tensor.to(target).contiguous()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for hf_key, tensor in tensors.items():
            weight_map[hf_key] = fname
            total += tensor.numel() * tensor.element_size()
            count += 1
        if log is not None:
            log(f"export: {fname} ({len(tensors)} tensors)")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return ExportReport(count, len(groups), total, name)
