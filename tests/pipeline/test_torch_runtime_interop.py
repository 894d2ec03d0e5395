"""Our schedules and our overlap inside torch.distributed.pipelining's runtime (issue #27).

Real gloo ranks and real torch ``PipelineStage``s: our CSV (OVERLAP_B_F written as torch's
OVERLAP_F_B) loads into ``_PipelineScheduleRuntime`` and matches a single process; our
OVERLAP_F_B callback (HookCoordinator through ``CommComputeOverlap``) runs PP2 x EP2 inside
torch's runtime with the gradients of torch's own sequential pair; the version-checked shim
fails with a message naming what moved.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from tests.support.torch_jobs import (csv_in_torch_runtime, pp2_ep2_overlap_f_b, reference_grads,
                         torch_dump_in_our_runtime, torch_style_reference, torch_style_step)
from overlap_runtime.pipeline import torch_interop
from overlap_runtime.pipeline.torch_interop import (PINNED, TESTED_TORCH, TorchInteropError,
                                                    make_torch_overlap_f_b_callback,
                                                    torch_pipelining_api)
from overlap_runtime.launch import RankFailedError
from overlap_runtime.testing import rel_l2, run_ranks

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("world, spec_kw", [
    (2, dict(kind="interleaved_1f1b", pp_size=2, num_microbatches=4, virtual_stages=2,
             overlap_b_f=True)),
    (4, dict(kind="1f1b", pp_size=4, num_microbatches=4, overlap_b_f=True)),
])
def test_our_overlap_b_f_csv_runs_in_torchs_runtime_like_one_process(
        tmp_path, world: int, spec_kw: dict) -> None:  # type: ignore[no-untyped-def]
    reports = run_ranks(csv_in_torch_runtime, world, timeout_s=90, args=(spec_kw, str(tmp_path)))
    num_stages = spec_kw["pp_size"] * spec_kw.get("virtual_stages", 1)
    ref, ref_loss = reference_grads(num_stages, spec_kw["num_microbatches"])
    assert sum(r["overlapped_steps"] for r in reports) > 0  # the pairs reached torch as pairs
    got = {k: v for r in reports for k, v in r["grads"].items()}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert rel_l2(got[k], ref[k]) <= 1e-5, k
    (loss,) = [r["loss"] for r in reports if r["loss"] is not None]
    assert loss == pytest.approx(ref_loss, rel=1e-5)


def test_pp2_ep2_our_overlap_callback_in_torchs_runtime_equals_torchs_sequential_pair(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    reports = run_ranks(pp2_ep2_overlap_f_b, 4, timeout_s=120, args=(str(tmp_path),))
    for r in reports:
        assert "error" not in r, r
        assert r["calls"], r["rank"]  # torch called our callback for its OVERLAP_F_B steps
        assert all(c.endswith("OVERLAP_F_B") for c in r["calls"])
        assert r["coordinated_a2a"] > 0  # the all-to-alls went through our coordinator
        assert len(r["errs"]) == r["n_params"] > 0
        assert max(r["errs"].values()) <= 1e-6, r["errs"]
        seq, ovl = r["loss"]
        if seq is not None:
            assert ovl == pytest.approx(seq, rel=1e-6)


def test_a_failing_side_leaves_the_step_naming_the_action_and_side(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stage 1's forward raises on one rank inside our callback: the step fails there with the
    original error and a note naming the sub-action, the side and torch's compound action (the
    harness then stops the other ranks)."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(pp2_ep2_overlap_f_b, 4, timeout_s=120, args=(str(tmp_path), "forward"))
    msg = str(info.value)
    assert "rank 2 of 4 raised RuntimeError" in msg and "[Stage 1] failed to run forward" in msg
    assert "ValueError: injected failure in stage 1's forward" in msg, msg  # the cause
    assert re.search(r"in 1F\d \(forward side, thread '[^']+'\) of torch's \(1F\d;\dB\d\)"
                     r"OVERLAP_F_B", msg), msg


def test_shim_names_the_missing_attribute_and_the_tested_torch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    api = torch_pipelining_api()
    assert TESTED_TORCH and all(PINNED.values())
    import torch.distributed.pipelining.schedules as ts

    monkeypatch.delattr(ts, "_PipelineContext")
    with pytest.raises(TorchInteropError, match=r"has no attribute '_PipelineContext'.*written "
                       rf"for torch {re.escape(TESTED_TORCH[0])}"):
        make_torch_overlap_f_b_callback(SimpleNamespace(run=None))
    monkeypatch.undo()

    # an instance whose members moved: refused at the first call, naming the member
    class Moved(ts._PipelineScheduleRuntime):
        def __init__(self) -> None:  # no torch state at all: bwd_recv_ops & co. are missing
            pass

    cb = make_torch_overlap_f_b_callback(SimpleNamespace(run=None), api=api)
    action = ts._Action.from_str("(0F1;0B0)OVERLAP_F_B")
    with pytest.raises(TorchInteropError, match=rf"torch {re.escape(torch.__version__)}: "
                       r"Moved.*has no attribute '_stages'"):
        cb(action, SimpleNamespace(schedule_ref=Moved()))
    with pytest.raises(TorchInteropError, match="needs a _PipelineScheduleRuntime"):
        cb(action, SimpleNamespace(schedule_ref=object()))
    assert torch_interop.__name__.endswith("torch_interop")


def test_torchs_dualpipev_dump_with_fsdp_actions_runs_in_our_runtime(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch's ScheduleDualPipeV, dumped by torch (UNSHARD/RESHARD/REDUCE_GRAD, OVERLAP_F_B,
    I/W, V placement), loads, validates, simulates and executes in our runtime."""
    import torch.distributed.pipelining.schedules as ts

    from overlap_runtime.schedules import compile_table, load_torch_csv

    fake = [SimpleNamespace(group_size=2, group_rank=0, num_stages=4, stage_index=s,
                            submod=torch.nn.Linear(1, 1)) for s in (0, 3)]
    path = tmp_path / "dualpipev.csv"
    ts.ScheduleDualPipeV(fake, 4)._dump_csv(str(path))
    text = path.read_text()
    assert "UNSHARD" in text and "REDUCE_GRAD" in text and "OVERLAP_F_B" in text
    compiled = compile_table(load_torch_csv(path))  # rules + deadlock proof
    assert compiled.spec.placement == "v" and compiled.spec.num_microbatches == 4
    assert 0.0 < compiled.simulate().bubble_ratio < 1.0
    reports = run_ranks(torch_dump_in_our_runtime, 2, timeout_s=60, args=(str(path),))
    ref, ref_loss = reference_grads(4, 4)
    got = {k: v for r in reports for k, v in r["grads"].items()}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert rel_l2(got[k], ref[k]) <= 1e-5, k
    assert reports[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)  # stages 0 and 3 on rank 0
    assert {"OVERLAP_F_B", "I", "W", "B"} <= set(reports[0]["kinds"])


def test_torch_style_step_n_microbatches_kwargs_loss_kwargs_and_action_ranges() -> None:
    reports = run_ranks(torch_style_step, 2, timeout_s=60)
    ref, ref_losses = torch_style_reference()
    r0, r1 = reports
    assert r0["num_microbatches"] == r1["num_microbatches"] == 4
    got = {**{f"S0.{n}": g for n, g in r0["grads"].items()},
           **{f"S1.{n}": g for n, g in r1["grads"].items()}}
    for k in ref:
        assert rel_l2(got[k], ref[k]) <= 1e-5, k
    assert r1["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert r1["out_shape"] == (8, 8) and r1["out_false"] is None and r0["out_shape"] is None
    # profiler ranges named after each action, as torch prints it
    assert {"pp.0F0", "pp.0B3", "pp.0SEND_F0", "pp.wait 0RECV_B0"} <= set(r0["ranges"]), r0
    assert {"pp.1F0", "pp.1RECV_F0", "pp.1SEND_B3"} <= set(r1["ranges"]), r1
