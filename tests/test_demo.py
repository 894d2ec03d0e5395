"""``overlap-runtime demo``: the trainer on PP=2 x EP=2, spawned and under torchrun; its checks.

The end-to-end runs start fresh interpreters (``python -m overlap_runtime.cli demo``): the command
as a user runs it, and the ranks' output goes where a user's would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlap_runtime import demo
from overlap_runtime.cli import main
from overlap_runtime.launch import launched_by_torchrun

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    "overlap-runtime demo: the trainer on PP=2 x EP=2, 4 cpu ranks",
    "schedule (compute steps per pipeline rank",
    "OVERLAP_B_F",
    "step  loss overlap_b_f   loss baseline",
    "vs baseline over 2 steps: loss worst rel",
    "launch order: ",
    "overlap ratio (measured, last step, all ranks): ",
    "overlap ratio (predicted by the task-graph simulator",
    "merged Chrome trace (measured ranks + predicted step): ",
    "demo OK",
)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # spawned: not inside someone's torchrun
        env.pop(k, None)
    return env


def _check_output(out: str, trace: Path) -> None:
    for section in SECTIONS:
        assert section in out, f"missing {section!r} in:\n{out}"
    assert out.count("demo OK") == 1
    rows = [l for l in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d{8}\s+\d+\.\d{8}\s", l)]
    assert [r.split()[0] for r in rows] == ["1", "2"], out  # one loss row per step
    measured = re.search(r"ms, (\d+) all-to-alls\); over the whole step: ([\d.]+)%", out)
    assert measured and int(measured.group(1)) > 0 and float(measured.group(2)) > 0, out
    predicted = re.search(r"last step\): ([\d.]+)% inside OVERLAP_B_F steps, [\d.]+% over the "
                          r"whole step; one step ([\d.]+) ms overlapped vs ([\d.]+) ms serial", out)
    assert predicted and float(predicted.group(2)) < float(predicted.group(3)), out
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {e["pid"] for e in events}
    assert {0, 1, 2, 3} <= pids and any(p >= 100 for p in pids), pids  # measured + predicted


# ----------------------------------------------------------------------------- configuration


def test_embedded_config_is_the_file_and_fits_the_demo() -> None:
    assert demo.DEFAULT_CONFIG_YAML == (ROOT / "configs" / "demo_pp2_ep2.yaml").read_text()
    config = demo.load_demo_config(None)
    acc, pl = config.train.accelerator, config.train.pipeline
    assert (acc.pp, acc.ep, acc.resolved_world_size, pl.overlap_b_f) == (2, 2, 4, True)
    assert config.model.num_experts_per_tok == config.model.num_experts  # no top-k ties
    assert config.train.precision == "fp32" and demo.demo_problems(config) == []


def test_overrides() -> None:
    config = demo.load_demo_config(None, steps=3, pp=2, ep=4, timeout_s=7.0)
    acc = config.train.accelerator
    assert (config.train.steps, acc.pp, acc.ep, acc.resolved_world_size) == (3, 2, 4, 8)
    assert acc.comm_timeout_s == 60  # the config's own bound wins over --timeout
    config = demo.load_demo_config(None, ep=4, sets=["model.num_experts=8",
                                                     "train.accelerator.comm_timeout_s=null"],
                                   timeout_s=7.0)
    acc = config.train.accelerator
    assert (config.model.num_experts, acc.ep, acc.resolved_world_size) == (8, 4, 8)
    assert acc.comm_timeout_s == 7.0  # unset by --set: --timeout fills it


@pytest.mark.parametrize("argv, words", [
    (["--ep", "3"], "train.accelerator.ep=3 must divide model.num_experts=4"),
    (["--ep", "1"], "train.accelerator.ep=1: the demo overlaps expert-parallel all-to-alls"),
    (["--pp", "4"], "8 stages exceed model.num_hidden_layers=4"),
    (["--config", "/no/such.yaml"], "cannot read training configuration /no/such.yaml"),
    (["--config", str(ROOT / "configs" / "tiny_cp4_p2p.yaml")], "it needs pp >= 2"),
    (["--timeout", "0"], "--timeout 0.0: must be > 0 seconds"),
    (["--set", "train.pipeline.microbatches=3"],
     "train.pipeline.microbatches=3 must divide data.batch_size=4"),
    (["--set", "train.accelerator.world_size=6"], "world_size=6"),  # 6 ranks: pp 2 x dp_shard 2
    (["--set", "train.pipeline.microbatches=3", "--ep", "4"],  # every broken rule, once
     "with --set train.pipeline.microbatches=3 --ep 4: train.pipeline.microbatches=3 must divide"),
    (["--set", "train.pipline.microbatches=2"], "train.pipline is not a section"),
    pytest.param(["--set", "train.accelerator.device=cuda"],
                 "4 ranks on 'cuda' (one device each) cannot start here",
                 marks=pytest.mark.skipif(torch.cuda.device_count() >= 4,
                                          reason="4 GPUs here: the demo could start")),
])
def test_bad_sizes_fail_before_any_rank_starts(argv: list[str], words: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    import overlap_runtime.launch as launch

    def no_spawn(*a: object, **k: object) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert main(["demo", *argv]) == 2
    err = capfd.readouterr().err
    assert words in err and err.startswith("error: ") and err.count("\n") == 1, err


def test_a_size_flag_is_refused_the_sizes_live_in_the_config(
        capfd: pytest.CaptureFixture[str]) -> None:
    # the model's sizes are config fields (--set model.hidden_size=16), never demo flags
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--hidden", "16"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --hidden 16" in capfd.readouterr().err


def test_torchrun_detection(monkeypatch: pytest.MonkeyPatch,
                            capfd: pytest.CaptureFixture[str]) -> None:
    assert launched_by_torchrun({}) is False
    assert launched_by_torchrun({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) is True
    with pytest.raises(RuntimeError, match=r"\['RANK'\] set but \['WORLD_SIZE', 'LOCAL_RANK'\]"):
        launched_by_torchrun({"RANK": "0"})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["demo"]) == 2
    assert "torchrun environment incomplete" in capfd.readouterr().err


def test_train_command_shares_the_torchrun_detection(monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    # `overlap-runtime train` decides spawn vs join with launch.launched_by_torchrun too: a
    # half-set torchrun environment is a one-line error, not a join that waits for a rendezvous
    import overlap_runtime.launch as launch

    def no_ranks(*a: object, **k: object) -> None:
        raise AssertionError("ranks started or a group joined")

    monkeypatch.setattr(launch, "spawn", no_ranks)
    monkeypatch.setattr(launch, "init_from_env", no_ranks)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["train", str(ROOT / "configs" / "tiny_cp4_p2p.yaml")]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: torchrun environment incomplete: ['RANK'] set") and \
        err.count("\n") == 1, err


# ----------------------------------------------------------------------------- the verdict


def _report(loss_delta: float) -> dict:
    step = {"step": 1, "loss": 5.0, "grad_norm": 1.0, "step_time_s": 0.1}
    ranks = [{"rank": r, "pp_rank": r // 2, "ep_rank": r % 2, "launches": 40, "param_err": 0.0,
              "param_tensors": 36, "paired_steps": 3} for r in range(4)]
    share = {"share": 0.5, "hidden_s": 0.01, "a2a_s": 0.02, "count": 8.0}
    return {"world": 4, "num_parameters": 1, "ranks": ranks, "layers_per_chunk": 1,
            "steps": {"baseline": [step], "overlap": [dict(step, loss=5.0 + loss_delta)]},
            "run_wall_s": {"baseline": 1.0, "overlap": 1.0}, "measured": share,
            "measured_all": share, "predicted": 0.3, "predicted_all": 0.2,
            "predicted_step_s": 0.01, "predicted_serial_step_s": 0.02, "events": [],
            "sim_trace": {"traceEvents": []}}


def test_report_fails_when_the_overlapped_loss_differs(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.print_report(_report(0.0), str(tmp_path / "t.json"), 1.0) == 0
    assert "demo OK" in capsys.readouterr().out
    assert demo.print_report(_report(5.0 * 2e-6), str(tmp_path / "t.json"), 1.0) == 1
    out = capsys.readouterr().out
    assert "demo FAILED" in out and "demo OK" not in out
    nan = _report(float("nan"))
    assert demo.print_report(nan, str(tmp_path / "t.json"), 1.0) == 1


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_spawned_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "overlap_runtime.cli", "demo", "--steps", "2", "--out",
           str(trace)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "spawned here (gloo)" in proc.stdout
    assert "80 EP all-to-alls per rank" in proc.stdout  # 2 steps x 4 mb x 2 stages x (3 + 2)
    _check_output(proc.stdout, trace)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_under_torchrun(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "overlap_runtime.cli", "demo", "--steps", "2", "--out", str(trace)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "spawned here" not in proc.stdout and "started by torchrun" in proc.stdout
    _check_output(proc.stdout, trace)  # printed once: by global rank 0
