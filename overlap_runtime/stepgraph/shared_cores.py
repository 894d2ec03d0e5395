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
from typing import Any, Mapping

from overlap_runtime.graph.intervals import measure_minus, total_length, union
from overlap_runtime.graph.simulate import SimulationResult
from overlap_runtime.graph.tasks import TaskGraphData, is_comm_lane
from overlap_runtime.graph.validate import blocking_adjacency, match_comm, validate_graph

_EPS = 1e-12


def simulate_shared_cores(graph: TaskGraphData, cores: int,
                          rank_weight: Mapping[int, float] | None = None) -> SimulationResult:
    """Processor-sharing simulation of ``graph`` (every task needs a ``cost`` hint: work in
    seconds for compute, wall seconds for communication) on ``cores`` shared cores.

    ``rank_weight[r]``: how many real ranks rank ``r`` stands for (a representative of its
    pipeline coordinate, ``compile_step(..., representative=True)``): while
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


def work_of_spans(spans: Mapping[Any, list[tuple[float, float]]], cores: int,
                  thread_of: Mapping[Any, tuple[int, str]] | None = None) -> dict[Any, float]:
    """Full-speed work of measured busy spans (the inverse of :func:`simulate_shared_cores`).

    ``spans``: key -> busy intervals of one action; ``thread_of[key]``: its ``(rank, thread)``
    (default: each key its own rank). While ``k`` ranks have a busy thread, a rank gets
    ``min(1, cores / k)`` of a core, shared by its ``m`` busy threads (one interpreter lock: a
    rank's threads take turns), so an action progresses at ``min(1, cores / k) / m``; its work
    is the integral of that rate over its intervals.
    """
    owner = thread_of or {key: (i, "") for i, key in enumerate(spans)}
    per_thread: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for key, ivs in spans.items():
        per_thread.setdefault(owner[key], []).extend(ivs)
    delta: dict[float, dict[tuple[int, str], int]] = {}
    for th, ivs in per_thread.items():
        for a, b in union(ivs):
            delta.setdefault(a, {})[th] = delta.get(a, {}).get(th, 0) + 1
            delta.setdefault(b, {})[th] = delta.get(b, {}).get(th, 0) - 1
    xs = sorted(delta)
    busy_threads: dict[int, int] = {}  # rank -> busy threads now
    active: dict[tuple[int, str], int] = {}
    seg_from: list[float] = []
    seg_rates: list[dict[int, float]] = []  # per rank, the rate of one busy thread
    for x in xs:
        for th, d in delta[x].items():
            before = active.get(th, 0) > 0
            active[th] = active.get(th, 0) + d
            after = active[th] > 0
            if after != before:
                busy_threads[th[0]] = busy_threads.get(th[0], 0) + (1 if after else -1)
        k = sum(1 for m in busy_threads.values() if m > 0)
        share = min(1.0, cores / k) if k else 1.0
        seg_from.append(x)
        seg_rates.append({r: share / m for r, m in busy_threads.items() if m > 0})
    out: dict[Any, float] = {}
    for key, ivs in spans.items():
        rank = owner[key][0]
        total = 0.0
        for a, b in ivs:
            j = max(0, bisect.bisect_right(seg_from, a) - 1)
            x = a
            while x < b:
                end = seg_from[j + 1] if j + 1 < len(seg_from) else b
                hi = min(b, end)
                if hi > x:
                    total += (hi - x) * seg_rates[j].get(rank, 1.0) if j < len(seg_rates) \
                        else (hi - x)
                x = hi
                j += 1
                if j >= len(seg_from):
                    total += max(0.0, b - x)
                    break
        out[key] = total
    return out
