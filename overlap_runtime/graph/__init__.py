"""Task DAG: compute and communication tasks, validation, cost-model simulation, traces.

Used to validate (no deadlock, every send matched, one collective order) and simulate
(cost model) graphs before anything runs; nothing here executes a graph. Modules, lowest first:
``intervals`` (the one home of interval arithmetic: union, measure, overlap, difference),
``tasks`` (``Task``, ``CommInfo``, lanes, ``TaskGraphData``), ``grid`` (rank x step text),
``validate`` (matching, collective order, deadlock proof), ``simulate`` (cost model, timeline),
``task_graph`` (``TaskGraph``: the storage plus ``validate()`` / ``simulate()``), ``trace``
(Chrome trace of a simulation), ``comm_overlap`` (the all-to-all overlap figure of a timeline). Internals (``CommMatching``, ``match_comm``,
``rendezvous_edges``, ``TimelineEntry``, ``EDGE_KINDS``, ``is_comm_lane``) are imported from
their modules.

May import: the standard library and networkx (lazily, for the ``TaskGraph.nx`` view); never
torch or another part of ``overlap_runtime`` (everything that builds graphs sits above).
"""

from .grid import format_grid, format_timeline
from .simulate import CostModel, SimulationResult, simulate
from .task_graph import TaskGraph
from .tasks import CommInfo, Task
from .trace import chrome_trace, write_chrome_trace
from .validate import (
    CollectiveOrderError,
    DeadlockError,
    GraphValidationError,
    UnmatchedCommError,
    validate_graph,
)

__all__ = [
    "CollectiveOrderError",
    "CommInfo",
    "CostModel",
    "DeadlockError",
    "GraphValidationError",
    "SimulationResult",
    "Task",
    "TaskGraph",
    "UnmatchedCommError",
    "chrome_trace",
    "format_grid",
    "format_timeline",
    "simulate",
    "validate_graph",
    "write_chrome_trace",
]
