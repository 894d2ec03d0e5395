"""Property tests over random specs: every built schedule lowers, validates, simulates, round-trips;
with equal costs the simulated bubble equals the analytic formula."""

from __future__ import annotations

import io
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from overlap_runtime.graph import CostModel
from overlap_runtime.schedules import (
    ScheduleSpec,
    compile_spec,
    dump_csv,
    load_csv,
    parse_action,
    validate_schedule,
)

EQUAL = CostModel(F=1.0, B=1.0, I=0.5, W=0.5)


def analytic_steps(p: int, m: int, v: int) -> int:
    """Makespan in units of one chunk's (tf + tb), derived in docs/schedules.md:
    v*max(m, p) + min(m, p) - 1, i.e. v*m + p - 1 when m >= p."""
    return v * max(m, p) + min(m, p) - 1


def analytic_bubble(p: int, m: int, v: int) -> float:
    """1 - v*m / steps: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al.
    2021), (p-1)/(v*m+p-1) for interleaved 1F1B with m >= p (Narayanan et al. 2021)."""
    return float(1 - Fraction(v * m, analytic_steps(p, m, v)))


specs = st.builds(
    dict,
    kind=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
    pp_size=st.integers(1, 6),
    num_microbatches=st.integers(1, 12),
    virtual_stages=st.integers(1, 3),
    overlap_b_f=st.booleans(),
    overlap_p2p=st.booleans(),
    split_backward=st.booleans(),
)


def make(fields: dict) -> ScheduleSpec:
    if fields["kind"] != "interleaved_1f1b":
        fields = {**fields, "virtual_stages": 1}
    if fields["kind"] == "gpipe":
        fields = {**fields, "overlap_b_f": False}
    if fields["overlap_b_f"]:
        fields = {**fields, "split_backward": False}
    try:
        return ScheduleSpec(**fields)
    except ValidationError:
        assume(False)
        raise


@settings(max_examples=120, deadline=None)
@given(specs)
def test_every_built_schedule_validates_and_simulates(fields: dict) -> None:
    spec = make(fields)
    compiled = compile_spec(spec)  # build, lower, pipeline checks, graph checks (deadlock)
    p, m, v = spec.pp_size, spec.num_microbatches, spec.virtual_stages
    # the full pipeline check (with its own deadlock proof) agrees
    validate_schedule(compiled.lowered, num_microbatches=m, num_stages=p * v)

    result = compiled.simulate(EQUAL)
    per_rank = v * m * (EQUAL.F + EQUAL.B)
    assert result.busy_by_rank == pytest.approx({r: per_rank for r in range(p)})
    assert result.makespan >= per_rank
    assert 0.0 <= result.bubble_ratio < 1.0
    assert result.exposed_comm == 0.0  # free communication is never exposed
    if not spec.overlap_b_f and not spec.split_backward:
        assert result.bubble_ratio == pytest.approx(analytic_bubble(p, m, v), abs=1e-12)
        assert result.makespan == pytest.approx(2 * analytic_steps(p, m, v))

    # text and CSV round trips of both forms
    for schedule in (compiled.compute, compiled.lowered):
        assert load_csv(io.StringIO(dump_csv(schedule))) == schedule
        for acts in schedule.values():
            for a in acts:
                assert parse_action(str(a)) == a

    # communication latency only ever makes the step longer, and is accounted as exposed or hidden
    slow = compiled.simulate(CostModel(F=1.0, B=1.0, I=0.5, W=0.5, comm_latency=0.25))
    assert slow.makespan >= result.makespan
    if p > 1:
        assert slow.exposed_comm > 0.0


@pytest.mark.parametrize(
    "kind, p, m, v",
    [("gpipe", 4, 8, 1), ("gpipe", 8, 3, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 32, 1),
     ("1f1b", 4, 2, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 16, 4),
     ("interleaved_1f1b", 8, 16, 2), ("interleaved_1f1b", 4, 3, 2),
     ("interleaved_1f1b", 4, 10, 2), ("interleaved_1f1b", 8, 2, 3)],
)
def test_bubble_equals_formula(kind: str, p: int, m: int, v: int) -> None:
    if m >= p:
        assert analytic_bubble(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    spec = ScheduleSpec(kind=kind, pp_size=p, num_microbatches=m, virtual_stages=v)
    result = compile_spec(spec).simulate(CostModel(F=1.0, B=1.0))
    assert result.bubble_ratio == pytest.approx(analytic_bubble(p, m, v), abs=1e-12)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (1.0, 3.0)])
def test_gpipe_1f1b_formula_holds_for_any_f_b_ratio(kind: str, tf: float, tb: float) -> None:
    p, m = 4, 8
    result = compile_spec(ScheduleSpec(kind=kind, pp_size=p, num_microbatches=m)).simulate(
        CostModel(F=tf, B=tb))
    assert result.makespan == pytest.approx((m + p - 1) * (tf + tb))
    assert result.bubble_ratio == pytest.approx(analytic_bubble(p, m, 1))


def test_interleaving_reduces_the_bubble_by_v() -> None:
    p, m = 4, 8
    bubble_time = {}
    for v in (1, 2, 4):
        kind = "1f1b" if v == 1 else "interleaved_1f1b"
        spec = ScheduleSpec(kind=kind, pp_size=p, num_microbatches=m, virtual_stages=v)
        # costs per chunk shrink with v so that a microbatch costs the same model time
        r = compile_spec(spec).simulate(CostModel(F=1.0 / v, B=1.0 / v))
        bubble_time[v] = r.makespan - 2 * m
    assert bubble_time[1] == pytest.approx(2 * (p - 1))
    assert bubble_time[2] == pytest.approx(bubble_time[1] / 2)
    assert bubble_time[4] == pytest.approx(bubble_time[1] / 4)
