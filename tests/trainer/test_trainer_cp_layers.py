"""Per-layer CP comm choice in the trainer (``config.cp``): validation at load, and a
4-layer model (attention every 2nd layer) whose two attention layers and two GDN layers each
run their own mode, trained 2 steps on cp2 against one device. The run records its first step
and checks it against the step graph (``train.check_conformance``): a layer that got another
mode than its list entry issues other messages and fails there. Hierarchical attention CP in
the trainer is the ``cp4_hierarchical`` layout of ``test_trainer_4d.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.trainer import tiny_config, train_worker

from overlap_runtime.context_parallel import LINEAR_ATTENTION_CP_MODES
from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import (ConfigError, TrainResult, compare_runs, config_from_dict,
                                     train_single)
from overlap_runtime.config.train import AcceleratorConfig
from overlap_runtime.config.cp import allowed_modes, layer_cp_modes

REL_TOL = 1e-5
PER_LAYER = {"full_attention_cp_modes": ["ring", "ulysses"],
             "linear_attention_cp_modes": ["p2p", "all_gather"]}


def _config(**acc: Any) -> dict[str, Any]:
    cfg = tiny_config(2, seq_len=64, model={"full_attention_interval": 2}, **{"cp": 2, **acc})
    cfg["train"]["check_conformance"] = True
    return cfg


def test_per_layer_modes_on_cp2_match_one_device() -> None:
    cfg = _config(**PER_LAYER)
    config = config_from_dict(cfg)
    assert layer_cp_modes(config.train.accelerator, config.model.layer_types) == \
        ["p2p", "ring", "all_gather", "ulysses"]
    run = TrainResult.from_dict(run_ranks(train_worker, 2, timeout_s=300, args=([cfg],))[0][0])
    assert "cp2:p2p,ring,all_gather,ulysses" in run.mode, run.mode
    diff = compare_runs(run, train_single(config))
    assert len(run.steps) == 2
    assert diff["max_rel_dloss"] <= REL_TOL and diff["max_rel_dgrad_norm"] <= REL_TOL, diff


def test_allowed_names_come_from_the_scalar_fields() -> None:
    # a mode added to a scalar field's Literal is accepted by its list with no other change
    assert set(allowed_modes(AcceleratorConfig, "linear_attention")) == \
        set(LINEAR_ATTENTION_CP_MODES)
    assert "hierarchical" in allowed_modes(AcceleratorConfig, "full_attention")


@pytest.mark.parametrize("acc, needle", [
    ({"full_attention_cp_modes": ["ring"]},
     "full_attention_cp_modes has 1 entries but model.layer_types has 2 full_attention layers "
     "(layers [1, 3])"),
    ({"linear_attention_cp_modes": ["p2p", "ring"]},
     "linear_attention_cp_modes[1]='ring' is not a linear_attention CP mode"),
    ({"full_attention_cp_mode": "ring", "full_attention_cp_modes": ["ring", "ring"]},
     "full_attention_cp_mode and train.accelerator.full_attention_cp_modes are both set"),
    ({"full_attention_cp_modes": ["ring", "hierarchical"]},
     "'hierarchical' needs train.accelerator.hierarchical_cp"),
    ({"full_attention_cp_mode": "hierarchical", "hierarchical_cp": {"a2a": 2, "ring": 2}},
     "hierarchical_cp.a2a=2 x train.accelerator.hierarchical_cp.ring=2 = 4 must equal the cp "
     "size 2"),
    ({"full_attention_cp_mode": "hierarchical", "hierarchical_cp": {"a2a": 1, "ring": 2}},
     "hierarchical_cp.a2a=1 must be an integer >= 2"),
    ({"hierarchical_cp": {"a2a": 2, "ring": 1}},
     "hierarchical_cp is set but no full_attention layer uses"),
    ({"full_attention_cp_modes": ["ulysses", "all_gather_kv"], "cp": 8, "world_size": 8},
     "full_attention_cp_mode='ulysses' with cp=8 needs model.num_attention_heads % cp == 0"),
])
def test_per_layer_and_hierarchical_errors_name_the_field(acc: dict[str, Any],
                                                          needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_config(**acc))
    assert needle in str(info.value), str(info.value)


def test_example_config_loads_with_its_per_layer_modes() -> None:
    from pathlib import Path

    from overlap_runtime.stepgraph.compose import compile_step
    from overlap_runtime.config.train import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "tiny_cp4_hierarchical.yaml")
    acc = cfg.train.accelerator
    assert layer_cp_modes(acc, cfg.model.layer_types) == \
        ["p2p", "hierarchical", "all_gather", "ring"] * 2
    assert (acc.hierarchical_cp.a2a, acc.hierarchical_cp.ring, acc.cp) == (2, 2, 4)
    compile_step(cfg)  # the step graph of the per-layer and hierarchical modes validates
