"""The launch order of the all-to-alls of one OVERLAP_B_F step: the HookCoordinator's turns.

An OVERLAP_B_F step runs a forward chunk and a backward chunk on two threads. Each chunk brackets
its expert all-to-alls in *comm regions* (forward: dispatch A->B, combine C->D; backward:
combine D->C, dispatch B->A), and the ``coordinator.HookCoordinator`` lets one region run at a
time, by this rule:

* the backward side holds the comm token first (the backward chunk opens with its combine
  backward, the forward chunk with compute);
* the turns alternate: the k-th region of one side starts after the previous region of the
  other side ended (``backward 0, forward 0, backward 1, forward 1 ...``);
* a side that runs out of regions departs, and the other drains its remaining regions alone.

:func:`comm_turns` is that order as a pure function of the two region counts. The coordinator
enacts it with a state machine; its tests compare the runtime's launch log with this function,
and the step graph (``stepgraph``) chains the all-to-alls of a compound step in this order.
"""

from __future__ import annotations

from typing import Literal

OverlapSide = Literal["backward", "forward"]
BACKWARD: OverlapSide = "backward"
FORWARD: OverlapSide = "forward"


def comm_turns(backward_regions: int, forward_regions: int) -> list[tuple[OverlapSide, int]]:
    """The comm regions of one OVERLAP_B_F step in launch order, as ``(side, k)``: region k of
    ``side`` (counted from 0 in that side's own program order).

    >>> comm_turns(2, 3)
    [('backward', 0), ('forward', 0), ('backward', 1), ('forward', 1), ('forward', 2)]
    """
    if backward_regions < 0 or forward_regions < 0:
        raise ValueError(f"comm_turns: region counts must be >= 0, got backward="
                         f"{backward_regions}, forward={forward_regions}")
    out: list[tuple[OverlapSide, int]] = []
    for k in range(max(backward_regions, forward_regions)):
        if k < backward_regions:
            out.append((BACKWARD, k))
        if k < forward_regions:
            out.append((FORWARD, k))
    return out
