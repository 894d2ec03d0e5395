"""FSDP2 + context-parallel training of the Qwen3.5-style hybrid decoder, driven by YAML.

``parallel_dims`` (``ParallelDims``: the one owner of the layout ``pp x dp_replicate x dp_shard
x cp`` and of every DeviceMesh, asked for by name; EP is borrowed from ``dp_shard x cp``),
``config`` (pydantic ``TrainConfig``), ``data`` (byte-level corpus windows, contiguous CP split),
``loop`` (distributed run, single-device baseline, comparison), ``cli`` (``overlap-runtime
train``). See docs/training.md.

May import: every package below it (``models``, ``context_parallel``, ``moe``, ``pipeline``,
``schedules``, ``ops``, ``platform``, ``launch``); nothing imports the trainer but the command
line.

The names below are loaded on first use (PEP 562): ``overlap-runtime --help`` imports
``trainer.cli``, and with it this package, without paying for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AcceleratorConfig": "config",
    "ConfigError": "config",
    "DataConfig": "config",
    "OptimizerConfig": "config",
    "TrainConfig": "config",
    "TrainSection": "config",
    "config_from_dict": "config",
    "load_config": "config",
    "VOCAB_SIZE": "data",
    "Batch": "data",
    "ByteTokenizer": "data",
    "TextDataset": "data",
    "load_corpus": "data",
    "StepMetrics": "loop",
    "TrainResult": "loop",
    "build_model": "loop",
    "compare_runs": "loop",
    "format_step": "loop",
    "spawn_training": "loop",
    "train_distributed": "loop",
    "train_single": "loop",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .config import (
        AcceleratorConfig,
        ConfigError,
        DataConfig,
        OptimizerConfig,
        TrainConfig,
        TrainSection,
        config_from_dict,
        load_config,
    )
    from .data import VOCAB_SIZE, Batch, ByteTokenizer, TextDataset, load_corpus
    from .loop import (
        StepMetrics,
        TrainResult,
        build_model,
        compare_runs,
        format_step,
        spawn_training,
        train_distributed,
        train_single,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
