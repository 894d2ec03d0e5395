"""``overlap-runtime info``: what this process can run on, and which optional parts it can use."""

from __future__ import annotations

import argparse
import importlib.util

#: optional packages -> what they enable (an extra of pyproject.toml)
OPTIONAL_PARTS: dict[str, str] = {
    "triton": "the Triton GDN backend (extra 'triton')",
    "matplotlib": "schedule --plot (extra 'viz')",
    "torch_npu": "Ascend NPUs (extra 'npu'; never tested here)",
}


def optional_parts() -> dict[str, bool]:
    """Which of :data:`OPTIONAL_PARTS` are importable (found without importing them)."""
    return {name: importlib.util.find_spec(name) is not None for name in OPTIONAL_PARTS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    import torch

    from overlap_runtime import __version__
    from overlap_runtime.platform import platform_info

    info = platform_info()
    print(f"overlap_runtime {__version__}, torch {torch.__version__}")
    for kind in info.kinds:
        print(f"  {kind}: {info.counts[kind]} device(s), backend {info.backends[kind]}")
    print("optional parts:")
    for name, usable in optional_parts().items():
        print(f"  {name:<12} {'yes' if usable else 'no ':<4} {OPTIONAL_PARTS[name]}")
    return 0
