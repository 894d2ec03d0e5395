"""Simulate ranks that share fewer CPU cores than there are ranks (processor sharing).

The list scheduler (:func:`overlap_runtime.graph.simulate`) gives each rank a device of its own.
On a CPU host with ``R`` single-threaded rank processes and ``C < R`` cores, the OS time-slices
the cores: while ``k`` ranks compute, each progresses at ``min(1, C / k)`` of full speed, and an
action's wall span stretches accordingly. That is what the execution trace measures (an action's
span is wall time), so predicting those traces needs the same model:

* a compute task carries its *work* (seconds at full speed, :func:`work_of_spans` recovers it
  from measured spans); it runs on its rank's device (one task at a time per rank, as in the
  list scheduler) at rate ``min(1, C / k)``, ``k`` the number of ranks computing at that moment;
* a communication task takes its cost in wall time and uses no core (gloo waits block).

Resources and readiness follow :func:`overlap_runtime.graph.simulate` (blocking rendezvous,
one task at a time per ``comm*`` lane and per device, first ready first served).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Iterable, Mapping

from overlap_runtime.graph.intervals import measure_minus, total_length, union
from overlap_runtime.graph.simulate import SimulationResult
from overlap_runtime.graph.tasks import TaskGraphData, is_comm_lane
from overlap_runtime.graph.validate import blocking_adjacency, match_comm, validate_graph

__all__ = ["simulate_shared_cores", "work_of_spans"]

_EPS = 1e-12


def simulate_shared_cores(graph: TaskGraphData, cores: int,
                          rank_weight: Mapping[int, float] | None = None) -> SimulationResult:
    """Processor-sharing simulation of ``graph`` (every task needs a ``cost`` hint: work in
    seconds for compute, wall seconds for communication) on ``cores`` shared cores.

    ``rank_weight[r]``: how many real ranks rank ``r`` stands for (a representative of its
    pipeline coordinate, :func:`~overlap_runtime.stepgraph.layout_graph.layout_graph`): while
    it computes it counts ``rank_weight[r]`` times in ``k``. Default 1."""
    if cores < 1:
        raise ValueError(f"cores={cores} must be >= 1")
    matching = match_comm(graph)
    ig = graph.indexed()
    tasks = ig.tasks
    n = len(tasks)
    succ, npred = blocking_adjacency(graph, matching)
    indeg = list(npred)
    work = []
    for t in tasks:
        if t.cost is None:
            raise ValueError(f"task {t.id!r} (rank {t.rank}) has no cost hint; "
                             f"simulate_shared_cores needs one on every task")
        work.append(0.0 if t.comm is not None and t.comm.op == "recv" else float(t.cost))
    res = [(t.rank, t.lane) if is_comm_lane(t.lane) else (t.rank, "") for t in tasks]
    is_compute = [not is_comm_lane(t.lane) for t in tasks]
    weight = {t.rank: float((rank_weight or {}).get(t.rank, 1.0)) for t in tasks}

    waiting: dict[tuple[int, str], list[tuple[float, int]]] = {}
    ready_at = [0.0] * n
    running: dict[tuple[int, str], int] = {}
    remaining = [0.0] * n
    start = [0.0] * n
    end = [0.0] * n
    now = 0.0
    done = 0
    for i in range(n):
        if indeg[i] == 0:
            heapq.heappush(waiting.setdefault(res[i], []), (0.0, i))
    while done < n:
        for r, q in waiting.items():
            if q and r not in running:
                _, i = heapq.heappop(q)
                running[r] = i
                start[i] = now
                remaining[i] = work[i]
        if not running:
            validate_graph(graph)  # raises with the cycle
            raise RuntimeError(f"shared-core simulation stalled after {done}/{n} tasks")
        k = sum(weight[tasks[i].rank] for i in running.values() if is_compute[i])
        rate = min(1.0, cores / k) if k else 1.0
        dt = min(remaining[i] / (rate if is_compute[i] else 1.0) for i in running.values())
        now += dt
        finished = []
        for r, i in running.items():
            remaining[i] -= dt * (rate if is_compute[i] else 1.0)
            if remaining[i] <= _EPS * max(1.0, work[i]):
                finished.append(r)
        for r in finished:
            i = running.pop(r)
            end[i] = now
            done += 1
            for j in succ[i]:
                if now > ready_at[j]:
                    ready_at[j] = now
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(waiting.setdefault(res[j], []), (ready_at[j], j))
    for s_id, r_id in matching.pairs:
        i_r, i_s = ig.index[r_id], ig.index[s_id]
        start[i_r] = min(start[i_s], end[i_r])
    comp: dict[int, list[tuple[float, float]]] = {}
    comm: dict[int, list[tuple[float, float]]] = {}
    for i, t in enumerate(tasks):
        if end[i] > start[i]:
            (comp if is_compute[i] else comm).setdefault(t.rank, []).append((start[i], end[i]))
    busy, exposed = {}, {}
    for rank in sorted({t.rank for t in tasks}):
        cu = union(comp.get(rank, []))
        busy[rank] = total_length(cu)
        exposed[rank] = measure_minus(union(comm.get(rank, [])), cu)
    return SimulationResult(list(tasks), start, end, max(end, default=0.0), busy, exposed, [])


def work_of_spans(spans: dict[object, list[tuple[float, float]]], cores: int,
                  busy_by_rank: Iterable[list[tuple[float, float]]]) -> dict[object, float]:
    """Full-speed work of measured spans: the integral of ``min(1, C / k(t))`` over each span's
    busy intervals, ``k(t)`` the number of ranks busy at ``t`` (``busy_by_rank``: one union of
    intervals per rank). ``spans``: key -> busy intervals of that action."""
    delta: dict[float, int] = {}
    for u in busy_by_rank:
        for a, b in u:
            delta[a] = delta.get(a, 0) + 1
            delta[b] = delta.get(b, 0) - 1
    xs = sorted(delta)
    segs: list[tuple[float, float, float]] = []  # (from, to, rate)
    k = 0
    for x0, x1 in zip(xs, xs[1:]):
        k += delta[x0]
        segs.append((x0, x1, min(1.0, cores / k) if k > 0 else 1.0))
    ends = [s1 for _, s1, _ in segs]
    out: dict[object, float] = {}
    for key, ivs in spans.items():
        total = 0.0
        for a, b in ivs:
            covered = 0.0
            j = bisect.bisect_right(ends, a)
            while j < len(segs) and segs[j][0] < b:
                lo, hi = max(a, segs[j][0]), min(b, segs[j][1])
                if hi > lo:
                    total += (hi - lo) * segs[j][2]
                    covered += hi - lo
                j += 1
            total += (b - a) - covered  # outside every busy interval: full speed
        out[key] = total
    return out
