"""The extension points work from outside the package: a CP mode and a schedule kind defined in
this file only (no library file names them) are accepted by the YAML, trained on real gloo
ranks and simulated.

- ``toy_gather``: a GDN context-parallel mode registered with ``config.cp_modes.register_cp_mode``:
  its strategy runs the all-gather algorithm (a subclass of the built-in mixer that counts its
  calls), its program and cost are the all-gather plan (``stepgraph.layer_program.
  builtin_gdn_program``). Trained on cp2 with the step graph validated and the first step checked
  for conformance, equal to one device; the crossover table prices it.
- ``toy_gpipe``: a schedule kind registered with ``schedules.registry.register_schedule_kind``
  (GPipe's builder under a new name): ``train.pipeline.schedule: toy_gpipe`` validates, trains
  on pp2 equal to one device, and simulates to GPipe's figures.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from tests.support.trainer import tiny_config

import overlap_runtime
from overlap_runtime.config.cp_modes import (GDN_ALL_GATHER, CPMode, get_cp_mode, register_cp_mode,
                                             unregister_cp_mode)
from overlap_runtime.context_parallel.gdn.all_gather import AllGatherGDNMixer
from overlap_runtime.schedules.kind import ScheduleKind
from overlap_runtime.schedules.kinds.gpipe import build_gpipe
from overlap_runtime.schedules.registry import (get_schedule_kind, register_schedule_kind,
                                                unregister_schedule_kind)
from overlap_runtime.stepgraph import layer_program
from overlap_runtime.stepgraph.costs import h200_profile
from overlap_runtime.stepgraph.crossover import modes_of, predict_mode
from overlap_runtime.stepgraph.layer_program import builtin_gdn_program
from overlap_runtime.stepgraph.scale import predict_at_scale
from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import (ConfigError, TrainResult, compare_runs, config_from_dict,
                                     train_distributed, train_single)

TOY_MODE = "toy_gather"
TOY_KIND = "toy_gpipe"
REL_TOL = 1e-5


class ToyGatherMixer(AllGatherGDNMixer):
    """The toy mode's strategy: the all-gather algorithm, counting its forward calls."""

    calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        ToyGatherMixer.calls += 1
        return super().forward(*args, **kwargs)


def _register() -> None:
    """Register both toys (idempotent: a rank process calls it before reading its config)."""
    try:
        get_cp_mode("linear_attention", TOY_MODE)
    except ValueError:
        register_cp_mode(CPMode(TOY_MODE, "linear_attention", halo=True, passes_state=True,
                                strategy=ToyGatherMixer,
                                program=builtin_gdn_program(GDN_ALL_GATHER.name)))
    try:
        get_schedule_kind(TOY_KIND)
    except ValueError:
        register_schedule_kind(ScheduleKind(TOY_KIND, build_gpipe, max_virtual=1,
                                            overlap_b_f=False))


@pytest.fixture
def toys() -> Iterator[None]:
    _register()
    yield
    unregister_cp_mode("linear_attention", TOY_MODE)
    unregister_schedule_kind(TOY_KIND)


def _worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    _register()
    config = config_from_dict(cfg)
    result = train_distributed(config, torch.device("cpu"), log=lambda line: None).to_dict()
    return {"result": result, "toy_calls": ToyGatherMixer.calls} if rank == 0 else None


def _toy_cp_config() -> dict[str, Any]:
    cfg = tiny_config(2, seq_len=64, cp=2, linear_attention_cp_mode=TOY_MODE)
    cfg["train"]["check_conformance"] = True  # the step graph is proved and the step checked
    return cfg


def test_unregistered_names_are_refused() -> None:
    with pytest.raises(ConfigError, match=TOY_MODE):
        config_from_dict(_toy_cp_config())
    with pytest.raises(ConfigError, match=TOY_KIND):
        config_from_dict(_toy_pp_config(TOY_KIND))


def test_no_library_file_names_the_toys() -> None:
    """Files touched to add a CP mode or a schedule kind: this one (the package never spells
    their names)."""
    root = Path(overlap_runtime.__file__).parent
    for path in root.rglob("*.py"):
        found = {n.value for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not found & {TOY_MODE, TOY_KIND}, path


def test_a_registered_cp_mode_trains_on_cp2_like_one_device(toys: None) -> None:
    config = config_from_dict(_toy_cp_config())
    out = run_ranks(_worker, 2, timeout_s=300, args=(_toy_cp_config(),))[0]
    run = TrainResult.from_dict(out["result"])
    assert out["toy_calls"] > 0  # the toy's strategy ran on the ranks
    assert TOY_MODE in run.mode, run.mode
    diff = compare_runs(run, train_single(config))
    assert len(run.steps) == 2
    assert diff["max_rel_dloss"] <= REL_TOL and diff["max_rel_dgrad_norm"] <= REL_TOL, diff


def test_a_registered_cp_mode_is_planned_and_priced(toys: None) -> None:
    toy = config_from_dict(_toy_cp_config())
    ref = config_from_dict(tiny_config(2, seq_len=64, cp=2,
                                       linear_attention_cp_mode=GDN_ALL_GATHER.name))
    for direction in ("F", "B"):
        for r in (0, 1):
            assert layer_program(toy, 0, direction, cp_rank=r) == \
                layer_program(ref, 0, direction, cp_rank=r)
    assert TOY_MODE in modes_of("gdn")
    profile = h200_profile()
    row = predict_mode(ref, "gdn", TOY_MODE, 4, 4096, profile)
    assert row.refused is None and row.ms == \
        predict_mode(ref, "gdn", GDN_ALL_GATHER.name, 4, 4096, profile).ms


def _toy_pp_config(kind: str) -> dict[str, Any]:
    cfg = tiny_config(2, seq_len=32, cp=1, pp=2, dp_shard=1, world_size=2)
    cfg["data"]["batch_size"] = 2
    cfg["train"]["pipeline"] = {"schedule": kind, "microbatches": 2}
    return cfg


def test_a_registered_schedule_kind_trains_and_simulates(toys: None) -> None:
    config = config_from_dict(_toy_pp_config(TOY_KIND))
    assert config.train.pipeline.schedule == TOY_KIND
    out = run_ranks(_worker, 2, timeout_s=300, args=(_toy_pp_config(TOY_KIND),))[0]
    run = TrainResult.from_dict(out["result"])
    diff = compare_runs(run, train_single(config))
    assert diff["max_rel_dloss"] <= REL_TOL and diff["max_rel_dgrad_norm"] <= REL_TOL, diff
    toy = predict_at_scale(config, h200_profile())
    gpipe = predict_at_scale(config_from_dict(_toy_pp_config("gpipe")), h200_profile())
    assert toy.step_s == gpipe.step_s
    assert [r.bubble for r in toy.ranks] == [r.bubble for r in gpipe.ranks]


def test_the_registry_agrees_with_the_built_in_strategies() -> None:
    """The built-in GDN entries state what their mixers do (the state link's least Triton
    segments), so the configuration refuses what ``apply`` would."""
    from overlap_runtime.context_parallel.gdn.style import _BUILTIN_MIXERS

    for name, mixer in _BUILTIN_MIXERS.items():
        assert get_cp_mode("linear_attention", name).triton_min_segments == \
            mixer.triton_min_segments, name
