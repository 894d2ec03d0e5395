"""``overlap-runtime info``: what this process can run on."""

from __future__ import annotations

import argparse


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
    return 0
