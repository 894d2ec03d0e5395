"""Static checks of a :class:`TaskGraph`: matching, collective order and deadlock freedom.

Blocking semantics (the strictest the runtime may meet, e.g. rendezvous sends on HCCL/NCCL):
a send completes only once its receive is posted, a receive only once its send is posted, and a
collective only once every member has posted it. So besides the graph's own edges, each
communication task waits for the *program predecessors* of its partners (the tasks after which
the partners are posted). The schedule is deadlock-free iff the graph plus these rendezvous
edges is acyclic; a cycle is reported task by task.

Example of the classic deadlock (both ranks send first, then receive)::

    rank 0: 0SEND_F0  0RECV_B0        0SEND_F0 waits until 1RECV_F1 is posted, which is after
    rank 1: 1SEND_B0  1RECV_F1        1SEND_B0, which waits until 0RECV_B0 is posted, after 0SEND_F0
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable

from ._gc import gc_paused
from .grid import format_grid
from .tasks import IndexedGraph, Task, TaskGraphData


class GraphValidationError(ValueError):
    """A task graph that cannot run; the message names the tasks and prints the grid."""


class UnmatchedCommError(GraphValidationError):
    """A send without its receive, a receive without its send, or a duplicated key."""


class CollectiveOrderError(GraphValidationError):
    """Collectives on one group issued in different orders on different ranks."""


class DeadlockError(GraphValidationError):
    """The tasks wait on each other in a cycle under blocking semantics."""

    def __init__(self, message: str, cycle: list[Hashable]) -> None:
        super().__init__(message)
        self.cycle = cycle


@dataclass
class CommMatching:
    """Result of :func:`match_comm`: send -> recv pairs and collective calls (lists of tasks)."""

    pairs: list[tuple[Hashable, Hashable]]
    collectives: list[list[Hashable]]


def _marks(graph: TaskGraphData, ids: list[Hashable]) -> set[tuple[int, int]]:
    out = set()
    for i in ids:
        t = graph.task(i)
        if t.step is not None:
            out.add((t.rank, t.step))
    return out


def _grid(graph: TaskGraphData, ids: list[Hashable]) -> str:
    programs = graph.programs or _programs_from_tasks(graph)
    if not programs:
        return ""
    return "\n\n" + format_grid(programs, _marks(graph, ids))


def _programs_from_tasks(graph: TaskGraphData) -> dict[int, list[str]]:
    cells: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t in graph.tasks():
        if t.step is not None:
            cells[t.rank][t.step].append(t.text)
    out: dict[int, list[str]] = {}
    for rank, steps in cells.items():
        n = max(steps) + 1
        out[rank] = [";".join(steps.get(i, [])) for i in range(n)]
    return out


def _where(t: Task) -> str:
    step = "" if t.step is None else f", step {t.step}"
    return f"{t.text} (rank {t.rank}, lane {t.lane}{step})"


def match_comm(graph: TaskGraphData) -> CommMatching:
    """Pair every send with its receive and group collectives into calls.

    Raises :class:`UnmatchedCommError` or :class:`CollectiveOrderError`.
    """
    sends: dict[Hashable, Task] = {}
    recvs: dict[Hashable, Task] = {}
    extra: dict[Hashable, list[Task]] = defaultdict(list)  # 2nd, 3rd... task with one key
    colls: dict[Hashable, dict[int, list[Task]]] = defaultdict(lambda: defaultdict(list))
    for t in graph.indexed().tasks:
        c = t.comm
        if c is None:
            continue
        op = c.op
        if op == "send" or op == "recv":
            table = sends if op == "send" else recvs
            if c.key in table:
                extra[c.key].append(t)
            else:
                table[c.key] = t
        elif op == "collective":
            colls[c.key][t.rank].append(t)
        else:
            raise GraphValidationError(f"task {_where(t)} has unknown comm op {op!r}")

    problems: list[str] = []
    bad: list[Hashable] = []
    pairs: list[tuple[Hashable, Hashable]] = []
    for key, st in sends.items():
        rt = recvs.get(key)
        if rt is None or key in extra:
            continue
        peer = st.comm.peer  # type: ignore[union-attr]
        if peer is not None and peer != rt.rank:
            problems.append(
                f"send {_where(st)} targets rank {peer} but its receive {_where(rt)} is on "
                f"rank {rt.rank}"
            )
            bad += [st.id, rt.id]
        pairs.append((st.id, rt.id))
    if len(pairs) != len(sends) or len(pairs) != len(recvs):
        for key in list(sends) + [k for k in recvs if k not in sends]:
            group = [x for x in (sends.get(key), recvs.get(key)) if x is not None] + extra.get(
                key, [])
            ns = sum(1 for x in group if x.comm.op == "send")  # type: ignore[union-attr]
            nr = len(group) - ns
            if ns == 1 and nr == 1:
                continue
            if nr == 0:
                problems.extend(f"send {_where(x)} has no matching receive (key {key!r})"
                                for x in group)
            elif ns == 0:
                problems.extend(f"receive {_where(x)} has no matching send (key {key!r})"
                                for x in group)
            else:
                problems.append(
                    f"key {key!r} has {ns} sends and {nr} receives; every send needs exactly one "
                    "receive: " + ", ".join(_where(x) for x in group)
                )
            bad += [x.id for x in group]
    if problems:
        problems.sort()
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise UnmatchedCommError(
            f"{len(problems)} unmatched communication task(s); rule: every send has exactly "
            "one receive with the same key and vice versa:\n  "
            + "\n  ".join(problems[:20]) + more + _grid(graph, bad)
        )

    calls: list[list[Hashable]] = []
    for group, by_rank in colls.items():
        seqs = {
            rank: sorted(ts, key=lambda t: (t.step is None, t.step if t.step is not None else 0))
            for rank, ts in by_rank.items()
        }
        lengths = {rank: len(ts) for rank, ts in seqs.items()}
        n = max(lengths.values())
        for k in range(n):
            kinds = {rank: (ts[k].kind if k < len(ts) else None) for rank, ts in seqs.items()}
            if len(set(kinds.values())) != 1:
                offenders = [ts[k].id for ts in seqs.values() if k < len(ts)]
                desc = ", ".join(f"rank {r}: {kd}" for r, kd in sorted(kinds.items()))
                raise CollectiveOrderError(
                    f"collective #{k} on group {group!r} differs between ranks ({desc}); rule: "
                    "collectives on one group are issued in the same order on every rank"
                    + _grid(graph, offenders)
                )
            calls.append([ts[k].id for ts in seqs.values()])
    return CommMatching(pairs, calls)


def rendezvous_edges(graph: TaskGraphData, matching: CommMatching) -> list[tuple[Hashable, Hashable]]:
    """Edges that blocking semantics add: partners' program predecessors -> comm task."""
    ig = graph.indexed()
    return [(ig.ids[u], ig.ids[v]) for u, v in _rendezvous_idx(ig, matching)]


def _rendezvous_idx(ig: IndexedGraph, matching: CommMatching) -> list[tuple[int, int]]:
    index, ppreds = ig.index, ig.program_preds
    out: list[tuple[int, int]] = []
    for s, r in matching.pairs:
        i_s, i_r = index[s], index[r]
        out.append((i_s, i_r))  # the receive completes after its send (even without a match edge)
        for p in ppreds[i_r]:
            out.append((p, i_s))
    for call in matching.collectives:
        members = [index[x] for x in call]
        for x in members:
            for y in members:
                if y != x:
                    out.extend((p, x) for p in ppreds[y])
    return out


def blocking_adjacency(
    graph: TaskGraphData, matching: CommMatching
) -> tuple[list[list[int]], list[int]]:
    """Successor lists (indices of ``graph.indexed()``) including rendezvous waits, and the
    predecessor count of each task. Cached on the indexed graph for this ``matching``."""
    ig = graph.indexed()
    if ig.blocking is not None and ig.blocking[0] is matching:
        return ig.blocking[1], ig.blocking[2]
    succ = [list(x) for x in ig.succ]
    npred = list(ig.npred)
    for u, v in _rendezvous_idx(ig, matching):
        succ[u].append(v)
        npred[v] += 1
    ig.blocking = (matching, succ, npred)
    return succ, npred


def _find_cycle(ig: IndexedGraph, succ: list[list[int]], npred: list[int]) -> list[Hashable] | None:
    """Kahn's algorithm; a cycle (as ids) if there is one, else ``None``."""
    n = len(succ)
    indeg = list(npred)
    stack = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while stack:
        i = stack.pop()
        seen += 1
        for v in succ[i]:
            indeg[v] -= 1
            if indeg[v] == 0:
                stack.append(v)
    if seen == n:
        return None
    # Every task left has an incoming edge from another task left: walk predecessors backwards
    # until one repeats.
    left = {i for i in range(n) if indeg[i] > 0}
    preds: dict[int, int] = {}
    for u in left:
        for v in succ[u]:
            if v in left and v not in preds:
                preds[v] = u
    node = min(left)
    order: dict[int, int] = {}
    path: list[int] = []
    while node not in order:
        order[node] = len(path)
        path.append(node)
        node = preds[node]
    cycle = path[order[node]:]
    cycle.reverse()
    return [ig.ids[i] for i in cycle]


def _edge_reason(kinds: list[str]) -> str:
    kind = kinds[0] if kinds else None
    if kind == "program":
        return "runs after it in program order"
    if kind == "data":
        return "needs its result"
    if kind == "match":
        return "receives what it sends"
    return "blocks until its partner is posted, which happens after it (rendezvous)"


@gc_paused
def validate_graph(graph: TaskGraphData) -> CommMatching:
    """Check that ``graph`` can run to completion; return the communication matching.

    1. every send has exactly one receive with its key (and the peer agrees);
    2. collectives on a group are issued in the same order on every member rank;
    3. no cycle, counting the rendezvous waits of blocking communication.

    Raises a :class:`GraphValidationError` subclass whose message prints the rank x step grid
    with the offending tasks marked, and for a deadlock the cycle.
    """
    matching = match_comm(graph)
    succ, npred = blocking_adjacency(graph, matching)
    cycle = _find_cycle(graph.indexed(), succ, npred)
    if cycle is not None:
        steps = [(n, cycle[(i + 1) % len(cycle)]) for i, n in enumerate(cycle)]
        wanted = set(steps)
        kinds: dict[tuple[Hashable, Hashable], list[str]] = defaultdict(list)
        for u, v, k in graph.edges():
            if (u, v) in wanted:
                kinds[(u, v)].append(k)
        lines = [
            f"  {_where(graph.task(nxt))}\n      {_edge_reason(kinds.get((n, nxt), []))}: "
            f"{graph.task(n).text}"
            for n, nxt in steps
        ]
        raise DeadlockError(
            f"deadlock under blocking communication: {len(cycle)} tasks wait on each other in "
            "a cycle (rule: the graph plus rendezvous waits must be acyclic):\n"
            + "\n".join(lines)
            + "\n  cycle: " + " -> ".join(graph.task(n).text for n in cycle + cycle[:1])
            + _grid(graph, cycle),
            cycle,
        )
    return matching
