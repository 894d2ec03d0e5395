"""The whole training step of several source trees side by side, on one machine, in one call.

A change to the step is judged against its base on the same card in the same call (timings of
two machines, or of an H100 and an H200, do not compare). Two halves, because the GPU machine
has no git history:

    # here: one source tarball per revision (git archive), into a git-ignored folder
    python -m benchmarks.train_ab pack c4b02a9 HEAD --out .gpu39
    # on the device (carry the folder): each tree trains the same config; a table at the end
    python -m benchmarks.train_ab run --tree .gpu39/c4b02a9.tgz --tree . --seq 32768 16384 \\
        --steps 8 [--profile-first] [--set model.conv_backend=triton ...]

``run`` unpacks each tarball (a directory is used as it is; ``.`` is this tree), then for every
sequence length and tree runs ``torchrun --nproc-per-node 1 -m overlap_runtime.cli train
CONFIG`` from that tree (its own ``overlap_runtime`` first on ``PYTHONPATH``), with the
whole-model overrides of docs/benchmarks.md (world 1, cp 1, compile on) plus ``--set``, and
reads the metrics JSONL it writes. Per run: the median step time and MFU over steps
``--from-step`` (3) to the last, the peak memory and the last step's loss. ``--profile-first``
adds a profiler window over the last two steps of the first tree's runs (its timing then stops
before the profiler's warm-up step, three steps before the end) and prints ``benchmarks.trace_summary --gaps`` of it. A run that fails or times
out is a row that says so; the others still run. Output: a markdown table on stdout and
``train_ab.json`` under ``$OUT`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WHOLE_MODEL = ("train.accelerator.world_size=1", "train.accelerator.cp=1", "train.compile=true")


@dataclass
class RunRow:
    """One tree at one sequence length: medians over the timed steps (None when it failed)."""

    tree: str
    seq_len: int
    status: str
    step_ms: float | None = None
    mfu: float | None = None
    peak_gb: float | None = None
    last_loss: float | None = None
    steps: int = 0


def summarize(records: list[dict[str, Any]], tree: str, seq_len: int, first: int,
              last: int | None = None) -> RunRow:
    """The row of one run from its metrics records (``trainer.metrics`` JSONL lines): medians
    of ``step_time_s`` and ``mfu`` over steps ``first .. last`` (None: the last step)."""
    steps = [r for r in records if "step_time_s" in r]
    if not steps:
        return RunRow(tree, seq_len, "no steps")
    end = last if last is not None else max(r["step"] for r in steps)
    timed = [r for r in steps if first <= r["step"] <= end]
    if not timed:
        return RunRow(tree, seq_len, f"no step in {first}..{end}", steps=len(steps))
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    peak = steps[-1].get("peak_memory_bytes")
    return RunRow(tree, seq_len, "ok",
                  step_ms=statistics.median(r["step_time_s"] for r in timed) * 1e3,
                  mfu=statistics.median(mfus) if mfus else None,
                  peak_gb=None if peak is None else peak / 1e9,
                  last_loss=steps[-1]["loss"], steps=len(steps))


def table(rows: list[RunRow]) -> str:
    """The markdown table of ``rows``."""
    out = ["| tree | tokens | step ms | MFU | peak GB | last loss | status |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def f(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)
        out.append(f"| {r.tree} | {r.seq_len} | {f(r.step_ms, '.2f')} | "
                   f"{'-' if r.mfu is None else format(r.mfu, '.1%')} | {f(r.peak_gb, '.2f')} | "
                   f"{f(r.last_loss, '.4f')} | {r.status} |")
    return "\n".join(out)


def _unpack(spec: str, into: Path) -> tuple[str, Path]:
    """``(label, directory)`` of a ``--tree``: a ``.tgz`` made by ``pack`` (unpacked under
    ``into``) or a directory."""
    path = Path(spec)
    if path.is_dir():
        return ("worktree" if path.resolve() == Path.cwd().resolve() else path.name,
                path.resolve())
    if not path.name.endswith(".tgz") or not path.is_file():
        raise SystemExit(f"--tree {spec}: neither a directory nor a .tgz made by `pack`")
    label = path.name[:-len(".tgz")]
    dest = into / label
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path) as tar:
        tar.extractall(dest, filter="data")
    return label, dest


def train_command(config: str, seq_len: int, steps: int, metrics: Path, extra: list[str],
                  profile_dir: Path | None) -> list[str]:
    """The argv of one run (torchrun, one process)."""
    sets = [*WHOLE_MODEL, f"data.seq_len={seq_len}", f"train.steps={steps}",
            f"metrics.jsonl={metrics}", *extra]
    if profile_dir is not None:
        sets += ["profiling.enable=true", f"profiling.steps=[{steps - 1},{steps}]",
                 f"profiling.dir={profile_dir}"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "-m", "overlap_runtime.cli", "train", config]
    for s in sets:
        argv += ["--set", s]
    return argv


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out or os.environ.get("OUT") or "out/train_ab")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="train_ab-"))
    trees = [_unpack(t, work) for t in args.tree]
    rows: list[RunRow] = []
    for seq_len in args.seq:
        for i, (label, tree) in enumerate(trees):
            profile = out / f"prof-{label}-{seq_len}" if args.profile_first and i == 0 else None
            metrics = out / f"{label}-{seq_len}.jsonl"
            metrics.unlink(missing_ok=True)
            argv = train_command(args.config, seq_len, args.steps, metrics, args.set, profile)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
            log = out / f"{label}-{seq_len}.log"
            try:
                with log.open("w") as f:
                    rc = subprocess.run(argv, cwd=tree, env=env, stdout=f,
                                        stderr=subprocess.STDOUT, timeout=args.timeout).returncode
                status = "ok" if rc == 0 else f"exit {rc} (see {log.name})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {args.timeout:g} s"
            records = ([json.loads(x) for x in metrics.read_text().splitlines()]
                       if metrics.exists() else [])
            last = args.steps - 3 if profile is not None else None
            row = summarize(records, label, seq_len, args.from_step, last)
            if status != "ok":
                row.status = status
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            if profile is not None and status == "ok":
                for trace in sorted(profile.glob("*.json")):
                    subprocess.run([sys.executable, "-m", "benchmarks.trace_summary", str(trace),
                                    "--gaps"], check=False)
    print(table(rows))
    (out / "train_ab.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.status == "ok" for r in rows) else 1


def _pack(args: argparse.Namespace) -> int:
    out = Path(args.out or ".gpu39")
    out.mkdir(parents=True, exist_ok=True)
    for rev in args.revs:
        sha = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True,
                             text=True, check=True).stdout.strip()
        dest = out / f"{sha}.tgz"
        subprocess.run(["git", "archive", "--format=tar.gz", "-o", str(dest), sha], check=True)
        print(dest)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="git archive each revision to OUT/<short sha>.tgz")
    pk.add_argument("revs", nargs="+")
    pk.add_argument("--out", default=None, help="folder (default .gpu39)")
    rn = sub.add_parser("run", help="train every tree, print the table")
    rn.add_argument("--tree", action="append", required=True,
                    help="a .tgz from `pack` or a directory ('.': this tree); repeatable")
    rn.add_argument("--config", default="configs/gpu_cp2_16k.yaml")
    rn.add_argument("--seq", type=int, nargs="+", default=[32768])
    rn.add_argument("--steps", type=int, default=8)
    rn.add_argument("--from-step", type=int, default=3, help="first timed step (1-based)")
    rn.add_argument("--set", action="append", default=["model.conv_backend=triton"],
                    metavar="FIELD=VALUE", help="more overrides (default: the Triton conv)")
    rn.add_argument("--profile-first", action="store_true")
    rn.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    rn.add_argument("--out", default=None)
    args = p.parse_args(argv)
    return _pack(args) if args.cmd == "pack" else _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
