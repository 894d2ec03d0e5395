"""``overlap-runtime info``: what this process can run on, and which optional parts it can use.

An optional part is usable when its package is installed: found on the import path (without
importing it, so ``info`` stays fast) and, where its distribution says, with its version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util

from overlap_runtime import __version__
from overlap_runtime.cli import info_arguments as add_arguments
from overlap_runtime.platform import platform_info

#: optional packages -> what they enable (and where they come from: an extra of pyproject.toml)
OPTIONAL_PARTS: dict[str, str] = {
    "triton": "the Triton GDN backend (extra 'triton')",
    "matplotlib": "schedule --plot (extra 'viz')",
    "torch_npu": "Ascend NPUs (extra 'npu'; never tested here)",
    "tensorboard": "TensorBoard event files of the training metrics (extra 'tensorboard')",
    "datasets": "Hugging Face datasets as training data (extra 'data')",
    "tokenizers": "a trained tokenizer instead of bytes (extra 'data')",
    "tqdm": "the training progress bar (a dependency of overlap_runtime)",
}


def _optional_parts() -> dict[str, bool]:
    """Which of :data:`OPTIONAL_PARTS` are importable (found without importing them)."""
    return {name: importlib.util.find_spec(name) is not None for name in OPTIONAL_PARTS}


def _installed_version(name: str) -> str | None:
    """The installed distribution's version of package ``name`` (None: no distribution says)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    del args
    import torch

    info = platform_info()
    print(f"overlap_runtime {__version__}, torch {torch.__version__}")
    for kind in info.kinds:
        print(f"  {kind}: {info.counts[kind]} device(s), backend {info.backends[kind]}")
    print("optional parts (usable: installed; pip install 'overlap_runtime[EXTRA]' adds one):")
    for name, usable in _optional_parts().items():
        version = (_installed_version(name) or "?") if usable else "-"
        print(f"  {name:<12} {'yes' if usable else 'no ':<4} {version:<12} {OPTIONAL_PARTS[name]}")
    return 0
