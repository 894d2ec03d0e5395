"""The console script: --help lists the subcommands; the demo runs and checks itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from overlap_runtime import cli


def test_help_lists_subcommands() -> None:
    out = subprocess.run([sys.executable, "-m", "overlap_runtime.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for name in cli.SUBCOMMANDS:
        assert name in out


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    assert "usage: overlap-runtime" in capsys.readouterr().out


def test_demo_small_runs_and_checks(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    trace = tmp_path / "trace.json"
    assert cli.main(["demo", "--pp", "2", "--ep", "1", "--microbatches", "4", "--tokens", "8",
                     "--hidden", "16", "--steps", "1", "--out", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "demo OK" in out and "OVERLAP_B_F" in out and "overlap ratio (measured" in out
    assert trace.stat().st_size > 0


def test_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    assert "cpu: 1 device(s), backend gloo" in capsys.readouterr().out
