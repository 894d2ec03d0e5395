"""The console script: --help lists the subcommands; the demo's flags; info."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlap_runtime import cli
from overlap_runtime.cli import main


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


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from overlap_runtime import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"overlap-runtime {__version__}"


def test_info_lists_the_optional_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("triton", "matplotlib", "torch_npu"):
        assert any(line.split()[:1] == [name] and line.split()[1] in ("yes", "no")
                   for line in out.splitlines()), out


@pytest.mark.parametrize("argv, needle", [
    (["schedule", "--spec", "/nonexistent/missing.yaml"],
     "error: cannot read --spec /nonexistent/missing.yaml: No such file or directory"),
    (["schedule", "--kind", "1f1b", "--pp", "2", "--plot", "/nonexistent/x.png"],
     "error: --plot /nonexistent/x.png: its directory /nonexistent does not exist"),
    (["schedule", "--kind", "1f1b", "--pp", "2", "--csv", "/nonexistent/s.csv"],
     "error: --csv /nonexistent/s.csv: its directory /nonexistent does not exist"),
])
def test_schedule_bad_paths_are_one_line_errors(argv: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == needle, err


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("argv, words", [
    ([str(CONFIGS / "tiny_cp4_p2p.yaml"), "--world-size", "3"],
     "with --world-size 3: train.accelerator.cp=4 does not divide train.accelerator.world_size=3"),
    ([str(CONFIGS / "demo_pp2_ep2.yaml"), "--set", "train.pipeline.microbatches=3"],
     "train.pipeline.microbatches=3 must divide data.batch_size=4"),
    ([str(CONFIGS / "demo_pp2_ep2.yaml"), "--set", "train.accelerator.ep=3"],
     "train.accelerator.ep=3 must divide model.num_experts=4"),
    ([str(CONFIGS / "demo_pp2_ep2.yaml"), "--steps", "0"],
     "with --steps 0: train.steps: Input should be greater than or equal to 1"),
    pytest.param([str(CONFIGS / "demo_pp2_ep2.yaml"), "--set", "train.accelerator.device=cuda"],
                 "4 ranks on 'cuda' (one device each) cannot start here",
                 marks=pytest.mark.skipif(torch.cuda.device_count() >= 4,
                                          reason="4 GPUs here: the job could start")),
])
def test_train_checks_sizes_before_any_rank_starts(argv: list[str], words: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    import overlap_runtime.launch as launch
    import overlap_runtime.trainer.loop as loop

    def no_ranks(*a: object, **k: object) -> None:
        raise AssertionError("ranks started")

    for module, name in ((launch, "spawn"), (launch, "init_from_env"), (loop, "spawn_training")):
        monkeypatch.setattr(module, name, no_ranks)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert main(["train", *argv]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
