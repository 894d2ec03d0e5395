"""Training the Qwen3.5-style hybrid (dense or MoE) decoder with PP x EP x CP x FSDP2, from YAML.

``TrainConfig`` and its sections (defined in the configuration floor ``overlap_runtime.config``,
presented here), ``parallel_dims`` (``ParallelDims``: every DeviceMesh of a ``config.layout.Layout``), ``build`` (CP, pipeline split, EP, FSDP2 and the schedule of one rank),
``fsdp_pipeline`` (FSDP2 around a pipeline step), ``grad_norm`` (the norm over every dimension),
``data`` (byte-level corpus windows, ``build_dataset``), ``documents`` / ``packed_dataset``
(text, JSONL, Parquet documents, tokenised, shuffled per epoch and packed), ``batch`` (rows with
document boundaries, contiguous CP split), ``loop`` (distributed run,
single-device baseline, comparison), ``cli`` (``overlap-runtime train``). See docs/training.md.

May import every other package of overlap_runtime (it is the top of the stack, below the CLI).

The names below are loaded on first use (PEP 562): importing one module of the package does not
load the others.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AcceleratorConfig": "overlap_runtime.config.train",
    "ConfigError": "overlap_runtime.config.train",
    "DataConfig": "overlap_runtime.config.train",
    "OptimizerConfig": "overlap_runtime.config.train",
    "TrainConfig": "overlap_runtime.config.train",
    "TrainSection": "overlap_runtime.config.train",
    "config_from_dict": "overlap_runtime.config.train",
    "load_config": "overlap_runtime.config.train",
    "VOCAB_SIZE": "data",
    "Batch": "data",
    "ByteTokenizer": "data",
    "TextDataset": "data",
    "build_dataset": "data",
    "load_corpus": "data",
    "PackedDataset": "packed_dataset",
    "DataStateMismatch": "data_state",
    "StepMetrics": "loop",
    "TrainResult": "loop",
    "build_model": "build",
    "export_checkpoint": "hf_export",
    "read_checkpoint_tensors": "hf_export",
    "build_parallel_model": "build",
    "Layout": "overlap_runtime.config.layout",
    "ParallelDims": "parallel_dims",
    "PipelineConfig": "overlap_runtime.config.train",
    "TrainStepError": "errors",
    "compare_runs": "loop",
    "format_step": "loop",
    "spawn_training": "loop",
    "train_distributed": "loop",
    "train_single": "loop",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
