"""``overlap-runtime export CHECKPOINT --hf OUT``: a checkpoint of ours as a Hugging Face model
directory (``trainer.hf_export``; verified against its manifest first)."""

from __future__ import annotations

import argparse
import sys

from overlap_runtime.config.hf import HFConfigError
from overlap_runtime.trainer.cli_args import add_export_arguments as add_arguments
from overlap_runtime.trainer.hf_export import CheckpointError, ExportError, export_checkpoint


def run(args: argparse.Namespace) -> int:
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
