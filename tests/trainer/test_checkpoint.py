"""Checkpoint and resume with torch.distributed.checkpoint on gloo ranks (#20 item 1).

- 10 steps straight equal 5 steps, save, stop, resume, 5 steps: bitwise, fp32, for a cp2 layout
  (2 ranks, sync and async save) and a pp2 x ep2 layout (4 ranks, OVERLAP_B_F).
- Resharding: the pp2 x ep2 checkpoint resumes under pp1 x cp2 x ep4 (4 ranks), and the cp2
  checkpoint in the single-device baseline; both then follow the straight run within 1e-5.
- A rank killed (SIGKILL) after writing its data of the step-4 save and before the commit: the
  next run resumes from step 2 and ends bitwise where the straight run ends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.support.trainer import train_worker

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import TrainResult, compare_runs, config_from_dict, train_single
from overlap_runtime.trainer.checkpoint import (FAULT_ENV, CheckpointError, latest_checkpoint,
                                                list_checkpoints)
from overlap_runtime.config.train import ConfigError

MOE = {"mlp": "moe", "num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32}
CP_MODES = {"linear_attention_cp_mode": "p2p", "full_attention_cp_mode": "ring"}


def cfg(world: int, steps: int, checkpoint: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None, pipeline: dict[str, Any] | None = None,
        **acc: Any) -> dict[str, Any]:
    accelerator = {"device": "cpu", "cp": 1, "world_size": world, "comm_timeout_s": 60.0, **acc}
    return {
        "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
                  **(model or {})},
        "data": {"seq_len": 64, "batch_size": 4},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0,
                      "warmup_steps": 3},
        "train": {"steps": steps, "seed": 0, "precision": "fp32", "accelerator": accelerator,
                  "pipeline": pipeline or {}},
        "checkpoint": checkpoint or {},
    }


def losses(run: dict[str, Any] | TrainResult) -> dict[int, float]:
    r = run if isinstance(run, TrainResult) else TrainResult.from_dict(run)
    return {m.step: m.loss for m in r.steps}


def grad_norms(run: dict[str, Any]) -> dict[int, float]:
    return {m.step: m.grad_norm for m in TrainResult.from_dict(run).steps}


CP2 = dict(cp=2, **CP_MODES)


@pytest.fixture(scope="module")
def cp2_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt_cp2")
    sync_dir, async_dir = str(root / "sync"), str(root / "async")
    configs = [
        cfg(2, 10, **CP2),
        cfg(2, 5, {"dir": sync_dir}, **CP2),
        cfg(2, 10, {"dir": sync_dir, "resume": "latest", "interval": 2, "keep_last": 2}, **CP2),
        cfg(2, 5, {"dir": async_dir, "async_save": True, "interval": 2}, **CP2),
        cfg(2, 10, {"dir": async_dir, "resume": "auto", "save_final": False}, **CP2),
    ]
    out = run_ranks(train_worker, 2, timeout_s=300, args=(configs,))[0]
    return {"straight": out[0], "first": out[1], "resumed": out[2], "async_first": out[3],
            "async_resumed": out[4], "sync_dir": sync_dir, "async_dir": async_dir,
            "configs": configs}


def test_cp2_resume_is_bitwise(cp2_runs: dict[str, Any]) -> None:
    straight, first, resumed = (losses(cp2_runs[k]) for k in ("straight", "first", "resumed"))
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [6, 7, 8, 9, 10]
    assert {**first, **resumed} == straight
    g = grad_norms(cp2_runs["straight"])
    assert {**grad_norms(cp2_runs["first"]), **grad_norms(cp2_runs["resumed"])} == g
    # interval 2 with keep_last 2 in the resumed run: 6, 8, 10 saved, the newest two kept, and
    # step 5, which the run resumed from (pruning never removes it)
    assert [s for s, _ in list_checkpoints(cp2_runs["sync_dir"])] == [5, 8, 10]


def test_cp2_async_save_resumes_bitwise(cp2_runs: dict[str, Any]) -> None:
    straight = losses(cp2_runs["straight"])
    first, resumed = losses(cp2_runs["async_first"]), losses(cp2_runs["async_resumed"])
    assert {**first, **resumed} == straight
    # interval 2 and the final save: 2, 4, 5; the resumed run saves nothing (interval unset)
    assert [s for s, _ in list_checkpoints(cp2_runs["async_dir"])] == [2, 4, 5]
    assert not [p for p in Path(cp2_runs["async_dir"]).iterdir() if p.name.startswith(".tmp")]


def test_cp2_checkpoint_loads_into_one_device(cp2_runs: dict[str, Any], tmp_path: Path) -> None:
    """cp2 (FSDP over 2 ranks) -> one device, no process group: the same parameters and AdamW
    state, so the single-device continuation follows the straight cp2 run within 1e-5."""
    path = Path(cp2_runs["async_dir"]) / "step-00000004"
    config = config_from_dict(cfg(2, 8, {"resume": str(path)}, **CP2))
    single = train_single(config)
    straight = losses(cp2_runs["straight"])
    assert sorted(losses(single)) == [5, 6, 7, 8]
    for step, loss in losses(single).items():
        assert abs(loss - straight[step]) <= 1e-5 * abs(straight[step]), (step, loss)


@pytest.mark.slow
def test_pp2_ep2_resume_bitwise_and_reshard_to_cp2_ep4(tmp_path: Path) -> None:
    d = str(tmp_path / "pp2ep2")
    pipeline = {"schedule": "interleaved_1f1b", "microbatches": 4, "virtual_stages": 2,
                "overlap_b_f": True}
    pp2_ep2 = dict(model=MOE, pp=2, ep=2, pipeline=pipeline)
    configs = [
        cfg(4, 8, **pp2_ep2),
        cfg(4, 4, {"dir": d}, **pp2_ep2),
        cfg(4, 8, {"dir": d, "resume": "latest", "save_final": False}, **pp2_ep2),
        # pp2 x dp_shard2 x ep2 -> pp1 x dp_shard2 x cp2 x ep4 (the same global batch): other
        # FSDP shards, other expert owners, the stages in one module
        cfg(4, 8, {"resume": str(Path(d) / "step-00000004")}, model=MOE, dp_shard=2, cp=2,
            ep=4, **CP_MODES),
    ]
    out = run_ranks(train_worker, 4, timeout_s=400, args=(configs,))[0]
    straight, first, resumed, resharded = (losses(r) for r in out)
    assert {**first, **resumed} == straight
    assert sorted(resharded) == [5, 6, 7, 8]
    for step, loss in resharded.items():
        assert abs(loss - straight[step]) <= 1e-5 * abs(straight[step]), (step, loss)


def test_a_rank_killed_mid_save_resumes_from_the_previous_checkpoint(
        cp2_runs: dict[str, Any], tmp_path: Path) -> None:
    d = tmp_path / "killed"
    first = cfg(2, 6, {"dir": str(d), "interval": 2}, **CP2)
    with pytest.raises(Exception):
        run_ranks(train_worker, 2, timeout_s=300, args=([first],),
                  env={FAULT_ENV: "step=4,rank=1"})
    assert [s for s, _ in list_checkpoints(d)] == [2]
    assert (d / ".tmp-step-00000004").is_dir()  # the interrupted save: invisible to resume
    again = cfg(2, 6, {"dir": str(d), "interval": 2, "resume": "auto"}, **CP2)
    out = run_ranks(train_worker, 2, timeout_s=300, args=([again],))[0]
    resumed = losses(out[0])
    assert sorted(resumed) == [3, 4, 5, 6]
    straight = losses(cp2_runs["straight"])
    assert resumed == {s: straight[s] for s in resumed}
    assert [s for s, _ in list_checkpoints(d)] == [2, 4, 6]
    assert not (d / ".tmp-step-00000004").exists()  # rank 0 cleared it at start-up


# ---- single process: rules -------------------------------------------------------------------

def test_checkpoint_fields_need_a_dir() -> None:
    for bad in ({"interval": 2}, {"keep_last": 1}, {"resume": "latest"}, {"async_save": True}):
        with pytest.raises(ConfigError, match="needs checkpoint.dir"):
            config_from_dict(cfg(1, 2, bad))


def test_fresh_run_refuses_a_dir_with_checkpoints_and_resume_checks_the_model(
        tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    train_single(config_from_dict(cfg(1, 2, {"dir": d})))
    assert latest_checkpoint(d) is not None and latest_checkpoint(d).name == "step-00000002"
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train_single(config_from_dict(cfg(1, 3, {"dir": d})))
    with pytest.raises(CheckpointError, match="model.intermediate_size=64 there, 96 here"):
        train_single(config_from_dict(cfg(1, 3, {"dir": d, "resume": "latest"},
                                          model={"intermediate_size": 96})))
    changed = cfg(1, 3, {"dir": d, "resume": "latest"})
    changed["data"]["seq_len"] = 32
    with pytest.raises(CheckpointError, match="(?s)the data is not the data of the run.*seq_len: 64 -> 32"):
        train_single(config_from_dict(changed))
    with pytest.raises(CheckpointError, match="nothing left to train"):
        train_single(config_from_dict(cfg(1, 2, {"dir": d, "resume": "latest"})))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train_single(config_from_dict(cfg(1, 2, {"dir": str(tmp_path / "empty"),
                                                 "resume": "latest"})))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        train_single(config_from_dict(cfg(1, 2, {"resume": str(tmp_path)})))


def test_resumed_run_keeps_the_metrics_of_the_steps_before_its_checkpoint(
        tmp_path: Path) -> None:
    """The JSONL of a run that crashed after its step-2 checkpoint holds steps 1-3 and a cut
    line; the resumed run keeps 1-2, trains 3-4 again and appends: every step once, in order."""
    d, jsonl = str(tmp_path / "c"), tmp_path / "m" / "run.jsonl"
    metrics = {"jsonl": str(jsonl), "progress": "off"}
    written = jsonl.with_name("run.single.jsonl")  # train_single's own file
    first = cfg(1, 2, {"dir": d})
    train_single(config_from_dict({**first, "metrics": metrics}))
    written.write_text(written.read_text() + '{"step": 3, "loss": 1.0}\n{"step": 4, "lo')
    again = cfg(1, 4, {"dir": d, "resume": "latest"})
    train_single(config_from_dict({**again, "metrics": metrics}))
    steps = [json.loads(line)["step"] for line in written.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
