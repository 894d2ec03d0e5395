"""Chrome / Perfetto trace export of a simulated timeline.

Open the JSON in ``chrome://tracing`` or https://ui.perfetto.dev: one process per rank, one
thread per lane, one complete event (``"ph": "X"``) per task and a flow arrow from each send to
its receive. Times are written in microseconds: ``time_scale`` converts the cost model's unit
(default 1 unit = 1 ms).
"""

from __future__ import annotations

import json
import os
from typing import Any, Hashable

from .simulate import SimulationResult, TimelineEntry


def chrome_trace(
    result: SimulationResult,
    *,
    time_scale: float = 1000.0,
    pairs: list[tuple[Hashable, Hashable]] | None = None,
) -> dict[str, Any]:
    """The trace as a dict (``{"traceEvents": [...]}``); ``pairs`` adds send -> recv flows."""
    events: list[dict[str, Any]] = []
    lanes: dict[int, dict[str, int]] = {}
    for rank in result.ranks + sorted(set(result.entries_by_rank) - set(result.ranks)):
        lane_names = sorted({e.lane for e in result.entries_by_rank.get(rank, ())},
                            key=lambda lane: (lane.startswith("comm"), lane))
        lanes[rank] = {lane: k for k, lane in enumerate(lane_names)}
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for lane, tid in lanes[rank].items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": lane}})
    by_id: dict[Hashable, TimelineEntry] = {}
    for e in result.entries:
        by_id[e.id] = e
        events.append({
            "name": e.label,
            "cat": "communication" if e.is_comm else "computation",
            "ph": "X",
            "pid": e.rank,
            "tid": lanes[e.rank][e.lane],
            "ts": e.start * time_scale,
            "dur": max(0.0, e.end - e.start) * time_scale,
            "args": {"kind": e.kind, "lane": e.lane},
        })
    for k, (s, r) in enumerate(pairs or ()):
        es, er = by_id.get(s), by_id.get(r)
        if es is None or er is None:
            continue
        events.append({"name": "p2p", "cat": "flow", "ph": "s", "id": k, "pid": es.rank,
                       "tid": lanes[es.rank][es.lane], "ts": es.start * time_scale})
        events.append({"name": "p2p", "cat": "flow", "ph": "f", "bp": "e", "id": k,
                       "pid": er.rank, "tid": lanes[er.rank][er.lane],
                       "ts": er.end * time_scale})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"makespan": result.makespan, "bubble_ratio": result.bubble_ratio}}


def write_chrome_trace(
    result: SimulationResult,
    path: str | os.PathLike[str],
    *,
    time_scale: float = 1000.0,
    pairs: list[tuple[Hashable, Hashable]] | None = None,
) -> None:
    """Write :func:`chrome_trace` to ``path`` as JSON."""
    # json.dumps, not json.dump: dump streams through the pure-Python encoder, 3-5x slower on
    # the millions of events of a deep pipeline (the C encoder only serves one-shot dumps).
    text = json.dumps(chrome_trace(result, time_scale=time_scale, pairs=pairs))
    with open(path, "w") as f:
        f.write(text)
