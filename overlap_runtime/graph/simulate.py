"""Cost-model simulation of a :class:`TaskGraph`: timeline, makespan, bubbles, exposed comm.

The simulator is a list scheduler. A task starts when

1. every predecessor (program order, data, send -> receive) has finished,
2. blocking communication has met its partner: a send starts once its receive is posted (the
   receive's program predecessors have finished), a collective once every member is posted,
3. its resource is free: lanes of one rank that are not ``comm*`` share one device (so the two
   threads of an ``OVERLAP_B_F`` step take turns on the device, first come first served); each
   ``comm*`` lane is its own engine.

A send lasts ``latency + nbytes / bandwidth``; its receive finishes when the send does. Costs
come from the task's ``cost`` hint, else from :class:`CostModel` by ``kind``.

- *bubble ratio*: idle device time over ``ranks * makespan``;
- *exposed communication* of a rank: time when some communication of the rank is in flight and
  its device is idle (communication not hidden behind compute).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping

from ._gc import gc_paused
from .intervals import measure_minus, total_length, union
from .tasks import Task, TaskGraphData, is_comm_lane
from .validate import CommMatching, blocking_adjacency, match_comm, validate_graph


@dataclass(frozen=True)
class CostModel:
    """Per-kind costs (seconds, or any consistent unit).

    ``F``, ``B``, ``I``, ``W``: compute cost of one action of one stage. ``kinds``: costs of
    other task kinds (MoE dispatch, GDN chain steps...). ``comm_latency`` and
    ``comm_bandwidth`` (bytes per unit time) price a message of ``message_bytes`` bytes (or the
    task's own ``nbytes``). Defaults: backward twice the forward, free communication.
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741
    W: float = 1.0
    comm_latency: float = 0.0
    comm_bandwidth: float = math.inf
    message_bytes: float = 0.0
    kinds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # finite: an infinite cost makes an infinite makespan, whose timeline cannot be drawn
        for name in ("F", "B", "I", "W", "comm_latency", "message_bytes"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"CostModel.{name}={value} must be a finite number >= 0")
        if not self.comm_bandwidth > 0:
            raise ValueError(f"CostModel.comm_bandwidth={self.comm_bandwidth} must be > 0")
        for k, value in self.kinds.items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"CostModel.kinds[{k!r}]={value} must be a finite number >= 0")

    def compute_cost(self, kind: str) -> float:
        if kind in self.kinds:
            return float(self.kinds[kind])
        if kind in ("F", "B", "I", "W"):
            return float(getattr(self, kind))
        raise ValueError(
            f"no cost for task kind {kind!r}: give it in CostModel.kinds or as the task's cost hint"
        )

    def message_cost(self, nbytes: float | None) -> float:
        size = self.message_bytes if nbytes is None else nbytes
        return self.comm_latency + (0.0 if size == 0 else size / self.comm_bandwidth)


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """When one task ran. For a receive, ``start`` is when the matching transfer began."""

    id: Hashable
    rank: int
    lane: str
    kind: str
    label: str
    start: float
    end: float
    comm_op: str | None = None

    @property
    def is_comm(self) -> bool:
        return self.comm_op is not None


@dataclass
class SimulationResult:
    """Timeline and summary figures of one simulation.

    ``start[i]`` / ``end[i]`` are the times of ``tasks[i]`` (for a receive, ``start`` is when
    its transfer began); ``entries`` gives them as :class:`TimelineEntry` objects.
    """

    tasks: list[Task]
    start: list[float]
    end: list[float]
    makespan: float
    busy_by_rank: dict[int, float]
    exposed_comm_by_rank: dict[int, float]
    critical_path: list[Hashable]
    _entries: list[TimelineEntry] | None = field(default=None, repr=False)
    _by_rank: dict[int, list[TimelineEntry]] | None = field(default=None, repr=False)

    @property
    def entries(self) -> list[TimelineEntry]:
        if self._entries is None:
            self._entries = [
                TimelineEntry(t.id, t.rank, t.lane, t.kind, t.text, s, e,
                              t.comm.op if t.comm is not None else None)
                for t, s, e in zip(self.tasks, self.start, self.end)
            ]
        return self._entries

    @property
    def entries_by_rank(self) -> dict[int, list[TimelineEntry]]:
        if self._by_rank is None:
            out: dict[int, list[TimelineEntry]] = {}
            for e in self.entries:
                out.setdefault(e.rank, []).append(e)
            self._by_rank = out
        return self._by_rank

    @property
    def ranks(self) -> list[int]:
        return sorted(self.busy_by_rank)

    @property
    def bubble_by_rank(self) -> dict[int, float]:
        """Idle fraction of each rank's device over the makespan."""
        if self.makespan <= 0:
            return {r: 0.0 for r in self.busy_by_rank}
        return {r: 1.0 - b / self.makespan for r, b in self.busy_by_rank.items()}

    @property
    def bubble_ratio(self) -> float:
        """Idle device time over ``ranks * makespan``."""
        n = len(self.busy_by_rank)
        if n == 0 or self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy_by_rank.values()) / (n * self.makespan)

    @property
    def exposed_comm(self) -> float:
        """Largest exposed communication time over the ranks."""
        return max(self.exposed_comm_by_rank.values(), default=0.0)

    def summary(self) -> str:
        return (
            f"makespan {self.makespan:g}  bubble {self.bubble_ratio:.4f}  "
            f"exposed comm {self.exposed_comm:g} (max over ranks)  ranks {len(self.ranks)}"
        )


@gc_paused
def simulate(
    graph: TaskGraphData, costs: CostModel | None = None, *, matching: CommMatching | None = None
) -> SimulationResult:
    """Simulate ``graph`` under ``costs`` (default :class:`CostModel`).

    ``matching`` (from :func:`~overlap_runtime.graph.validate.validate_graph`) skips re-matching
    the communication. Raises the validation error if the graph cannot complete.
    """
    costs = costs or CostModel()
    if matching is None:
        matching = match_comm(graph)
    ig = graph.indexed()
    ids, tasks = ig.ids, ig.tasks
    n_tasks = len(ids)
    succ, npred = blocking_adjacency(graph, matching)
    indeg = list(npred)

    dur = [0.0] * n_tasks
    res: list[tuple[int, str]] = [(0, "")] * n_tasks
    kind_cost: dict[str, float] = {}
    msg_cost: dict[float | None, float] = {}
    for i, t in enumerate(tasks):
        c = t.comm
        if t.cost is not None:
            dur[i] = float(t.cost)
        elif c is None:
            k = t.kind
            if k not in kind_cost:
                kind_cost[k] = costs.compute_cost(k)
            dur[i] = kind_cost[k]
        elif c.op == "recv":
            dur[i] = 0.0
        else:
            if c.nbytes not in msg_cost:
                msg_cost[c.nbytes] = costs.message_cost(c.nbytes)
            dur[i] = msg_cost[c.nbytes]
        res[i] = (t.rank, t.lane) if is_comm_lane(t.lane) else (t.rank, "")

    ready = [0.0] * n_tasks
    start = [0.0] * n_tasks
    end = [0.0] * n_tasks
    free: dict[tuple[int, str], float] = {}
    last_on: dict[tuple[int, str], int] = {}
    res_pred = [-1] * n_tasks  # task that held the resource right before (for the critical path)
    heap = [(0.0, i) for i in range(n_tasks) if indeg[i] == 0]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    done = 0
    while heap:
        rt, i = pop(heap)
        r = res[i]
        s = free.get(r, 0.0)
        if s > rt:
            res_pred[i] = last_on[r]
        else:
            s = rt
        e = s + dur[i]
        start[i] = s
        end[i] = e
        free[r] = e
        last_on[r] = i
        done += 1
        for j in succ[i]:
            if e > ready[j]:
                ready[j] = e
            indeg[j] -= 1
            if indeg[j] == 0:
                push(heap, (ready[j], j))
    if done != n_tasks:
        validate_graph(graph)  # raises with the cycle and the grid
        raise RuntimeError(f"simulation stalled after {done}/{n_tasks} tasks")  # pragma: no cover

    index = ig.index
    for s_id, r_id in matching.pairs:
        i_r = index[r_id]
        s_start = start[index[s_id]]
        start[i_r] = s_start if s_start < end[i_r] else end[i_r]
    makespan = max(end, default=0.0)

    comp: dict[int, list[tuple[float, float]]] = {}
    comm: dict[int, list[tuple[float, float]]] = {}
    for i, t in enumerate(tasks):
        s, e = start[i], end[i]
        target = comp if t.comm is None else comm
        lst = target.get(t.rank)
        if lst is None:
            lst = target[t.rank] = []
        if e > s:
            lst.append((s, e))
    busy: dict[int, float] = {}
    exposed: dict[int, float] = {}
    for rank in sorted(set(comp) | set(comm)):
        cu = union(comp.get(rank, []))
        busy[rank] = total_length(cu)
        exposed[rank] = measure_minus(union(comm.get(rank, [])), cu)

    # critical path: walk back from the last task through whatever delayed each start
    path: list[Hashable] = []
    if n_tasks:
        preds: dict[int, list[int]] = {}
        i = max(range(n_tasks), key=end.__getitem__)
        while i >= 0:
            path.append(ids[i])
            if res_pred[i] >= 0 and end[res_pred[i]] >= ready[i]:
                i = res_pred[i]
                continue
            if not preds:
                for u, vs in enumerate(succ):
                    for v in vs:
                        preds.setdefault(v, []).append(u)
            best = -1
            for p in preds.get(i, ()):
                if end[p] == ready[i] and (best < 0 or end[p] >= end[best]):
                    best = p
            i = best
        path.reverse()
    return SimulationResult(tasks, start, end, makespan, busy, exposed, path)
