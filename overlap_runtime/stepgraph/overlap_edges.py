"""The HookCoordinator's protocol as edges of one OVERLAP_B_F step of the step graph.

An OVERLAP_B_F step runs a forward and a backward side on two threads
(``coordinator/coordinator.py``). Their *comm regions* are the expert all-to-alls (group
``ep``): a forward dispatch's counts and tokens are one region (hooks A -> B), every other
all-to-all one region of its own (the combine: C -> D, its wait included). The regions launch
in the coordinator's turns, written once as data in ``schedules.overlap_order.comm_turns``
(backward first, alternating, the longer side draining alone):

* **token** (always): the all-to-alls of both sides are chained in that launch order, one in
  flight per EP group (the chain's edges, and its order in the task list for the validator);
* **COMPUTE-hook waits** (``hook_waits``): the op that follows a region on its side (the op
  after its last all-to-all, or the op it joins: ``moe.combine_wait``, where hook D sits) waits
  until the peer side launched its next region, i.e. finished the op before it, so each
  all-to-all hides behind the peer's compute rather than both sides computing at once. None
  after the forward side's last region (hook D_LAST only hands over), after a recompute
  replay's region (replays never wait), or once the peer has no region left (it departed).

The waits order compute ops, which the step recorder does not see (only launches), so the
conformance graph leaves them out; the simulator's graphs (``scale``, ``predict``) keep them.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from overlap_runtime.schedules.overlap_order import BACKWARD, comm_turns

from .layer_program import LayerOp

Side = Sequence[tuple[Hashable, LayerOp]]


def comm_regions(ops: Sequence[LayerOp]) -> list[list[int]]:
    """The comm regions of one side as lists of op indices, in program order (module doc)."""
    out: list[list[int]] = []
    for i, op in enumerate(ops):
        if op.group != "ep":
            continue
        if op.name == "moe.dispatch" and out and ops[out[-1][-1]].name == "moe.dispatch_counts":
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _replay(op: LayerOp) -> bool:
    return op.name.startswith("recompute.")


def overlap_edges(fwd: Side, bwd: Side, *, hook_waits: bool
                  ) -> tuple[list[Hashable], list[tuple[Hashable, Hashable]]]:
    """``(launch order, COMPUTE-hook wait edges)`` of one OVERLAP_B_F step whose sides are
    ``fwd`` / ``bwd``: their ``(task id, op)`` chains in program order (module doc). The
    launch order lists the ids of every all-to-all of both sides; the waits are empty
    unless ``hook_waits``."""
    sides = {"fwd": fwd, "bwd": bwd}
    ops = {s: [op for _, op in chain] for s, chain in sides.items()}
    regions = {s: comm_regions(ops[s]) for s in sides}
    order = [("bwd" if side == BACKWARD else "fwd", k)
             for side, k in comm_turns(len(regions["bwd"]), len(regions["fwd"]))]
    launch = [sides[s][i][0] for s, k in order for i in regions[s][k]]
    waits: list[tuple[Hashable, Hashable]] = []
    if not hook_waits:
        return launch, waits
    for n, (s, k) in enumerate(order):
        mine, region = ops[s], regions[s][k]
        if _replay(mine[region[0]]) or (s == "fwd" and k == len(regions[s]) - 1):
            continue
        end = region[-1]
        join = mine[end].join
        after = next((j for j in range(end + 1, len(mine)) if mine[j].name == join),
                     len(mine)) if join is not None else end + 1
        if after >= len(mine) or mine[after].is_comm:
            continue
        peer = "bwd" if s == "fwd" else "fwd"
        nxt = next((regions[p][q][0] for p, q in order[n + 1:] if p == peer), None)
        if nxt is None or nxt == 0:
            continue
        waits.append((sides[peer][nxt - 1][0], sides[s][after][0]))
    return launch, waits
