"""The flags of ``overlap-runtime train`` and ``overlap-runtime export`` (argparse only: the
command line lists them without importing the trainer; ``trainer.cli`` and ``trainer.export_cli``
run the commands)."""

from __future__ import annotations

import argparse


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``overlap-runtime train``."""
    parser.add_argument("config", help="YAML training configuration (see configs/)")
    parser.add_argument("--metrics", default=None,
                        help="write the metrics JSON here (default: train.metrics of the config)")
    parser.add_argument("--compare-single", action="store_true",
                        help="also train on one device with the same data and report the largest "
                             "loss / grad-norm differences")
    parser.add_argument("--set", action="append", default=[], metavar="DOTTED.FIELD=VALUE",
                        help="override one field, validated like the YAML (repeatable), e.g. "
                             "--set optimizer.lr=1e-4 --set train.accelerator.cp=4")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        metavar="CHECKPOINT",
                        help="resume from the newest complete checkpoint in checkpoint.dir, or "
                             "from the CHECKPOINT directory given (sets checkpoint.resume)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--init-from", default=None, metavar="HF_DIR",
                        help="start from a Hugging Face Qwen3.5 checkpoint (config.json + "
                        "safetensors): model.init_from; each rank reads only its share")
    parser.add_argument("--world-size", type=int, default=None,
                        help="override train.accelerator.world_size (spawned runs only)")
    parser.add_argument("--quiet", action="store_true", help="no per-step lines")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``overlap-runtime export``."""
    parser.add_argument("checkpoint", help="a checkpoint directory (<checkpoint.dir>/step-N)")
    parser.add_argument("--hf", required=True, metavar="OUT_DIR",
                        help="the Hugging Face directory to write (config.json, safetensors)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="tensor dtype written (default: the imported checkpoint's, else "
                        "float32)")
    parser.add_argument("--max-shard-size", type=float, default=5.0, metavar="GIB",
                        help="largest safetensors shard in GiB (also the export's memory)")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="export a checkpoint that has no manifest (saved by an older "
                        "version); one whose manifest disagrees is refused regardless")
