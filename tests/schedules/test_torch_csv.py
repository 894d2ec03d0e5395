"""to_torch_csv / load_torch_csv / compile_table and the CLI's --csv-format torch (pure, cheap)."""

from __future__ import annotations

import inspect
import io

import pytest
from tests.support.schedules import dummy_stages, torch_pipelining

from overlap_runtime.cli import main
from overlap_runtime.schedules import (ScheduleSpec, build_schedule, compile_spec, compile_table,
                                       dump_csv, load_torch_csv, to_torch_csv)

SPEC = ScheduleSpec(kind="interleaved_1f1b", pp_size=2, num_microbatches=4, virtual_stages=2,
                    overlap_b_f=True)


def test_overlap_b_f_pairs_are_written_in_the_form_torch_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ts = torch_pipelining()
    compute = build_schedule(SPEC)
    ours, theirs = tmp_path / "ours.csv", tmp_path / "torch.csv"
    dump_csv(compute, ours)
    text = to_torch_csv(compute, theirs)
    assert "OVERLAP_B_F" in ours.read_text() and "OVERLAP_B_F" not in text
    assert "(0F3;2B0)OVERLAP_F_B" in text  # was (2B0;0F3)OVERLAP_B_F
    runtime = ts._PipelineScheduleRuntime(dummy_stages(2, 2), 4)
    with pytest.raises(RuntimeError, match="Invalid computation type OVERLAP_B_F"):
        runtime._load_csv(str(ours))
    runtime._load_csv(str(theirs))  # torch validates and lowers it
    # same actions, same order per rank, only the pairs' kind and side order differ
    for r, acts in compute.items():
        loaded = [a for a in runtime.pipeline_order[r]]
        assert len(loaded) == len(acts)
        for a, t in zip(acts, loaded):
            subs = sorted(map(str, a.leaves())) if a is not None else None
            got = sorted(map(str, t.sub_actions or (t,))) if t is not None else None
            assert subs == got
    # and back: our loader reads the torch form, the table compiles with the spec's bubble
    table = compile_table(load_torch_csv(theirs))
    assert table.spec.placement == "loop" and table.spec.overlap_b_f
    assert table.simulate().bubble_ratio == pytest.approx(compile_spec(SPEC).simulate().bubble_ratio)


def test_fsdp_cells_are_skipped_by_rule_or_refused() -> None:
    text = "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n" \
           "1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD,1RESHARD\n"
    table = load_torch_csv(io.StringIO(text))
    assert [str(a) for a in table[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]
    assert compile_table(table).spec.num_microbatches == 1
    with pytest.raises(ValueError, match=r"rank 0 step 0: '0UNSHARD' is an FSDP action"):
        load_torch_csv(io.StringIO(text), fsdp="error")
    with pytest.raises(ValueError, match="fsdp='keep'"):
        load_torch_csv(io.StringIO(text), fsdp="keep")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 1 step 2: invalid action '1X0'"):
        load_torch_csv(io.StringIO("0F0\n1F0,1B0,1X0\n"))


def test_cli_csv_format_torch(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "s.csv"
    rc = main(["schedule", "--kind", "interleaved_1f1b", "--pp", "2", "--microbatches", "4",
               "--virtual", "2", "--overlap-b-f", "--trace", "", "--no-grid",
               "--csv", str(path), "--csv-format", "torch"])
    assert rc == 0 and "(0F3;2B0)OVERLAP_F_B" in path.read_text()
    assert "OVERLAP_B_F" not in path.read_text()
    capsys.readouterr()


def test_torch_names_and_one_overlap_p2p_default_everywhere() -> None:
    from overlap_runtime.pipeline import (PipelineSchedule, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
    from overlap_runtime.schedules.compile import compile_schedule
    from overlap_runtime.config.train import PipelineConfig

    assert ScheduleSpec(kind="1f1b", pp_size=2, n_microbatches=3).num_microbatches == 3
    defaults = {ScheduleSpec.model_fields["overlap_p2p"].default,
                inspect.signature(compile_schedule).parameters["overlap_p2p"].default,
                inspect.signature(compile_table).parameters["overlap_p2p"].default,
                PipelineConfig.model_fields["overlap_p2p"].default}
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B):
        params = inspect.signature(cls.__init__).parameters
        defaults.add(params["overlap_p2p"].default)
        assert "n_microbatches" in params
    assert defaults == {True}
    step = inspect.signature(PipelineSchedule.step).parameters
    assert {"target", "losses", "return_outputs", "loss_kwargs", "kwargs"} <= set(step)
