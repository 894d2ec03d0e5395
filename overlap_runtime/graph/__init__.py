"""Task DAG: compute and communication tasks, validation, cost-model simulation, traces.

Used today to validate (no deadlock, every send matched, one collective order) and simulate
(cost model) graphs before anything runs; nothing here executes a graph. ``intervals`` is the
one home of interval arithmetic (union, measure, overlap, difference) for timelines and traces.

May import: the standard library and networkx (lazily, for the ``TaskGraph.nx`` view); never
torch or another part of ``overlap_runtime``.
"""

from .grid import format_grid, format_timeline
from .simulate import CostModel, SimulationResult, TimelineEntry, simulate
from .task_graph import TaskGraph
from .tasks import EDGE_KINDS, CommInfo, Task, is_comm_lane
from .trace import chrome_trace, write_chrome_trace
from .validate import (
    CollectiveOrderError,
    CommMatching,
    DeadlockError,
    GraphValidationError,
    UnmatchedCommError,
    match_comm,
    rendezvous_edges,
    validate_graph,
)

__all__ = [
    "EDGE_KINDS",
    "CollectiveOrderError",
    "CommInfo",
    "CommMatching",
    "CostModel",
    "DeadlockError",
    "GraphValidationError",
    "SimulationResult",
    "Task",
    "TaskGraph",
    "TimelineEntry",
    "UnmatchedCommError",
    "chrome_trace",
    "format_grid",
    "format_timeline",
    "is_comm_lane",
    "match_comm",
    "rendezvous_edges",
    "simulate",
    "validate_graph",
    "write_chrome_trace",
]
