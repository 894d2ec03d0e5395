"""``overlap-runtime train``: the spawned CPU default, torchrun, the metrics file, config errors.

The three command lines run as users run them (fresh interpreters); they start together, two at
a time (``Concurrently``, a module fixture), and each test asserts on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from tests.support.trainer import tiny_config

from overlap_runtime.cli import build_parser, main
from overlap_runtime.testing import Concurrently


def _write(tmp_path: Path, name: str = "tiny.yaml", **acc: object) -> Path:
    cfg = tiny_config(steps=3, seq_len=64, **acc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_is_a_subcommand() -> None:
    parser = build_parser()
    args = parser.parse_args(["train", "x.yaml", "--compare-single", "--metrics", "m.json"])
    assert args.command == "train" and args.compare_single and args.metrics == "m.json"


def _spawned(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    # A fresh interpreter: the spawned ranks print to the forkserver's stdout, which inside a
    # pytest session is whatever the first spawning test's capture was.
    config = _write(tmp_path, cp=2, linear_attention_cp_mode="p2p")
    metrics = tmp_path / "out" / "metrics.json"
    cmd = [sys.executable, "-m", "overlap_runtime.cli", "train", str(config), "--compare-single",
           "--metrics", str(metrics)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240), metrics


def _torchrun(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    config = _write(tmp_path, cp=2, linear_attention_cp_mode="ulysses")
    metrics = tmp_path / "torchrun.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "overlap_runtime.cli", "train", str(config), "--steps", "2",
           "--metrics", str(metrics)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env), metrics


def _checkpoint_then_resume(tmp_path: Path) -> tuple[Any, Any, Path]:
    config = _write(tmp_path, cp=2, linear_attention_cp_mode="p2p")
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, "-m", "overlap_runtime.cli", "train", str(config),
            "--set", f"checkpoint.dir={ckpt}"]
    first = subprocess.run(base + ["--steps", "2"], capture_output=True, text=True, timeout=240)
    if first.returncode != 0:
        return first, None, ckpt
    again = subprocess.run(base + ["--steps", "3", "--resume"], capture_output=True, text=True,
                           timeout=240)
    return first, again, ckpt


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Concurrently]:
    def in_dir(fn: Any, name: str) -> Any:
        return lambda: fn(tmp_path_factory.mktemp(name))

    with Concurrently({"checkpoint": in_dir(_checkpoint_then_resume, "ckpt"),
                       "spawned": in_dir(_spawned, "spawned"),
                       "torchrun": in_dir(_torchrun, "torchrun")}) as started:
        yield started


@pytest.mark.slow
def test_cli_spawns_ranks_compares_and_writes_metrics(runs: Concurrently) -> None:
    proc, metrics = runs.result("spawned")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "spawning 2 cpu ranks" in out
    for step in (1, 2, 3):
        assert out.count(f"step {step}/3  loss ") == 2       # the CP run and the baseline
    assert "tok/s" in out and "grad_norm" in out
    assert "vs single device over 3 steps: max |dloss|" in out
    data = json.loads(metrics.read_text())
    assert data["run"]["cp"] == 2 and data["run"]["world_size"] == 2
    assert len(data["run"]["steps"]) == len(data["baseline"]["steps"]) == 3
    assert data["comparison"]["max_rel_dloss"] <= 1e-4
    assert data["comparison"]["max_rel_dgrad_norm"] <= 1e-3
    assert data["config"]["train"]["accelerator"]["linear_attention_cp_mode"] == "p2p"
    assert data["summary"]["median_tokens_per_s"] > 0


@pytest.mark.slow
def test_cli_under_torchrun(runs: Concurrently) -> None:
    proc, metrics = runs.result("torchrun")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spawning" not in proc.stdout                     # joined torchrun's group instead
    assert proc.stdout.count("step 2/2  loss ") == 1          # rank 0 prints
    data = json.loads(metrics.read_text())
    assert data["run"]["world_size"] == 2 and len(data["run"]["steps"]) == 2


def test_cli_config_error_exit_code(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, cp=2, pp=8)
    assert main(["train", str(config)]) == 2
    assert "train.accelerator.pp=8 x train.pipeline.virtual_stages=1" in capfd.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capfd.readouterr().err


def test_building_the_parser_does_not_import_torch() -> None:
    code = ("import sys, overlap_runtime.cli as c; c.build_parser(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_cli_checkpoints_and_resumes(runs: Concurrently) -> None:
    first, again, ckpt = runs.result("checkpoint")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"checkpoint: step 2 saved to {ckpt / 'step-00000002'}" in first.stdout
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"checkpoint: resumed from {ckpt / 'step-00000002'} (step 2)" in again.stdout
    assert "step 3/3  loss " in again.stdout and "step 2/3" not in again.stdout


def test_cli_checkpoint_errors_before_any_rank(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, cp=2, linear_attention_cp_mode="p2p")
    empty = tmp_path / "empty"
    assert main(["train", str(config), "--set", f"checkpoint.dir={empty}", "--resume"]) == 2
    err = capsys.readouterr()
    assert "checkpoint.resume=latest: no complete checkpoint" in err.err
    assert "spawning" not in err.out
    assert main(["train", str(config), "--resume", str(tmp_path)]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
