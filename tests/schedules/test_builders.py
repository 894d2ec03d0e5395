"""Builders: exact orders, OVERLAP_B_F pairing, split backward, agreement with torch."""

from __future__ import annotations

import pytest
from tests.support.schedules import compact, dummy_stages, to_torch, torch_pipelining

from overlap_runtime.schedules import ActionKind, ScheduleSpec, build_schedule, parse_action

K = ActionKind


def texts(actions) -> list[str]:  # type: ignore[no-untyped-def]
    return [str(a) for a in actions if a is not None]


def test_1f1b_order_matches_the_docstring_diagram() -> None:
    s = build_schedule(ScheduleSpec(kind="1f1b", pp_size=4, num_microbatches=6))
    assert " ".join(texts(s[0])) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert " ".join(texts(s[3])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_gpipe_order() -> None:
    s = build_schedule(ScheduleSpec(kind="gpipe", pp_size=2, num_microbatches=3))
    assert texts(s[1]) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_overlap_b_f_pairs_steady_state_only() -> None:
    s = build_schedule(ScheduleSpec(kind="1f1b", pp_size=4, num_microbatches=6, overlap_b_f=True))
    # last rank: no warm-up; B_i pairs with F_{i+1}
    assert texts(s[3]) == ["3F0", "(3B0;3F1)OVERLAP_B_F", "(3B1;3F2)OVERLAP_B_F",
                           "(3B2;3F3)OVERLAP_B_F", "(3B3;3F4)OVERLAP_B_F",
                           "(3B4;3F5)OVERLAP_B_F", "3B5"]
    # first rank: 3 warm-up forwards and one more forward alone, cool-down backwards alone
    assert texts(s[0]) == ["0F0", "0F1", "0F2", "0F3", "(0B0;0F4)OVERLAP_B_F",
                           "(0B1;0F5)OVERLAP_B_F", "0B2", "0B3", "0B4", "0B5"]
    for rank, acts in s.items():
        for a in acts:
            if a.is_compound:
                b, f = a.sub_actions
                assert a.kind is K.OVERLAP_B_F and b.kind is K.B and f.kind is K.F


def test_overlap_b_f_interleaved_pairs_different_chunks() -> None:
    s = build_schedule(ScheduleSpec(kind="interleaved_1f1b", pp_size=4, num_microbatches=8,
                                    virtual_stages=2, overlap_b_f=True))
    pairs = [a for a in s[0] if a.is_compound]
    assert pairs, "rank 0 has a steady state"
    assert str(pairs[0]) == "(4B0;0F7)OVERLAP_B_F"  # backward of chunk 1, forward of chunk 0
    n_b = sum(1 for a in s[0] for x in a.leaves() if x.kind is K.B)
    n_f = sum(1 for a in s[0] for x in a.leaves() if x.kind is K.F)
    assert n_b == n_f == 16


def test_split_backward_replaces_b_by_i_then_w() -> None:
    s = build_schedule(ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=2,
                                    split_backward=True))
    assert texts(s[1]) == ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (4, 8, 2), (4, 4, 3), (4, 12, 2), (3, 5, 2),
                                      (4, 2, 2), (2, 6, 4)])
def test_interleaved_order_equals_torch(pp: int, m: int, v: int) -> None:
    ts = torch_pipelining()
    torch_order = ts.ScheduleInterleaved1F1B(dummy_stages(pp, v), m).pipeline_order
    ours = build_schedule(ScheduleSpec(kind="interleaved_1f1b", pp_size=pp, num_microbatches=m,
                                       virtual_stages=v))
    theirs = {r: [parse_action(str(a)) for a in acts if a is not None]
              for r, acts in torch_order.items()}
    assert compact(ours) == theirs


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 3)])
def test_1f1b_passes_torch_validation(pp: int, m: int) -> None:
    ts = torch_pipelining()
    ours = build_schedule(ScheduleSpec(kind="1f1b", pp_size=pp, num_microbatches=m))
    mapping = ts._validate_schedule(to_torch(ours), pp, pp, m)
    assert mapping == {s: s for s in range(pp)}
