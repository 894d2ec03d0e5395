"""Checkpoint save and load with the manifest on CPU ranks: what hashing every file costs.

The trainer's ``Checkpointer`` saves and resumes a model of ``--layers`` square ``Linear``
layers (``--width``) sharded by FSDP2 over ``--ranks`` gloo ranks, with AdamW's state, so the
checkpoint holds ``3 x layers x width^2`` fp32 numbers (parameters and two moments; 6 x 4096^2:
1.21 GB). Each repeat saves it twice - as the trainer does (each rank hashes the files it wrote,
rank 0 writes ``manifest.json``) and with the hashing and the manifest switched off - and resumes
each (rank 0 verifying every file against the manifest, or not). Times are the slowest rank's,
medians over the repeats; the files are in the page cache when they are read back (a cold read
from disk adds the disk's time to both columns alike). Also printed: the single-thread
throughput of SHA-256 and BLAKE2b here.

    .venv/bin/python -m benchmarks.checkpoint_manifest --ranks 2 --layers 6 --width 4096 \\
        --repeats 3 --dir /tmp/ckpt_bench
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_TIMES: dict[str, float] = {}


def _timed(name: str, fn: Any) -> Any:
    """``fn`` that adds its wall time to ``_TIMES[name]``."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES[name] = _TIMES.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


def _slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class _NoState:
    """A dataset without a data position (the checkpoint stores None for it)."""


def _checkpointer(directory: Path, resume: str | None, model: nn.Module, opt: Any) -> Any:
    from overlap_runtime.trainer.checkpoint import Checkpointer
    from overlap_runtime.config.run import CheckpointConfig

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    config = CheckpointConfig(dir=str(directory), resume=resume, timeout_s=3600.0)
    return Checkpointer(config, [model], opt, sched, _NoState(), layout="bench",
                        device=torch.device("cpu"))


def _rank(rank: int, world: int, layers: int, width: int, repeats: int,
          root: str) -> list[dict[str, float]] | None:
    from torch.distributed.fsdp import fully_shard

    import overlap_runtime.trainer.checkpoint as ckpt_mod
    import overlap_runtime.trainer.ckpt_dir as ckpt_dir

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # the moments exist
    hashing = {"writer": ckpt_mod._HashingWriter, "manifest": ckpt_mod.write_manifest,
               "check": ckpt_dir.check_loadable}
    ckpt_mod.write_part = _timed("hash_part", ckpt_mod.write_part)
    ckpt_mod.write_manifest = _timed("manifest", hashing["manifest"])
    ckpt_dir.check_loadable = _timed("verify", hashing["check"])

    class PlainWriter(torch.distributed.checkpoint.FileSystemWriter):
        def __init__(self, path: Path, rank: int) -> None:
            super().__init__(path)

    rows = []
    for _ in range(repeats):
        row: dict[str, float] = {}
        for mode in ("manifest", "plain"):
            ckpt_mod._HashingWriter = hashing["writer"] if mode == "manifest" else PlainWriter
            ckpt_mod.write_manifest = (_timed("manifest", hashing["manifest"])
                                       if mode == "manifest" else (lambda d: None))
            ckpt_dir.check_loadable = (_timed("verify", hashing["check"]) if mode == "manifest"
                                       else (lambda path, require: None))
            d = Path(root) / mode
            if rank == 0 and d.exists():
                shutil.rmtree(d)
            dist.barrier()
            _TIMES.clear()
            saver = _checkpointer(d, None, model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            saver.save(1)
            row[f"save_{mode}"] = _slowest(time.perf_counter() - t0)
            row[f"hash_part_{mode}"] = _slowest(_TIMES.get("hash_part", 0.0))
            row[f"manifest_{mode}"] = _slowest(_TIMES.get("manifest", 0.0))
            saver.close()
            _TIMES.clear()
            loader = _checkpointer(d, str(d / "step-00000001"), model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            loader.resume()
            row[f"load_{mode}"] = _slowest(time.perf_counter() - t0)
            row[f"verify_{mode}"] = _slowest(_TIMES.get("verify", 0.0))
            loader.close()
            if rank == 0:
                row["bytes"] = sum(f.stat().st_size for f in (d / "step-00000001").iterdir())
        rows.append(row)
    return rows if rank == 0 else None


def _throughput(name: str, size: int = 256 << 20) -> float:
    """GB/s of hashlib's ``name`` on one thread, 8 MiB updates (best of 3)."""
    data = memoryview(os.urandom(size))
    best = 0.0
    for _ in range(3):
        h = hashlib.new(name)
        t0 = time.perf_counter()
        for i in range(0, size, 8 << 20):
            h.update(data[i:i + (8 << 20)])
        best = max(best, size / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/overlap_runtime_ckpt_bench")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    from overlap_runtime.launch import spawn

    for name in ("sha256", "blake2b"):
        print(f"{name}: {_throughput(name):.2f} GB/s on one thread", flush=True)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = spawn(_rank, args.ranks, args=(args.layers, args.width, args.repeats, str(root)),
                     timeout_s=3600.0)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    gb = med["bytes"] / 1e9
    print(f"checkpoint: {gb:.2f} GB in {args.ranks} ranks ({args.layers} x Linear({args.width}, "
          f"{args.width}), AdamW), median of {args.repeats}")
    print(f"save: {med['save_manifest']:.2f} s with the manifest, {med['save_plain']:.2f} s "
          f"without (+{med['save_manifest'] - med['save_plain']:.2f} s; hashing "
          f"{med['hash_part_manifest']:.2f} s on the slowest rank, rank 0's manifest "
          f"{med['manifest_manifest']:.2f} s)")
    print(f"load: {med['load_manifest']:.2f} s verified, {med['load_plain']:.2f} s unverified "
          f"(+{med['load_manifest'] - med['load_plain']:.2f} s; rank 0 verifying "
          f"{med['verify_manifest']:.2f} s = {gb / med['verify_manifest']:.2f} GB/s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
