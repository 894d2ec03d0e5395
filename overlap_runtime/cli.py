"""The ``overlap-runtime`` command line.

Each subcommand lives in its own module that defines ``add_arguments(parser)`` and
``run(args) -> int``; this file only lists them, so ``overlap-runtime --help`` stays fast and a
subcommand's heavy imports happen only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> (module, one-line help). Modules are imported when the parser is built; keep their
# top-level imports light (heavy imports go inside ``run``).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("overlap_runtime.demo", "train PP=2 x EP=2 with OVERLAP_B_F against its baseline "
             "(CPU ranks spawned here, or torchrun's)"),
    "export": ("overlap_runtime.trainer.export_cli", "write a checkpoint (any layout) as a Hugging "
               "Face model directory (config.json + safetensors)"),
    "info": ("overlap_runtime.info", "print the platform: device kinds, counts, backends"),
    "schedule": ("overlap_runtime.schedules.cli", "build, check and simulate a pipeline schedule"),
    "simulate": ("overlap_runtime.stepgraph.cli", "predict a training step of a YAML config at "
                 "any scale (step time, bubble, exposed comm, peak memory per rank)"),
    "train": ("overlap_runtime.trainer.cli", "PP x EP x CP x FSDP2 training from a YAML config"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overlap-runtime",
        description="Pipeline, expert and context parallelism with communication hidden behind "
        "computation.",
    )
    from overlap_runtime import __version__

    parser.add_argument("--version", action="version", version=f"overlap-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a failure prints one line and returns its exit code
    (:mod:`overlap_runtime.failure`: 2 for a configuration, data or checkpoint error, 1 for a
    runtime fault), its traceback going to a log file the line names."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        from overlap_runtime.failure import report_failure

        return report_failure(exc, args.command, argv)


if __name__ == "__main__":
    sys.exit(main())
