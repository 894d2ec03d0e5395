"""``TaskGraph``: the task graph users build, with its passes as methods.

The storage and reading API live in :class:`~overlap_runtime.graph.tasks.TaskGraphData` (which
the passes take); this class adds ``validate`` and ``simulate``. It sits above both pass modules
and imports them at module level: ``tasks`` <- ``validate`` <- ``simulate`` <- ``task_graph``,
no cycle.
"""

from __future__ import annotations

from .simulate import CostModel, SimulationResult, simulate
from .tasks import TaskGraphData
from .validate import CommMatching, validate_graph


class TaskGraph(TaskGraphData):
    """Tasks and dependencies (see :class:`~overlap_runtime.graph.tasks.TaskGraphData` for the
    building and reading methods and the ``networkx`` view) with the passes as methods."""

    def validate(self) -> CommMatching:
        """See :func:`overlap_runtime.graph.validate.validate_graph`."""
        return validate_graph(self)

    def simulate(self, costs: CostModel | None = None) -> SimulationResult:
        """See :func:`overlap_runtime.graph.simulate.simulate`."""
        return simulate(self, costs)
