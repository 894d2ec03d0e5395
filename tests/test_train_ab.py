"""benchmarks/train_ab.py: the per-run summary (medians over the timed steps) on known records,
the table, and one real run: ``pack`` of HEAD, then ``run`` of that tarball on the CPU (one
rank, a tiny model, torchrun as on the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import train_ab

ROOT = Path(__file__).resolve().parents[1]


def _rec(step: int, ms: float, mfu: float | None = 0.4, loss: float = 1.0) -> dict:
    return {"step": step, "step_time_s": ms / 1e3, "mfu": mfu, "loss": loss,
            "peak_memory_bytes": 2e9}


def test_summary_takes_the_medians_of_the_timed_steps() -> None:
    records = [_rec(1, 9000.0, 0.001), _rec(2, 200.0, 0.2), _rec(3, 150.0, 0.41),
               _rec(4, 152.0, 0.40), _rec(5, 160.0, 0.38, loss=0.5), {"step": 5, "note": "x"}]
    row = train_ab.summarize(records, "base", 32768, first=3)
    assert row.status == "ok" and row.steps == 5
    assert row.step_ms == pytest.approx(152.0) and row.mfu == pytest.approx(0.40)
    assert row.last_loss == 0.5 and row.peak_gb == pytest.approx(2.0)
    assert train_ab.summarize(records, "b", 1, first=3, last=4).step_ms == pytest.approx(151.0)
    assert train_ab.summarize(records, "b", 1, first=7).status == "no step in 7..5"
    assert train_ab.summarize([], "b", 1, first=3).status == "no steps"
    text = train_ab.table([row, train_ab.RunRow("new", 16384, "timed out after 300 s")])
    assert "| base | 32768 | 152.00 | 40.0% | 2.00 | 0.5000 | ok |" in text
    assert "| new | 16384 | - | - | - | - | timed out after 300 s |" in text


@pytest.mark.slow
def test_pack_then_run_on_the_cpu(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({
        "model": {"hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
                  "full_attention_interval": 2},
        "data": {"seq_len": 32, "batch_size": 1},
        "train": {"steps": 2, "accelerator": {"device": "cpu", "world_size": 1, "cp": 1}},
        "metrics": {"progress": "off"}}))
    pack = subprocess.run([sys.executable, "-m", "benchmarks.train_ab", "pack", "HEAD", "--out",
                           str(tmp_path / "trees")], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    tarball = Path(pack.stdout.strip())
    assert tarball.is_file()
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.train_ab", "run", "--tree", str(tarball),
             "--config", str(config), "--seq", "32", "--steps", "3", "--from-step", "2",
             "--set", "train.compile=false", *extra, "--out", str(tmp_path / "out"),
             "--timeout", "120"], cwd=ROOT, capture_output=True, text=True, timeout=180)

    # the default overrides ask for the Triton conv, which refuses CPU tensors: a failed row
    out = run()
    assert out.returncode == 1 and "exit 1 (see" in out.stdout, out.stdout + out.stderr
    out = run("--set", "model.conv_backend=torch")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "out" / "train_ab.json").read_text())
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["steps"] == 3
    assert rows[0]["tree"] == tarball.name[:-len(".tgz")] and rows[0]["step_ms"] > 0
    assert f"| {rows[0]['tree']} | 32 |" in out.stdout
