"""Loading a Hugging Face Qwen3.5 checkpoint into one rank's part of the model, in any layout.

The model is built on the meta device (no memory), made context-, expert- and
data-parallel and split into pipeline stages exactly as a randomly initialised one, then
materialised with ``to_empty``; :func:`load_hf_weights` fills every parameter this rank holds
from the safetensors, reading for each one only the region it owns:

- a pipeline stage holds its layers (and the embedding / the head on the first / last stage);
- an EP rank holds experts ``[offset, offset + E/ep)`` of each MoE layer;
- an FSDP2 shard (a DTensor ``Shard(0)``) holds a row range of the (EP-local) tensor,
  ``compute_local_shape_and_global_offset`` says which.

No rank holds the whole model at any point: the peak is its share plus the one region being
copied (``models.hf.safetensors_dir``). Before anything is read, the checkpoint's keys are
checked against the whole model's names (each missing or unexpected key named), and every
stored shape against ours.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from overlap_runtime.models.hf.safetensors_dir import SafetensorsDir
from overlap_runtime.models.hf.state_dict import Source, hf_prefix, hf_source, skipped_prefixes
from overlap_runtime.models.qwen3_5 import Qwen3_5ForCausalLM


class HFLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the keys."""


def _whole_model_names(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of the whole model (built on the meta device)."""
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _expected_sources(config: Any, keys: set[str]) -> dict[str, Source]:
    """``{our name: Source}`` of the whole model, checked against the checkpoint's ``keys``.

    Raises:
        HFLoadError: keys the model needs that are missing, or stored keys (other than the
            vision tower and the MTP head) the model has no place for.
    """
    prefix = hf_prefix(keys)
    out: dict[str, Source] = {}
    for name, _ in _whole_model_names(config):
        out[name] = hf_source(name, prefix, config.num_experts)
    needed = {k for s in out.values() for k in s.keys}
    missing = sorted(needed - keys)
    skipped = tuple(skipped_prefixes(keys))
    unexpected = sorted(k for k in keys - needed if not k.startswith(skipped))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: "
                        f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"{len(unexpected)} stored tensor(s) have no place in the model: "
                        f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if problems:
        raise HFLoadError("the checkpoint does not fit the model of its config.json: "
                          + "; ".join(problems))
    return out


def _local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's local tensor of ``param`` and its offset in the (EP-local) global tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
        return param.to_local(), tuple(int(o) for o in offset)
    return param, (0,) * param.dim()


class LoadReport(dict):
    """``{"params": n, "elements": n, "bytes_read": n, "skipped": {prefix: count}}``."""


def load_hf_weights(modules: Iterable[nn.Module], directory: str, config: Any,
                    log: Callable[[str], None] | None = None) -> LoadReport:
    """Fill every parameter of ``modules`` (this rank's parts) from the checkpoint.

    Args:
        modules: this rank's pipeline stages (or the one model), already parallel and
            materialised (``to_empty``); parameter names are the whole model's.
        directory: the Hugging Face model directory.
        config: the model's :class:`~overlap_runtime.models.Qwen3_5Config` (its architecture
            read from the same directory).
        log: receives the one line naming the skipped tensors (vision tower, MTP head).

    Returns:
        a :class:`LoadReport` of what this rank read.

    Raises:
        HFLoadError: missing / unexpected keys, or a stored shape that is not ours.
    """
    files = SafetensorsDir(directory)
    keys = files.keys
    sources = _expected_sources(config, keys)
    meta = files.meta()
    whole = dict(_whole_model_names(config))
    skipped = skipped_prefixes(keys)
    if skipped and log is not None:
        log("hf import: skipped " + ", ".join(f"{n} tensors under {p}*" for p, n in
                                                skipped.items())
            + " (not part of the text model)")
    expert_offset: dict[str, int] = {}
    for module in modules:
        for mname, mod in module.named_modules():
            if hasattr(mod, "expert_offset") and isinstance(getattr(mod, "w1", None),
                                                            nn.Parameter):
                for w in ("w1", "w2", "w3"):
                    expert_offset[f"{mname}.{w}" if mname else w] = int(mod.expert_offset)
    report = LoadReport(params=0, elements=0, bytes_read=0, skipped=skipped)
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            src = sources.get(name)
            if src is None:
                raise HFLoadError(f"parameter {name} of this rank is not a parameter of the "
                                  f"whole model")
            _check_shapes(name, src, whole[name], meta)
            local, offset = _local_region(param)
            offset = list(offset)
            if name in expert_offset:
                offset[0] += expert_offset[name]
            with files.reader() as reader, torch.no_grad():
                region = src.read(reader.read, tuple(offset), tuple(local.shape))
                local.copy_(region.to(local.dtype))
                report["bytes_read"] += region.numel() * region.element_size()
            report["params"] += 1
            report["elements"] += local.numel()
    return report


def _check_shapes(name: str, src: Source, ours: tuple[int, ...],
                  meta: dict[str, tuple[tuple[int, ...], str]]) -> None:
    if not src.stacked:
        stored = meta[src.keys[0]][0]
        if stored != ours:
            raise HFLoadError(f"{src.keys[0]}: stored shape {list(stored)}, the model's "
                              f"{name} is {list(ours)}")
        return
    want = (ours[2], ours[1])
    for key in src.keys:
        if meta[key][0] != want:
            raise HFLoadError(f"{key}: stored shape {list(meta[key][0])}, expected {list(want)} "
                              f"(the transpose of one expert of {name} {list(ours)})")
