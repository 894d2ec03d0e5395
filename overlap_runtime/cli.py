"""The ``overlap-runtime`` command line.

Each subcommand lives in its own module that defines ``run(args) -> int``; its flags are an
``add_arguments(parser)`` function in a module that imports only argparse (this file for
``demo`` and ``info``, ``schedules.cli``, ``stepgraph.cli_args``, ``trainer.cli_args``). Building
the parser therefore imports no torch (``overlap-runtime --help`` stays fast), and the module that
runs a subcommand, imported by name when it runs, imports what it needs at its top.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

from overlap_runtime import __version__
from overlap_runtime.failure import report_failure
from overlap_runtime.schedules.cli import add_arguments as schedule_arguments
from overlap_runtime.stepgraph.cli_args import add_arguments as simulate_arguments
from overlap_runtime.trainer.cli_args import add_export_arguments, add_train_arguments

DEMO_OUT = os.path.join("out", "moe_pp_ep_trace.json")
DEMO_CONFIG_NAME = "configs/demo_pp2_ep2.yaml"


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``overlap-runtime demo`` (``overlap_runtime.demo`` runs it)."""
    parser.add_argument("--config", default=None,
                        help=f"YAML training config (default: the embedded {DEMO_CONFIG_NAME})")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--pp", type=int, default=None,
                        help="override train.accelerator.pp (world size: pp x dp_replicate x ep "
                             "x cp, dp_shard = ep)")
    parser.add_argument("--ep", type=int, default=None,
                        help="override train.accelerator.ep (world size as for --pp)")
    parser.add_argument("--set", action="append", default=[], metavar="DOTTED.FIELD=VALUE",
                        help="override one field of the config, validated with the rest before "
                             "any rank starts (repeatable), e.g. --set "
                             "train.pipeline.microbatches=2 --set model.num_experts=8")
    parser.add_argument("--out", default=DEMO_OUT,
                        help=f"merged Chrome trace (default {DEMO_OUT})")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before giving up: the spawned ranks' deadline, and every "
                             "communication wait when the config sets no "
                             "train.accelerator.comm_timeout_s (default 120)")


def info_arguments(parser: argparse.ArgumentParser) -> None:
    """``overlap-runtime info`` has no flags."""
    del parser


# name -> (the module whose ``run`` runs it, one-line help, its flags)
SUBCOMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "demo": ("overlap_runtime.demo", "train PP=2 x EP=2 with OVERLAP_B_F against its baseline "
             "(CPU ranks spawned here, or torchrun's)", demo_arguments),
    "export": ("overlap_runtime.trainer.export_cli", "write a checkpoint (any layout) as a Hugging "
               "Face model directory (config.json + safetensors)", add_export_arguments),
    "info": ("overlap_runtime.info", "print the platform: device kinds, counts, backends",
             info_arguments),
    "schedule": ("overlap_runtime.schedules.cli", "build, check and simulate a pipeline schedule",
                 schedule_arguments),
    "simulate": ("overlap_runtime.stepgraph.cli", "predict a training step of a YAML config at "
                 "any scale (step time, bubble, exposed comm, peak memory per rank)",
                 simulate_arguments),
    "train": ("overlap_runtime.trainer.cli", "PP x EP x CP x FSDP2 training from a YAML config",
              add_train_arguments),
}


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand with its flags (no subcommand module is imported)."""
    parser = argparse.ArgumentParser(
        prog="overlap-runtime",
        description="Pipeline, expert and context parallelism with communication hidden behind "
        "computation.",
    )
    parser.add_argument("--version", action="version", version=f"overlap-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text, add_arguments) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a failure prints one line and returns its exit code
    (:mod:`overlap_runtime.failure`: 2 for a configuration, data or checkpoint error, 1 for a
    runtime fault), its traceback going to a log file the line names."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        run = importlib.import_module(SUBCOMMANDS[args.command][0]).run
        return int(run(args) or 0)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        return report_failure(exc, args.command, argv)


if __name__ == "__main__":
    sys.exit(main())
