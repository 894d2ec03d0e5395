"""``overlap-runtime export CHECKPOINT --hf OUT``: a checkpoint of ours as a Hugging Face model
directory (``trainer.hf_export``; verified against its manifest first)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    from overlap_runtime.config.hf import HFConfigError
    from overlap_runtime.trainer.hf_export import CheckpointError, ExportError, export_checkpoint

    try:
        report = export_checkpoint(args.checkpoint, args.hf, dtype=args.dtype,
                                   max_shard_bytes=int(args.max_shard_size * 2 ** 30),
                                   allow_unverified=args.allow_unverified,
                                   log=lambda line: print(line, flush=True))
    except (ExportError, HFConfigError, CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"export: {report.tensors} tensors, {report.shards} shard(s), "
          f"{report.bytes / 2 ** 20:.1f} MiB {report.dtype} written to {args.hf}")
    return 0
