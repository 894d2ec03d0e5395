"""``schedules.overlap_order.comm_turns``: the HookCoordinator's launch order as data.

The runtime's own order is compared with this function in tests/coordinator (test_deadlock.py:
drain and back-to-back runs; test_overlap_dist.py: the launch log of real all-to-alls), and the
step graph chains an OVERLAP_B_F step's all-to-alls with it (stepgraph.overlap_edges, used by
stepgraph.expand for every step graph); here the function meets the order written out by hand.
"""

from __future__ import annotations

import pytest

from overlap_runtime.schedules.overlap_order import comm_turns


def test_two_layer_pair_alternates_backward_first() -> None:
    # a 2-layer backward chunk (combine then dispatch, last layer first) with a 2-layer forward
    # chunk (dispatch then combine): docs/coordinator.md's launch order
    bwd = [("combine", 1), ("dispatch", 1), ("combine", 0), ("dispatch", 0)]
    fwd = [("dispatch", 0), ("combine", 0), ("dispatch", 1), ("combine", 1)]
    got = [(side, *(bwd if side == "backward" else fwd)[k]) for side, k in comm_turns(4, 4)]
    assert got == [
        ("backward", "combine", 1), ("forward", "dispatch", 0), ("backward", "dispatch", 1),
        ("forward", "combine", 0), ("backward", "combine", 0), ("forward", "dispatch", 1),
        ("backward", "dispatch", 0), ("forward", "combine", 1)]


@pytest.mark.parametrize("n_bwd,n_fwd,want", [
    (3, 1, ["b0", "f0", "b1", "b2"]),           # the forward departs, the backward drains
    (1, 3, ["b0", "f0", "f1", "f2"]),
    (0, 2, ["f0", "f1"]),
    (2, 0, ["b0", "b1"]),
    (0, 0, []),
])
def test_a_departed_side_leaves_the_other_to_drain(n_bwd: int, n_fwd: int,
                                                   want: list[str]) -> None:
    assert [f"{side[0]}{k}" for side, k in comm_turns(n_bwd, n_fwd)] == want


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"comm_turns: region counts must be >= 0, got "
                                         r"backward=-1, forward=2"):
        comm_turns(-1, 2)
