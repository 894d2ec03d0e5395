"""Conformance sees every collective: one issued with ``torch.distributed`` inside a layer fails.

The step recorder taps the ``torch.distributed`` boundary while it records (``ops.step_record``),
so a collective that bypasses ``ops.comm`` is recorded as ``direct`` and rejected by
``stepgraph.conformance``. On real gloo ranks: an EP2 MoE layout trains one checked step as is
(passes), then again with an extra ``dist.all_reduce`` on the EP group planted in the MoE
dispatcher (every rank runs it, so the step completes; conformance must fail). Without the tap,
the planted run passes conformance.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.layouts import MOE, layout  # noqa: E402

from overlap_runtime.moe.layer import MoE  # noqa: E402
from overlap_runtime.ops import step_record  # noqa: E402
from overlap_runtime.stepgraph.compose import compile_step  # noqa: E402
from overlap_runtime.stepgraph.conformance import (ConformanceError,  # noqa: E402
                                                   check_conformance, ideal_records)
from overlap_runtime.testing import run_ranks  # noqa: E402
from overlap_runtime.trainer import config_from_dict, train_distributed  # noqa: E402
from overlap_runtime.trainer.errors import TrainStepError  # noqa: E402

EP2 = layout(2, model=MOE, ep=2, steps=1)


def _plant_all_reduce(pm: Any) -> None:
    """Every MoE dispatcher all-reduces a scalar on its EP group before each dispatch."""
    for module in pm.modules():
        for m in module.modules():
            if isinstance(m, MoE) and m.dispatcher.group is not None:
                d = m.dispatcher
                dispatch = d.dispatch

                def planted(*args: Any, _d: Any = d, _f: Any = dispatch, **kw: Any) -> Any:
                    dist.all_reduce(torch.zeros(1), group=_d.group)
                    return _f(*args, **kw)

                d.dispatch = planted


def _worker(rank: int, world: int) -> dict[str, str] | None:
    config = config_from_dict(EP2)
    out: dict[str, str] = {}
    train_distributed(config, torch.device("cpu"), log=lambda line: None)
    out["clean"] = "passed"
    try:
        train_distributed(config, torch.device("cpu"), log=lambda line: None,
                          on_model=_plant_all_reduce)
        out["planted"] = "passed"
    except TrainStepError as exc:  # the step's ConformanceError, with rank and step
        out["planted"] = str(exc)
    return out if rank == 0 else None


def test_a_collective_planted_outside_ops_comm_fails_conformance() -> None:
    out = run_ranks(_worker, 2, timeout_s=240)[0]
    assert out["clean"] == "passed"
    assert "ConformanceError" in out["planted"], out["planted"]
    assert "issued with torch.distributed directly" in out["planted"], out["planted"]
    assert "torch.distributed.all_reduce" in out["planted"], out["planted"]
    assert "outside ops.comm" in out["planted"], out["planted"]


def test_the_checker_rejects_a_direct_launch_even_where_the_graph_has_one() -> None:
    # a direct entry that copies a graph launch exactly (same task, group, bytes, label) is
    # still rejected: the graph's launch must come from ops.comm
    sg = compile_step(config_from_dict(EP2))
    rec = ideal_records(sg)
    check_conformance(sg, rec)
    bad = copy.deepcopy(rec)
    i = next(k for k, e in enumerate(bad[1]) if e["op"] == "collective")
    bad[1][i]["direct"] = True
    with pytest.raises(ConformanceError, match=r"rank 1, record #\d+: collective on .* issued "
                                               r"with torch.distributed directly"):
        check_conformance(sg, bad)


def test_the_tap_is_only_in_place_while_recording() -> None:
    original = dist.all_reduce
    with step_record.recording(step_record.StepRecorder()):
        assert dist.all_reduce is not original
        assert dist.distributed_c10d.all_reduce is dist.all_reduce
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
