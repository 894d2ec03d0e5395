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


def test_info_lists_the_optional_parts(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    hidden = {"datasets", "tensorboard"}  # as if not installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in hidden else real(name, *a))
    assert main(["info"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and ":" not in line.split()[0]}
    names = ("triton", "matplotlib", "torch_npu", "tensorboard", "datasets", "tokenizers", "tqdm")
    assert set(names) <= set(rows), rows
    for name in names:
        usable = importlib.util.find_spec(name) is not None
        assert rows[name][0] == ("yes" if usable else "no"), (name, rows[name])
        assert (rows[name][1] == "-") == (not usable), (name, rows[name])
    assert rows["datasets"][:2] == ["no", "-"] and "(extra 'data')" in " ".join(rows["datasets"])
    assert rows["tensorboard"][:2] == ["no", "-"]
    assert rows["tqdm"][0] == "yes"  # a dependency: always there


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


def _bubble_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[float, str, str]:
    assert main(["schedule", *argv, "--no-grid", "--trace", ""]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    makespan, which, published = lines[-3:]
    assert makespan.startswith("makespan ") and which.startswith(
        "bubble = idle / (ranks x makespan) of the simulated timeline above"), lines[-3:]
    return float(makespan.split("bubble ")[1].split()[0]), which, published


@pytest.mark.parametrize("argv, head", [
    (["--kind", "gpipe"], "published GPipe (Huang et al. 2019): 0.2727 = (p - 1)/(v m + p - 1)"),
    (["--kind", "1f1b", "-m", "2"], "published 1F1B (Narayanan et al. 2021): 0.6000 = 1 - v m/"),
    (["--kind", "interleaved_1f1b", "-v", "2", "--overlap-b-f"],
     "published interleaved 1F1B (Narayanan et al. 2021): 0.1579 = (p - 1)/(v m + p - 1)"),
    (["--kind", "zero_bubble"],
     "published ZB-H1 (Qi et al. 2023, section 3.1): 0.1111 = idle (p - 1)(F + I - W) = 3 per"),
])
def test_schedule_says_which_bubble_it_prints_and_that_it_is_the_published_one(
        argv: list[str], head: str, capsys: pytest.CaptureFixture[str]) -> None:
    simulated, which, published = _bubble_lines(["--pp", "4", "-m", "8", *argv], capsys)
    assert "F=1 B=2 I=1 W=1, SEND latency 0" in which, which
    assert published.startswith(head) and published.endswith("; the simulation gives it"), \
        published
    assert f"{simulated:.4f}" in published


def test_schedule_dualpipev_explains_why_it_differs_from_the_paper(
        capsys: pytest.CaptureFixture[str]) -> None:
    simulated, _, published = _bubble_lines(["--kind", "dualpipev", "--pp", "4", "-m", "8",
                                             "-v", "2"], capsys)
    assert simulated == 0.1429  # idle 8 of 56: the lowered schedule's blocking comm lane
    assert published.startswith("published DualPipe (DeepSeek-V3 report, table 2): 0.1111 = "
                                "idle (PP/2 - 1)(F&B + B - 3W), PP = 2p = 8 stages, F&B = F + B")
    assert "6 per rank; the simulated 0.1429 differs: the formula starts each overlapped F&B " \
           "step as one unit once both inputs are here (0.1111 in that model" in published
    assert "one in-order comm lane" in published and published.endswith("section 9)")


@pytest.mark.parametrize("argv, reason", [
    (["--kind", "1f1b", "--comm-latency", "0.5"], "differs: each SEND takes 0.5 here (10.5 exposed"),
    (["--kind", "1f1b", "--split-backward"], "differs: with --split-backward only I crosses"),
    (["--kind", "zero_bubble", "--cost-f", "2"], "differs: ZB-H1's fixed order reaches the "
                                                 "formula only for W = F <= I (here F=2 I=1 W=1)"),
])
def test_schedule_names_why_the_simulation_differs(argv: list[str], reason: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    simulated, _, published = _bubble_lines(["--pp", "4", "-m", "8", *argv], capsys)
    assert reason in published and f"the simulated {simulated:.4f} differs" in published, \
        published
