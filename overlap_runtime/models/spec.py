"""Model specs: the one place that knows how a model family is built, split for the pipeline,
parallelised, counted and converted to and from Hugging Face.

A :class:`ModelSpec` bundles those functions for one family; the trainer (``trainer.build``),
the checkpoint export (``trainer.hf_export``) and the FLOP count ask the spec instead of naming
the Qwen3.5 classes themselves. :func:`get_model_spec` looks a family up by name and
:func:`register_model_spec` adds one (a user's family lives in the user's package)::

    spec = get_model_spec("qwen3_5")
    model = spec.build(config.model, device, meta=False)    # random init from the global RNG
    parts = spec.split(model, num_stages, mine, layers_per_stage)
    spec.load_hf(parts.values(), directory, config.model)     # each rank reads its share
    hf_json = spec.hf_config(config.model)                     # export
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from overlap_runtime.config.hf import config_from_hf, hf_config_from
from overlap_runtime.models.flops import train_flops_per_step
from overlap_runtime.models.hf.load import load_hf_weights
from overlap_runtime.models.hf.state_dict import export_tensors
from overlap_runtime.models.parallelize import apply_fsdp, parallelize_qwen3_5_cp, parallelize_qwen3_5_ep
from overlap_runtime.models.pipeline_split import split_qwen3_5
from overlap_runtime.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs to know of one model family.

    Attributes:
        name: the registry key (``"qwen3_5"``).
        config_cls: the pydantic config of the family (the ``model`` YAML section).
        build: ``(config, device, meta) -> nn.Module``: the whole model, randomly initialised
            from the global RNG, or with ``meta=True`` on the meta device (to be sharded, then
            materialised and loaded).
        split: ``(model, num_stages, stage_indices, layers_per_stage) -> {stage: module}``;
            stages keep the whole model's parameter names.
        parallelize_cp / parallelize_ep / apply_fsdp: put a model (or stage) on its meshes.
        flops_per_step: ``(config, seq_len, tokens) -> float`` training FLOPs (fwd + bwd).
        hf_config_from / config_from_hf: our config <-> a Hugging Face ``config.json`` dict.
        load_hf: ``(modules, directory, config, log)``: fill this rank's parameters from a
            Hugging Face checkpoint.
        export_tensors: ``(name, value, config, expert) -> [(hf key, tensor)]``.
    """

    name: str
    config_cls: type
    build: Callable[[Any, Any, bool], nn.Module]
    split: Callable[..., dict[int, nn.Module]]
    parallelize_cp: Callable[..., Any]
    parallelize_ep: Callable[..., Any]
    apply_fsdp: Callable[..., Any]
    flops_per_step: Callable[[Any, int, int], float]
    hf_config_from: Callable[[Any], dict[str, Any]]
    config_from_hf: Callable[[dict[str, Any], str], dict[str, Any]]
    load_hf: Callable[[Iterable[nn.Module], str, Any, Any], Any]
    export_tensors: Callable[..., list[tuple[str, torch.Tensor]]]


_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` under ``spec.name`` (a second spec of one name raises ValueError)."""
    if spec.name in _SPECS and _SPECS[spec.name] is not spec:
        raise ValueError(f"model spec {spec.name!r} is already registered")
    _SPECS[spec.name] = spec
    return spec


def model_specs() -> list[str]:
    """The registered family names."""
    _builtin()
    return sorted(_SPECS)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``.

    Raises:
        KeyError: naming the known families.
    """
    _builtin()
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"no model spec {name!r}; registered: {sorted(_SPECS)}") from None


def _build_qwen3_5(config: Any, device: Any = "cpu", meta: bool = False) -> nn.Module:
    if meta:
        with torch.device("meta"):
            return Qwen3_5ForCausalLM(config)
    return Qwen3_5ForCausalLM(config).to(device)


def _export_qwen3_5(name: str, value: torch.Tensor, config: Any,
                    expert: int | None = None) -> list[tuple[str, torch.Tensor]]:
    return export_tensors(name, value, config.zero_centered_norms, expert)


def _flops_qwen3_5(config: Any, seq_len: int, tokens: int) -> float:
    return train_flops_per_step(config, seq_len, tokens)


def _builtin() -> None:
    if "qwen3_5" in _SPECS:
        return
    register_model_spec(ModelSpec(
        name="qwen3_5", config_cls=Qwen3_5Config, build=_build_qwen3_5, split=split_qwen3_5,
        parallelize_cp=parallelize_qwen3_5_cp, parallelize_ep=parallelize_qwen3_5_ep,
        apply_fsdp=apply_fsdp, flops_per_step=_flops_qwen3_5, hf_config_from=hf_config_from,
        config_from_hf=config_from_hf, load_hf=load_hf_weights,
        export_tensors=_export_qwen3_5))
