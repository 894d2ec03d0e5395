"""The flags of ``overlap-runtime simulate`` (argparse only: the command line lists them without
importing the simulator; ``stepgraph.cli`` runs the command)."""

from __future__ import annotations

import argparse

PROFILES = ("h200",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``overlap-runtime simulate``."""
    parser.add_argument("config", help="YAML training configuration (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="DOTTED.FIELD=VALUE",
                        help="override one field, validated like the YAML (repeatable)")
    parser.add_argument("--model", metavar="CONFIG_JSON",
                        help="a Hugging Face Qwen3.5 config.json (or its directory): the model "
                        "architecture of the simulation, replacing the YAML's (e.g. "
                        "configs/hf/Qwen3.5-35B-A3B.json); only the config is read")
    parser.add_argument("--profile", default="h200", choices=PROFILES,
                        help="machine profile (default h200)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs sharing NVLink in one node (default 8)")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="multiply every compute cost (a calibration factor; default 1)")
    parser.add_argument("--full", action="store_true",
                        help="simulate every rank instead of one per pipeline rank (small "
                             "layouts: checks the symmetry reduction)")
    parser.add_argument("--json", metavar="PATH", help="also write the prediction as JSON")
