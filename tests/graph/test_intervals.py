"""Interval arithmetic against a brute-force measure on an integer grid.

With integer endpoints in ``[0, GRID)`` a set of half-open intervals is exactly the set of grid
cells ``[t, t + 1)`` it covers, so every measure is a count of cells.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_runtime.graph.intervals import (
    measure,
    measure_minus,
    minus,
    overlap,
    total_length,
    union,
)

GRID = 40


def cells(intervals: list[tuple[int, int]]) -> set[int]:
    return {t for a, b in intervals for t in range(a, b)}


def is_union(u: list[tuple[int, int]]) -> bool:
    return all(a < b for a, b in u) and all(u[i][1] < u[i + 1][0] for i in range(len(u) - 1))


@st.composite
def interval(draw: st.DrawFn) -> tuple[int, int]:
    a = draw(st.integers(0, GRID))
    return a, draw(st.integers(a, GRID))  # empty ones included


intervals = st.lists(interval(), max_size=12)


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_union_covers_the_same_cells_as_a_union(iv: list[tuple[int, int]]) -> None:
    u = union(iv)
    assert is_union(u), u
    assert cells(u) == cells(iv)
    assert total_length(u) == measure(iv) == len(cells(iv))


@settings(max_examples=300, deadline=None)
@given(intervals, intervals)
def test_minus_is_set_difference(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> None:
    ua, ub = union(a), union(b)
    d = minus(ua, ub)
    assert is_union(d), d
    assert cells(d) == cells(a) - cells(b)
    assert measure_minus(ua, ub) == len(cells(a) - cells(b))


@settings(max_examples=300, deadline=None)
@given(interval(), intervals)
def test_overlap_counts_shared_cells(win: tuple[int, int], iv: list[tuple[int, int]]) -> None:
    s, e = win
    assert overlap(s, e, union(iv)) == len(set(range(s, e)) & cells(iv))


def test_floats_keep_their_type() -> None:
    u = union([(0.5, 1.5), (1.0, 2.0), (3.0, 3.25)])
    assert u == [(0.5, 2.0), (3.0, 3.25)]
    assert total_length(u) == pytest.approx(1.75)
    assert measure_minus(u, [(1.0, 3.125)]) == pytest.approx(0.5 + 0.125)
    assert overlap(1.75, 3.1, u) == pytest.approx(0.25 + 0.1)
    assert overlap(2.0, 1.0, u) == 0
    assert total_length([]) == 0 and union([]) == [] and minus([], u) == []


def test_touching_intervals_merge_and_empty_ones_vanish() -> None:
    assert union([(3, 5), (0, 3), (7, 7)]) == [(0, 5)]


def test_bad_inputs_name_the_interval_and_the_rule() -> None:
    with pytest.raises(ValueError, match=r"\(5, 2\) ends before it starts"):
        union([(0, 1), (5, 2)])
    with pytest.raises(ValueError, match=r"overlap: interval \(1, 4\) starts at or before"):
        overlap(0, 10, [(2, 6), (1, 4)])  # not sorted: not a union
    with pytest.raises(ValueError, match=r"minus \(b\): interval \(3, 3\) is empty"):
        minus([(0, 5)], [(3, 3)])
