"""Action text form, CSV files, and agreement with torch.distributed.pipelining's format."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_runtime.schedules import (
    Action,
    ActionKind,
    ScheduleSpec,
    build_schedule,
    dump_csv,
    load_csv,
    lower,
    parse_action,
)

from tests.support.schedules import torch_pipelining

K = ActionKind


@pytest.mark.parametrize(
    "text, action",
    [
        ("2F0", Action(2, K.F, 0)),
        ("1B3", Action(1, K.B, 3)),
        ("0I12", Action(0, K.I, 12)),
        ("0W12", Action(0, K.W, 12)),
        ("0SEND_F1", Action(0, K.SEND_F, 1)),
        ("1RECV_F1", Action(1, K.RECV_F, 1)),
        ("3SEND_B7", Action(3, K.SEND_B, 7)),
        ("2RECV_B7", Action(2, K.RECV_B, 7)),
        ("(1B3;0F4)OVERLAP_B_F",
         Action.compound(K.OVERLAP_B_F, Action(1, K.B, 3), Action(0, K.F, 4))),
        ("(0F7;7B3)OVERLAP_F_B",
         Action.compound(K.OVERLAP_F_B, Action(0, K.F, 7), Action(7, K.B, 3))),
    ],
)
def test_text_round_trip(text: str, action: Action) -> None:
    assert str(action) == text
    assert repr(action) == text
    assert parse_action(text) == action
    assert parse_action(f"  {text} ") == action


@pytest.mark.parametrize("text", ["2F0", "1B3", "0SEND_F1", "1RECV_B0", "4I2", "4W2",
                                  "(0F7;7B3)OVERLAP_F_B"])
def test_text_equals_torch(text: str) -> None:
    ts = torch_pipelining()
    torch_action = ts._Action.from_str(text)
    assert str(torch_action) == text == str(parse_action(text))
    if torch_action.sub_actions is None:
        ours = parse_action(text)
        assert (ours.stage, ours.kind.value, ours.microbatch) == (
            torch_action.stage_index, torch_action.computation_type.value,
            torch_action.microbatch_index)


def test_compound_has_no_stage_of_its_own() -> None:
    a = parse_action("(1B3;0F4)OVERLAP_B_F")
    assert a.stage == -1 and a.microbatch is None and a.is_compound
    assert a.leaves() == (Action(1, K.B, 3), Action(0, K.F, 4))
    assert Action(1, K.F, 0).leaves() == (Action(1, K.F, 0),)


@pytest.mark.parametrize("text, needle", [
    ("F0", "invalid action 'F0'"),
    ("2X0", "invalid action '2X0'"),
    ("2F", "needs a microbatch"),
    ("(1B3;(0F4)OVERLAP_B_F)OVERLAP_B_F", "invalid"),
    ("(1SEND_F3;0F4)OVERLAP_B_F", "must be a compute action"),
])
def test_bad_text_is_rejected(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_action(text)
    assert needle in str(info.value)


def test_blank_is_a_bubble() -> None:
    assert parse_action("") is None
    assert parse_action("   ") is None


def test_constructor_checks_fields() -> None:
    with pytest.raises(ValueError, match="stage=-1 and microbatch=None"):
        Action(2, K.OVERLAP_B_F, 1, (Action(1, K.B, 0), Action(0, K.F, 1)))
    with pytest.raises(ValueError, match="only OVERLAP_B_F / OVERLAP_F_B take sub-actions"):
        Action(1, K.F, 0, (Action(1, K.B, 0),))
    with pytest.raises(ValueError, match="microbatch must be an int >= 0"):
        Action(1, K.F, None)
    with pytest.raises(ValueError, match="stage must be an int >= 0"):
        Action(-3, K.B, 0)


simple_kinds = st.sampled_from([K.F, K.B, K.I, K.W, K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B])
simple = st.builds(lambda s, k, m: Action(s, k, m), st.integers(0, 999), simple_kinds,
                   st.integers(0, 9999))
compute = st.builds(lambda s, k, m: Action(s, k, m), st.integers(0, 99),
                    st.sampled_from([K.F, K.B, K.I, K.W]), st.integers(0, 999))
compound = st.builds(lambda k, a, b: Action.compound(k, a, b),
                     st.sampled_from([K.OVERLAP_B_F, K.OVERLAP_F_B]), compute, compute)


@settings(max_examples=200, deadline=None)
@given(st.one_of(simple, compound))
def test_text_round_trip_property(action: Action) -> None:
    assert parse_action(str(action)) == action


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.integers(0, 5), st.lists(st.one_of(st.none(), simple, compound),
                                                   max_size=12), min_size=1))
def test_csv_round_trip_property(schedule) -> None:  # type: ignore[no-untyped-def]
    schedule = {r: schedule[k] for r, k in enumerate(sorted(schedule))}
    text = dump_csv(schedule)
    back = load_csv(io.StringIO(text))
    # csv cannot tell a rank with no steps from a missing trailing bubble; compare cell by cell
    for r, acts in schedule.items():
        assert back[r] == acts


def test_csv_file_round_trip_and_torch_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = ScheduleSpec(kind="1f1b", pp_size=3, num_microbatches=4, overlap_b_f=True)
    compute = build_schedule(spec)
    compute[0].insert(1, None)  # a deliberate bubble survives as an empty cell
    path = tmp_path / "s.csv"
    dump_csv(compute, path)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("0F0,,0F1,")
    assert "(2B0;2F1)OVERLAP_B_F" in lines[2]
    assert load_csv(path) == compute
    lowered = lower(build_schedule(spec.model_copy(update={"overlap_b_f": False})))
    assert load_csv(io.StringIO(dump_csv(lowered))) == lowered


def test_torch_dumped_csv_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A CSV written by torch's own ``_dump_csv`` reads back into the same actions."""
    from tests.support.schedules import dummy_stages

    ts = torch_pipelining()
    sched = ts.ScheduleInterleaved1F1B(dummy_stages(2, 2), 4)
    path = tmp_path / "torch.csv"
    sched._dump_csv(str(path), format="compute_only")
    ours = load_csv(path)
    assert {r: [str(a) if a else "" for a in acts] for r, acts in ours.items()} == {
        r: [str(a) if a else "" for a in acts] for r, acts in sched.pipeline_order.items()}
