"""Streamed metrics (issue #20 item 2): JSONL per log step that survives a crash, TensorBoard
event files, MoE load balance against a hand count, the all-to-all overlap number on a
hand-made timeline, progress mode selection, and the ``metrics`` section's load-time checks.

The 4-rank pp2 x ep2 run that checks ``a2a_overlap`` and the balance numbers of a real
distributed run lives in test_profiling.py (one run serves both).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from overlap_runtime.moe.layer import MoE
from overlap_runtime.moe.load_stats import ExpertLoadStats, balance_summary
from overlap_runtime.pipeline.exec_trace import TraceEvent
from overlap_runtime.testing import RankFailedError, run_ranks
from overlap_runtime.trainer import ConfigError, config_from_dict
from overlap_runtime.trainer.a2a_overlap import a2a_overlap_ns
from overlap_runtime.trainer.progress import Progress, resolve_progress_mode


def _config(tmp: Path, steps: int, **metrics: Any) -> dict[str, Any]:
    return {
        "model": {"hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
                  "full_attention_interval": 2, "mlp": "moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        "data": {"seq_len": 32, "batch_size": 2},
        "train": {"steps": steps, "log_every": 1,
                  "accelerator": {"device": "cpu", "world_size": 1, "cp": 1}},
        "metrics": {"jsonl": str(tmp / "run" / "metrics.jsonl"), "progress": "off", **metrics},
    }


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- JSONL and a crash


def _train_and_die_at_step_3(rank: int, world: int, config: dict[str, Any]) -> None:
    from overlap_runtime.trainer import train_distributed

    def on_model(pm: Any) -> None:
        model = pm.parts[0]
        original, calls = model.forward, [0]

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:  # pp == 1: one forward per step; the process dies mid step 3
                os._exit(3)
            return original(*args, **kwargs)

        model.forward = forward

    train_distributed(config_from_dict(config), torch.device("cpu"), log=lambda s: None,
                      on_model=on_model)


def test_jsonl_has_a_line_per_log_step_and_keeps_them_when_the_process_dies(
        tmp_path: Path) -> None:
    config = _config(tmp_path, steps=5)
    with pytest.raises(RankFailedError):
        run_ranks(_train_and_die_at_step_3, 1, timeout_s=120, args=(config,))
    records = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens"] == 2 * 32
        assert r["peak_memory_kind"] == "rss" and r["peak_memory_bytes"] > 2**20
        assert r["mfu"] is None and r["flops_per_step"] > 0  # CPU: no peak, no MFU
        assert r["moe_dropped_tokens"] == 0 and 1.0 <= r["moe_balance_worst"] <= 4.0
        assert r["a2a_overlap"] is None  # ep == 1


# --------------------------------------------------------------------------- TensorBoard


def test_single_run_writes_jsonl_and_tensorboard_events_readable_by_tensorboard(
        tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from overlap_runtime.trainer import train_single

    raw = _config(tmp_path, steps=3, tensorboard=str(tmp_path / "tb"))
    raw["train"]["log_every"] = 2
    result = train_single(config_from_dict(raw))
    # the single-device run writes beside the distributed run's outputs, never over them
    records = _read_jsonl(tmp_path / "run" / "metrics.single.jsonl")
    assert [r["step"] for r in records] == [2, 3]  # every log_every steps and the last one
    for r in records:
        assert r["loss"] == result.steps[r["step"] - 1].loss
    acc = EventAccumulator(str(tmp_path / "tb" / "single"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/grad_norm", "train/tokens_per_s", "train/moe_balance_worst",
            "moe/balance_layer0", "moe/balance_layer1"} <= set(tags)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 3]
    for e in loss:
        assert e.value == pytest.approx(result.steps[e.step - 1].loss, rel=1e-6)


# --------------------------------------------------------------------------- MoE balance


def _routed_moe() -> MoE:
    """4 experts, top-2; a token e_i (one-hot) scores 10 on expert i and 5 on expert i+1."""
    moe = MoE(hidden=4, ffn_hidden=4, num_experts=4, top_k=2)
    with torch.no_grad():
        w = torch.zeros(4, 4)
        for i in range(4):
            w[i, i] = 10.0
            w[(i + 1) % 4, i] = 5.0
        moe.router.gate.weight.copy_(w)
    return moe


def test_moe_balance_matches_a_hand_count_and_recompute_is_not_counted() -> None:
    moe = _routed_moe()
    stats = ExpertLoadStats(num_layers=3, num_experts=4)
    moe.count_load(stats, layer=2)
    eye = torch.eye(4)
    x = torch.stack([eye[0], eye[0], eye[1], eye[3]])[None].requires_grad_(True)  # [1, 4, 4]
    # by hand: e0 -> {0, 1} twice, e1 -> {1, 2}, e3 -> {3, 0}
    out = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    out.sum().backward()  # replays the forward: must not count again
    loads = stats.reduce(across_ranks=False)
    assert list(loads) == [2]
    assert loads[2].counts == (3, 3, 1, 1)
    assert (loads[2].routed, loads[2].processed, loads[2].dropped) == (8, 8, 0)
    summary = balance_summary(loads)
    assert summary is not None
    assert summary["per_layer"] == {2: 1.5}  # max 3 / mean 8/4
    assert summary["worst"] == summary["mean"] == 1.5 and summary["dropped"] == 0
    stats.reset()
    assert stats.reduce(across_ranks=False) == {} and balance_summary({}) is None


# --------------------------------------------------------------------------- a2a overlap


def test_a2a_overlap_counts_only_compute_that_runs_while_an_all_to_all_is_in_flight() -> None:
    def ev(thread: str, name: str, cat: str, a: int, b: int) -> TraceEvent:
        return TraceEvent(0, thread, name, cat, a, b)

    events = [
        ev("main", "0F0", "compute", 0, 100),               # the F action around everything
        ev("main", "L0.dispatch fwd", "a2a", 10, 30),        # waited with nothing to do: exposed
        ev("main", "L0.combine fwd", "a2a", 50, 90),         # shared expert 60-80 inside: hidden
        ev("main", "L0.shared_expert", "moe_compute", 60, 80),
        ev("BWD", "1B0", "compute", 0, 100),                 # the other thread computes 20-40,
        ev("BWD", "L0.D bwd", "hook", 0, 20),                # waits on hooks elsewhere
        ev("BWD", "L0.B bwd", "hook", 40, 100),
    ]
    flight, hidden = a2a_overlap_ns(events)
    assert flight == 20 + 40
    assert hidden == (30 - 20) + (80 - 60)  # BWD computes 20-30 of the dispatch; shared expert
    assert a2a_overlap_ns([ev("main", "0F0", "compute", 0, 10)]) == (0, 0)


# --------------------------------------------------------------------------- progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_progress_mode_bar_on_a_terminal_lines_otherwise() -> None:
    assert resolve_progress_mode("auto", _Stream(tty=True)) == "bar"
    assert resolve_progress_mode("auto", _Stream(tty=False)) == "lines"
    assert resolve_progress_mode("off", _Stream(tty=True)) == "off"
    assert resolve_progress_mode("lines", _Stream(tty=True)) == "lines"
    with pytest.raises(ValueError, match="metrics.progress='fancy'"):
        resolve_progress_mode("fancy")
    lines: list[str] = []
    log = lines.append
    assert Progress("lines", 3, 1, log).line_log() is log
    assert Progress("off", 3, 1, log).line_log() is None

    class M:
        loss, grad_norm, tokens_per_s = 1.25, 0.5, 1000.0

    stream = _Stream(tty=True)
    bar = Progress("bar", 3, 1, log, stream=stream)
    assert bar.line_log() is None  # the bar replaces the per-step lines
    for step in (1, 2, 3):
        m = M()
        m.step = step  # type: ignore[attr-defined]
        bar(m)
    bar.close()
    text = stream.getvalue()
    assert "3/3" in text and "loss=1.2500" in text and "<" in text  # steps, postfix, ETA


# --------------------------------------------------------------------------- load-time checks


def test_metrics_section_is_checked_at_load(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    raw = _config(tmp_path, steps=2)
    raw["metrics"]["jsonl"] = str(blocker / "sub" / "m.jsonl")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl=.*cannot be created"):
        config_from_dict(raw)
    raw["metrics"]["jsonl"] = str(tmp_path)
    with pytest.raises(ConfigError, match=r"metrics\.jsonl=.*is a directory"):
        config_from_dict(raw)
    raw["metrics"]["jsonl"] = None
    raw["profiling"] = {"enable": True, "steps": [2, 3], "dir": str(tmp_path / "p")}
    with pytest.raises(ConfigError, match=r"profiling\.steps=\[2, 3\].*train\.steps=2"):
        config_from_dict(raw)
    raw["profiling"]["steps"] = [2, 1]
    with pytest.raises(ConfigError, match=r"profiling\.steps=\[2, 1\]"):
        config_from_dict(raw)
    del raw["profiling"]

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    raw["metrics"]["tensorboard"] = str(tmp_path / "tb")
    with pytest.raises(ConfigError, match=r"metrics\.tensorboard=.*pip install "
                                          r"overlap_runtime\[tensorboard\]"):
        config_from_dict(raw)
