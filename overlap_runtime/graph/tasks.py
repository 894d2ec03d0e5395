"""The task graph's vocabulary and storage: :class:`Task`, :class:`CommInfo`, lanes, edge kinds,
:class:`TaskGraphData` (tasks and edges, a ``networkx.DiGraph`` view, the :class:`IndexedGraph`
array form the passes read).

The passes (``validate``, ``simulate``) read graphs through this module and the user-facing
:class:`~overlap_runtime.graph.task_graph.TaskGraph` adds them as methods on top, so the modules
import one way: ``tasks`` <- ``validate`` <- ``simulate`` <- ``task_graph``.

The graph knows nothing about pipelines: pipeline schedules, MoE dispatch/combine and GDN state
chains all compile into it. A task sits on one rank and one *lane*:

- ``compute`` or a thread name (``fwd``, ``bwd``, ...): lanes that share the rank's device;
- ``comm`` or ``comm:<group>``: communication engines beside the device.

Each lane runs its tasks one at a time in program order. Edges carry a ``kind``:

- ``program``: order inside a rank's program (within a lane, or a fork/join between lanes);
- ``data``: a result used by another task;
- ``match``: a send to its receive (added by the producer of the graph).

Communication tasks carry :class:`CommInfo`. A send and a receive match when they have the same
``key``; collectives on one ``group`` match by position (the k-th collective on the group on every
member rank is one call). ``validate`` checks matching and proves that no rank blocks forever;
``simulate`` turns costs into a timeline.

May import: the standard library and networkx (lazily, for the ``nx`` view); nothing else of
``overlap_runtime``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Literal,
    Mapping,
    NamedTuple,
)

if TYPE_CHECKING:
    import networkx as nx

EDGE_KINDS = ("program", "data", "match")
_EMPTY: Mapping[str, Any] = MappingProxyType({})
CommOp = Literal["send", "recv", "collective"]


def is_comm_lane(lane: str) -> bool:
    """``comm`` and ``comm:<group>`` lanes are communication engines; others share the device."""
    return lane == "comm" or lane.startswith("comm:")


class CommInfo(NamedTuple):
    """What a communication task does.

    ``op``: ``send``, ``recv`` or ``collective``. ``key``: for send/recv the matching key (the
    same on both sides); for a collective the group name. ``peer``: the other rank of a
    send/recv (``None`` for collectives). ``nbytes``: message size for the cost model (``None``:
    the cost model's default).
    """

    op: CommOp
    key: Hashable
    peer: int | None = None
    nbytes: float | None = None


class Task(NamedTuple):
    """One node of a :class:`TaskGraph`.

    ``id``: unique and hashable (pipeline tasks use their action text, ``1F3``). ``kind``: what
    the task is (``F``, ``SEND_F``, ``dispatch``...) and the cost-model key. ``cost``: a cost
    hint in seconds that overrides the cost model. ``fn``: an optional callable carried with
    the task; nothing in ``graph`` calls it (there is no ``execute`` pass yet).
    ``step``: position in the rank's program, for the rank x step grid in error messages.
    ``label``: display text (default ``str(id)``); ``meta``: free-form facts (stage, microbatch).
    Immutable (a named tuple, cheap to create by the hundred thousand).
    """

    id: Hashable
    rank: int
    lane: str
    kind: str
    cost: float | None = None
    fn: Callable[..., Any] | None = None
    comm: CommInfo | None = None
    step: int | None = None
    label: str | None = None
    meta: Mapping[str, Any] = _EMPTY

    @property
    def text(self) -> str:
        return self.label if self.label is not None else str(self.id)


@dataclass
class IndexedGraph:
    """Array form of a task graph for the passes: task ``i`` is ``tasks[i]`` with id ``ids[i]``.

    ``succ[i]``: successors of ``i``; ``program_preds[i]``: predecessors through ``program``
    edges; ``npred[i]``: number of predecessors.
    """

    ids: list[Hashable]
    index: dict[Hashable, int]
    tasks: list[Task]
    succ: list[list[int]]
    program_preds: list[list[int]]
    npred: list[int]
    #: (matching, successors with rendezvous waits added, predecessor counts); see validate.py
    blocking: tuple[Any, list[list[int]], list[int]] | None = field(default=None, repr=False)


class TaskGraphData:
    """Tasks and dependencies, without the passes (users build a
    :class:`~overlap_runtime.graph.task_graph.TaskGraph`, which adds ``validate``/``simulate``).

    The graph is stored compactly (tasks by id, edges by kind, parallel edges of different
    kinds kept apart) so that compiling, validating and simulating 100k-task pipelines stays
    fast; ``self.nx`` gives it as a ``networkx.DiGraph`` (node attribute ``task``; edge
    attributes ``kind``, the first of :data:`EDGE_KINDS` among the edge's kinds, and ``kinds``,
    all of them) for networkx algorithms and drawing. The view is built on first access and
    rebuilt after the graph changes; change the graph through ``add_*``, not through the view.

    ``programs`` optionally holds, per rank, the text of each program step (the rank x step
    grid that error messages print); producers with a step-wise program (pipeline schedules)
    fill it.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.programs: dict[int, list[str]] = {}
        self._tasks: dict[Hashable, Task] = {}
        self._edges: dict[str, list[tuple[Hashable, Hashable]]] = {k: [] for k in EDGE_KINDS}
        self._indexed: IndexedGraph | None = None
        self._nx: nx.DiGraph | None = None

    def _changed(self) -> None:
        self._indexed = None
        self._nx = None

    # -- building ------------------------------------------------------------------------
    def add_task(self, task: Task) -> Task:
        if task.id in self._tasks:
            other = self._tasks[task.id]
            raise ValueError(
                f"task id {task.id!r} (rank {task.rank}, lane {task.lane}) is already in the graph "
                f"(rank {other.rank}, lane {other.lane}); task ids must be unique"
            )
        self._tasks[task.id] = task
        self._changed()
        return task

    def add_tasks(self, tasks: Iterable[Task]) -> None:
        """Add many tasks at once (ids must be new and unique)."""
        store = self._tasks
        for t in tasks:
            if t.id in store:
                raise ValueError(
                    f"task id {t.id!r} (rank {t.rank}, lane {t.lane}) is already in the graph "
                    f"(rank {store[t.id].rank}); task ids must be unique"
                )
            store[t.id] = t
        self._changed()

    def add_edge(self, u: Hashable, v: Hashable, kind: str = "data") -> None:
        self.add_edges([(u, v)], kind)

    def add_edges(self, edges: Iterable[tuple[Hashable, Hashable]], kind: str) -> None:
        """Add edges of one ``kind``; both ends must already be tasks."""
        if kind not in EDGE_KINDS:
            raise ValueError(f"edge kind {kind!r} is not one of {EDGE_KINDS}")
        edges = list(edges)
        store = self._tasks
        for u, v in edges:
            if u not in store or v not in store:
                missing = u if u not in store else v
                raise KeyError(f"{kind} edge {u!r} -> {v!r}: task {missing!r} is not in the graph")
            if u == v:
                raise ValueError(f"{kind} edge {u!r} -> {v!r} is a self-loop")
        self._edges[kind].extend(edges)
        self._changed()

    # -- reading -------------------------------------------------------------------------
    def task(self, task_id: Hashable) -> Task:
        return self._tasks[task_id]

    def tasks(self) -> Iterator[Task]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, task_id: Hashable) -> bool:
        return task_id in self._tasks

    @property
    def ranks(self) -> list[int]:
        return sorted({t.rank for t in self._tasks.values()})

    def lanes(self) -> dict[int, list[str]]:
        """rank -> lanes used on that rank (sorted)."""
        out: dict[int, set[str]] = {}
        for t in self._tasks.values():
            out.setdefault(t.rank, set()).add(t.lane)
        return {r: sorted(v) for r, v in sorted(out.items())}

    def edges(self, kind: str | None = None) -> list[tuple[Hashable, Hashable, str]]:
        """All edges as ``(u, v, kind)``, or only those of ``kind``."""
        kinds = EDGE_KINDS if kind is None else (kind,)
        return [(u, v, k) for k in kinds for u, v in self._edges.get(k, ())]

    def edge_kinds(self, u: Hashable, v: Hashable) -> list[str]:
        """Kinds of the edges from ``u`` to ``v`` (empty if none)."""
        return [k for k in EDGE_KINDS if (u, v) in set(self._edges[k])]

    def num_edges(self) -> int:
        return sum(len(e) for e in self._edges.values())

    @property
    def nx(self) -> nx.DiGraph:
        """The graph as a ``networkx.DiGraph`` (built on first access, cached)."""
        if self._nx is None:
            import networkx as nx

            g = nx.DiGraph(name=self.name)
            g.add_nodes_from((i, {"task": t}) for i, t in self._tasks.items())
            for k in reversed(EDGE_KINDS):  # earlier kinds win the ``kind`` attribute
                for u, v in self._edges[k]:
                    if g.has_edge(u, v):
                        d = g[u][v]
                        d["kind"] = k
                        d["kinds"] = (k,) + d["kinds"]
                    else:
                        g.add_edge(u, v, kind=k, kinds=(k,))
            self._nx = g
        return self._nx

    def indexed(self) -> IndexedGraph:
        """The :class:`IndexedGraph` of the current graph (cached until it changes)."""
        if self._indexed is not None:
            return self._indexed
        ids = list(self._tasks)
        index = {n: i for i, n in enumerate(ids)}
        tasks = list(self._tasks.values())
        succ: list[list[int]] = [[] for _ in ids]
        program_preds: list[list[int]] = [[] for _ in ids]
        npred = [0] * len(ids)
        for kind, edges in self._edges.items():
            for u, v in edges:
                iu, iv = index[u], index[v]
                succ[iu].append(iv)
                npred[iv] += 1
                if kind == "program":
                    program_preds[iv].append(iu)
        self._indexed = IndexedGraph(ids, index, tasks, succ, program_preds, npred)
        return self._indexed
