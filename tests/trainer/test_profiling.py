"""Profiler windows (issue #20 item 3) and the EP metrics of a real run.

One 4-rank run (pp2 x ep2, interleaved 1F1B with OVERLAP_B_F, 4 steps, window [2, 3]) serves
every test here: the per-rank torch.profiler traces exist, parse as JSON, cover steps 2-3 only
and carry our range names for pipeline actions, expert all-to-alls and sync hooks (the hooks
run in the OVERLAP_B_F worker threads); rank 0 merged every rank's execution trace; and the
JSONL of the same run has the measured all-to-all overlap and the MoE balance numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from overlap_runtime.ops.profile_range import profile_range, profiling_active
from overlap_runtime.testing import run_ranks

RUN = {
    "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64, "mlp": "moe",
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32},
    "data": {"seq_len": 32, "batch_size": 4},
    "train": {"steps": 4, "log_every": 2,
              "accelerator": {"device": "cpu", "world_size": 4, "pp": 2, "ep": 2, "cp": 1},
              "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4,
                           "virtual_stages": 2, "overlap_b_f": True}},
}


def _train(rank: int, world: int, config: dict[str, Any]) -> None:
    from overlap_runtime.trainer import config_from_dict, train_distributed

    train_distributed(config_from_dict(config), torch.device("cpu"), log=lambda s: None)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profiled")
    config = {**RUN, "metrics": {"jsonl": str(out / "m.jsonl"), "progress": "off"},
              "profiling": {"enable": True, "steps": [2, 3], "dir": str(out / "prof")}}
    run_ranks(_train, 4, timeout_s=200, args=(config,))
    return out


def _spans(path: Path) -> list[dict[str, Any]]:
    trace = json.loads(path.read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_one_trace_per_rank_for_the_window_with_our_range_names(run_dir: Path) -> None:
    prof = run_dir / "prof"
    assert sorted(p.name for p in prof.iterdir()) == [
        "exec_trace.json", *[f"rank{r}.pt.trace.json" for r in range(4)]]
    for r in range(4):
        spans = _spans(prof / f"rank{r}.pt.trace.json")
        names = [e["name"] for e in spans]
        steps = sorted(n for n in names if n.startswith("train.step "))
        assert steps == ["train.step 2", "train.step 3"], (r, steps)  # the window only
        joined = "\n".join(names)
        # pipeline ranges are named after each action, as torch prints it
        assert re.search(r"^pp\.\dF\d$", joined, re.M), r
        assert re.search(r"^pp\.\dB\d$", joined, re.M), r
        assert re.search(r"^pp\.\(\dB\d;\dF\d\)OVERLAP_B_F$", joined, re.M), r
        assert re.search(r"^pp\.wait \dRECV_[FB]\d$", joined, re.M), r
        for label in ("dispatch", "combine"):
            for side in ("fwd", "bwd"):
                assert re.search(rf"^a2a S\d\.L\d\.{label} {side}$", joined, re.M), (r, label)
        assert re.search(r"^ep\.dispatch S\d\.L\d$", joined, re.M), r
        # sync hooks, forward and backward, recorded in the FWD/BWD worker threads too
        assert re.search(r"^hook [ABCD] forward L\d$", joined, re.M), r
        assert re.search(r"^hook [ABCD](_LAST)? backward L\d$", joined, re.M), r
        main = {e["tid"] for e in spans if e["name"].startswith("train.step ")}
        hook_threads = {e["tid"] for e in spans if e["name"].startswith("hook ")}
        assert len(main) == 1 and hook_threads - main, (r, main, hook_threads)


def test_rank0_merges_every_ranks_execution_trace_of_the_window(run_dir: Path) -> None:
    trace = json.loads((run_dir / "prof" / "exec_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    cats = {e["cat"] for e in spans}
    assert {"compute", "a2a", "hook", "comm"} <= cats
    # 2 steps x 4 microbatches x 2 virtual stages: each rank ran every F of its stages twice
    for r in range(4):
        fwd = [e["name"] for e in spans if e["pid"] == r and re.fullmatch(r"\dF\d", e["name"])]
        assert len(fwd) == 2 * 4 * 2, (r, len(fwd))


def test_the_jsonl_of_an_ep_run_has_the_measured_overlap_and_the_balance(run_dir: Path) -> None:
    records = [json.loads(x) for x in (run_dir / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        # OVERLAP_B_F: the other thread computes while an all-to-all is in flight
        assert 0.0 < r["a2a_overlap"] < 1.0 and r["a2a_time_s"] > 0
        assert set(r["moe_balance_per_layer"]) == {"0", "1", "2", "3"}
        assert 1.0 <= r["moe_balance_mean"] <= r["moe_balance_worst"] <= 4.0
        assert r["moe_dropped_tokens"] == 0


def test_profile_range_is_a_shared_no_op_without_a_profiler() -> None:
    assert not profiling_active()
    assert profile_range("x") is profile_range(lambda: "y")  # nothing built, name not formatted
    built: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiling_active()
        with profile_range(lambda: built.append("named") or "ours.range"):
            torch.ones(3).sum()
    assert built == ["named"]
    assert "ours.range" in {e.name for e in prof.events()}
