"""Compile cost grows linearly with pp, and absurd sizes are refused before any work (#28 item 9).

The growth check counts Python function calls (deterministic, unlike wall time): compiling
1F1B at m=8 twice as deep must cost about twice the calls. Before the fix ``stages_of_rank``
scanned every stage for every rank and ``lower`` looked at every rank in every round, both
quadratic in pp (ratio 2.9 from pp=200 to pp=400; 2.0 after).
"""

from __future__ import annotations

import cProfile
import pstats
import time

import pytest
from pydantic import ValidationError

from overlap_runtime.schedules import (
    MAX_SCHEDULE_ACTIONS,
    ScheduleSpec,
    ScheduleTooLargeError,
    compile_spec,
)
from overlap_runtime.schedules.kind import stages_of_rank


def _calls(spec: ScheduleSpec) -> int:
    prof = cProfile.Profile()
    prof.enable()
    try:
        compile_spec(spec)
    finally:
        prof.disable()
    return pstats.Stats(prof).total_calls  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("kind, v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_compile_calls_grow_linearly_with_pp(kind: str, v: int) -> None:
    def spec(pp: int) -> ScheduleSpec:
        return ScheduleSpec(kind=kind, pp_size=pp, num_microbatches=8, virtual_stages=v)

    c1, c2 = _calls(spec(100)), _calls(spec(200))
    assert c2 / c1 < 2.3, (kind, c1, c2)  # twice the actions; 2.85-2.9 when quadratic


@pytest.mark.parametrize("placement, kind, v", [("loop", "interleaved_1f1b", 3),
                                                ("v", "dualpipev", 2), ("loop", "1f1b", 1)])
def test_stages_of_rank_is_the_placement_inverted(placement: str, kind: str, v: int) -> None:
    pp = 5
    spec = ScheduleSpec(kind=kind, pp_size=pp, num_microbatches=10 if kind == "dualpipev" else 5,
                        virtual_stages=v, placement=placement)  # type: ignore[arg-type]
    for rank in range(pp):
        assert stages_of_rank(spec, rank) == [
            s for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank]
    with pytest.raises(ValueError, match="rank 5 is outside 0..4"):
        stages_of_rank(spec, pp)


@pytest.mark.parametrize("fields", [
    dict(pp_size=10**6, num_microbatches=1),
    dict(pp_size=10**4, num_microbatches=10**4),
    dict(pp_size=2, num_microbatches=10**18),
    dict(pp_size=1000, num_microbatches=400, split_backward=True),  # 1.2M with F, I, W
])
def test_absurd_sizes_are_refused_at_construction(fields: dict) -> None:
    t = time.perf_counter()
    with pytest.raises(ValidationError) as info:
        ScheduleSpec(kind="1f1b", **fields)
    assert time.perf_counter() - t < 1.0  # refused before any work
    (err,) = info.value.errors()
    assert isinstance(err["ctx"]["error"], ScheduleTooLargeError)
    text = str(info.value)
    assert "ScheduleTooLargeError" in text and "MAX_SCHEDULE_ACTIONS = 1,000,000" in text
    assert f"pp_size={fields['pp_size']}" in text


def test_the_limit_itself_is_allowed() -> None:
    spec = ScheduleSpec(kind="1f1b", pp_size=1000, num_microbatches=MAX_SCHEDULE_ACTIONS // 2000)
    assert spec.num_actions == MAX_SCHEDULE_ACTIONS
