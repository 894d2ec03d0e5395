"""Hugging Face Qwen3.5 checkpoints in and out: config conversion, the parameter-name adapter,
per-rank import into any layout and export of our checkpoints.

Import needs ``safetensors`` only; ``transformers`` is never imported by the runtime.

May import ``torch`` (and ``torch.distributed.checkpoint`` / ``torch.distributed.tensor`` to read
checkpoints and shards), ``safetensors`` (lazily) and ``overlap_runtime.models``.
"""

from overlap_runtime.config.hf import (ARCHITECTURE_FIELDS, HFConfigError, architecture_conflicts, config_from_hf,
                     hf_config_from, read_hf_config)
from .load import HFLoadError, load_hf_weights

__all__ = ["ARCHITECTURE_FIELDS", "HFConfigError", "HFLoadError", "architecture_conflicts",
           "config_from_hf", "hf_config_from", "load_hf_weights", "read_hf_config"]
