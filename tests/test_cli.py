"""The console script: --help lists the subcommands; the demo's flags; info."""

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


def test_demo_flags() -> None:
    # the demo trains from a YAML config; tests/test_demo.py runs it (spawned and torchrun)
    args = cli.build_parser().parse_args(["demo", "--config", "c.yaml", "--steps", "2", "--pp",
                                          "2", "--ep", "2", "--out", "t.json", "--timeout", "30"])
    assert (args.config, args.steps, args.pp, args.ep, args.out, args.timeout) == (
        "c.yaml", 2, 2, 2, "t.json", 30.0)
    defaults = cli.build_parser().parse_args(["demo"])
    assert defaults.config is None and defaults.out.endswith("moe_pp_ep_trace.json")


def test_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    assert "cpu: 1 device(s), backend gloo" in capsys.readouterr().out
