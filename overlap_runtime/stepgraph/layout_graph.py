"""The pipeline graph of a pp x (dp x cp x ep) layout with every stage action expanded into its
layers' ops, for all ranks or for one representative rank per pipeline coordinate.

The pipeline graph (:func:`overlap_runtime.schedules.compile_spec`) has one rank per pipeline
coordinate. A layout runs ``inner = world / pp`` ranks at each coordinate (data, context and
expert parallel peers); rank ``g = pp_rank * inner + i`` (the trainer's order: pp outermost).
:func:`layout_graph` copies the pipeline program to each inner index ``i`` (SEND/RECV keys and
peers shifted to the same ``i`` of the peer stage) and expands each F/B/I/W task into the
priced :class:`~.layer_program.LayerOp` chain ``ops_of(task)`` returns:

* a compute op runs on the task's own lane (``compute``, or ``fwd``/``bwd`` in an OVERLAP_B_F
  step, which share the device), costing ``op.cost``;
* a communication op (``op.group`` = ``"ep"``, ``"cp"``...) is a collective on lane
  ``comm:<group>`` of the group of ``op.group_size`` consecutive inner ranks (expert and context
  parallel groups are innermost in the trainer's meshes), costing ``op.cost`` (priced by the
  group's real size and placement, :class:`~overlap_runtime.stepgraph.costs.MachineProfile`).

Op tasks carry ``meta`` of their action plus ``action_lane`` (``fwd``/``bwd`` inside an
OVERLAP_B_F step) and ``op`` (the op's name). The ops of one task are chained by ``program`` edges (each waits for the previous, and a
collective meets its peers after their previous op: rendezvous semantics), and the task's
incoming and outgoing edges attach to the first and last op.

**Symmetry reduction** (``representative=True``): the ranks of one pipeline coordinate run the
same program with the same costs, so their timelines are identical; only ``i = 0`` is built, and
each of its collectives is a group of one (its cost still that of the full group). The ranks of
one pipeline stage being alike is an assumption of the cost model (balanced routing, equal
shards); the full graph (``representative=False``) checks the reduction on small layouts.
"""

from __future__ import annotations

from typing import Callable, Hashable

from overlap_runtime.graph._gc import gc_paused
from overlap_runtime.graph.task_graph import TaskGraph
from overlap_runtime.graph.tasks import CommInfo, Task
from overlap_runtime.schedules.overlap_order import BACKWARD, comm_turns

from .layer_program import LayerOp


def priced_op(name: str, kind: str, cost: float, group: str | None = None,
              group_size: int = 1, join: str | None = None,
              program_only: bool = False) -> LayerOp:
    """A priced :class:`~.layer_program.LayerOp` built directly (no layer program behind it):
    ``name`` (shown in traces), ``kind`` (its task's kind, the cost-model key), ``cost``
    (seconds), for communication the ``group`` name and ``group_size``. ``join``: a
    non-blocking message (the MoE combine): it forks from the op before it and the next op
    named ``join`` waits for it (the shared expert runs meanwhile); None: blocking.
    ``program_only``: a leading op that only the program order waits for (the runtime's own
    work between two program steps): the task's inputs go to the op after it, so it overlaps
    the wait for them."""
    return LayerOp(name, "compute" if group is None else "collective", group,  # type: ignore[arg-type]
                   cost=float(cost), task_kind=kind, group_size=group_size, join=join,
                   program_only=program_only)


@gc_paused
def layout_graph(pipeline: TaskGraph, ops_of: Callable[[Task], list[LayerOp]], *, inner: int,
                 representative: bool, message_cost: Callable[[Task], float] | None = None,
                 async_p2p: bool = True, per_rank: bool = False,
                 name: str = "step") -> TaskGraph:
    """Expand ``pipeline`` (ranks = pipeline ranks) over ``inner`` ranks per coordinate.

    Args:
        pipeline: the compiled pipeline graph (F/B/I/W tasks carry ``meta['stage']``).
        ops_of: the priced op chain of one F/B/I/W task (empty: the task stays one compute
            task); an op without a ``cost`` raises ValueError naming it.
        inner: ranks per pipeline coordinate (``world / pp``).
        representative: build inner index 0 only (see the module doc).
        message_cost: cost of a SEND (RECVs cost nothing); None keeps the tasks' own hints.
        async_p2p: pipeline messages as the runtime issues them (``isend`` / early ``irecv``):
            each SEND on a lane per peer (messages to one peer share its link), each RECV on a
            lane of its own per peer, no program order between messages; a RECV then completes
            with its SEND and blocks only its consumer. False keeps the schedule compiler's one
            in-order ``comm:pp`` lane per rank, where a RECV still in flight holds up the SENDs
            behind it (docs/schedules.md section 9).
        per_rank: call ``ops_of`` once per global rank (the task's ``rank`` set to it), for
            costs measured per rank; default once per pipeline task (ranks alike).
    """
    if inner < 1:
        raise ValueError(f"inner={inner} must be >= 1 (ranks per pipeline coordinate)")
    indices = [0] if representative else list(range(inner))
    out = TaskGraph(name)
    tasks: list[Task] = []
    program: list[tuple[Hashable, Hashable]] = []
    first: dict[tuple[int, Hashable], Hashable] = {}
    last: dict[tuple[int, Hashable], Hashable] = {}
    cache: dict[Hashable, list[LayerOp]] = {}
    p2p_ids: set[Hashable] = set()
    first_data: dict[tuple[int, Hashable], Hashable] = {}
    chains: dict[tuple[int, int, int | None, str], list[tuple[Hashable, bool]]] = {}
    for t in pipeline.tasks():
        for i in indices:
            g = t.rank * inner + i
            tid = (g, t.id)
            if t.comm is not None:
                c = t.comm
                peer = None if c.peer is None else c.peer * inner + i
                cost = t.cost
                if message_cost is not None:
                    cost = message_cost(t) if c.op == "send" else 0.0
                lane = t.lane
                if async_p2p and c.peer is not None:
                    lane = f"comm:pp{'>' if c.op == 'send' else '<'}{peer}"
                    p2p_ids.add(t.id)
                tasks.append(t._replace(id=tid, rank=g, cost=cost, lane=lane,
                                        comm=c._replace(key=(i, c.key), peer=peer)))
                first[(i, t.id)] = last[(i, t.id)] = tid
                continue
            ckey = (t.id, g) if per_rank else t.id
            ops = cache.get(ckey)
            if ops is None:
                ops = cache[ckey] = ops_of(t._replace(rank=g) if per_rank else t)
                unpriced = [op.name for op in ops if op.cost is None]
                if unpriced:
                    raise ValueError(f"layout_graph: ops {unpriced} of {t.text} have no cost "
                                     f"(price them first)")
            if not ops:
                tasks.append(t._replace(id=tid, rank=g))
                first[(i, t.id)] = last[(i, t.id)] = tid
                continue
            prev: Hashable | None = None
            chain: list[tuple[Hashable, bool]] = []
            joins: dict[str, list[Hashable]] = {}
            chains[(i, t.rank, t.step, t.lane)] = chain
            for j, op in enumerate(ops):
                oid = tid if j == len(ops) - 1 else (g, t.id, j)
                label = f"{t.text}.{op.name}"
                meta = {**t.meta, "action_lane": t.lane, "op": op.name}
                if op.group is None:
                    task = Task(oid, g, t.lane, op.task_kind or op.kind, cost=op.cost,
                                step=t.step, label=label, meta=meta)
                else:
                    gid = i // op.group_size if not representative else 0
                    key = f"{op.group}:{t.rank}:{gid}" if not representative else \
                        f"{op.group}:{g}"
                    task = Task(oid, g, f"comm:{op.group}", op.task_kind or op.kind,
                                cost=op.cost,
                                comm=CommInfo("collective", key), step=t.step, label=label,
                                meta=meta)
                tasks.append(task)
                chain.append((oid, op.group is not None))
                if prev is not None:
                    program.append((prev, oid))
                else:
                    first[(i, t.id)] = oid
                if (i, t.id) not in first_data and not op.program_only:
                    first_data[(i, t.id)] = oid
                if op.name in joins:
                    program.extend((x, oid) for x in joins.pop(op.name))
                if op.join is not None and j < len(ops) - 1:
                    joins.setdefault(op.join, []).append(oid)  # forked: prev stays the tail
                    if prev is None:
                        prev = oid
                    continue
                prev = oid
            for waiting in joins.values():  # a join target that never came: join the tail
                program.extend((x, prev) for x in waiting if x != prev)
            joins.clear()
            last[(i, t.id)] = prev  # type: ignore[assignment]
    out.add_tasks(tasks)
    for kind in ("program", "data", "match"):
        edges = []
        for u, v, _ in pipeline.edges(kind):
            if kind == "program" and u in p2p_ids and v in p2p_ids:
                continue  # async p2p: no order between messages (see the docstring)
            entry = first if kind == "program" else first_data
            for i in indices:
                edges.append((last[(i, u)], entry.get((i, v), first[(i, v)])))
        if kind == "program":
            edges.extend(program)
            for (i, r, step, lane), fwd in chains.items():
                bwd = chains.get((i, r, step, "bwd")) if lane == "fwd" else None
                if bwd:
                    edges.extend(handover_edges(fwd, bwd))
        out.add_edges(edges, kind)
    out.programs = {r * inner: cells for r, cells in pipeline.programs.items()}
    return out


def handover_edges(fwd: list[tuple[Hashable, bool]], bwd: list[tuple[Hashable, bool]]
                   ) -> list[tuple[Hashable, Hashable]]:
    """Edges of the HookCoordinator's comm token between the two threads of an OVERLAP_B_F
    step (``coordinator/coordinator.py``): ``fwd`` / ``bwd`` are the op chains of its forward
    and backward sub-actions as ``(id, is_comm)``.

    * The token alternates, backward first (``schedules.overlap_order.comm_turns``): the k-th
      comm region of one side starts after the previous region of the other side ended.
    * A side's compute after a comm region waits until the peer launched its next comm, i.e.
      finished the op before it (the COMPUTE hook's wait), so each comm is hidden behind the
      peer's compute rather than both sides computing at once.

    A side that runs out of comm regions departs: the other drains alone.
    """
    def comms(chain: list[tuple[Hashable, bool]]) -> list[int]:
        return [j for j, (_, c) in enumerate(chain) if c]

    cf, cb = comms(fwd), comms(bwd)
    order: list[tuple[list[tuple[Hashable, bool]], int, list[tuple[Hashable, bool]], list[int]]] = [
        (bwd, cb[k], fwd, cf) if side == BACKWARD else (fwd, cf[k], bwd, cb)
        for side, k in comm_turns(len(cb), len(cf))]
    edges: list[tuple[Hashable, Hashable]] = []
    for (a_chain, a_j, _, _), (b_chain, b_j, _, _) in zip(order, order[1:]):
        edges.append((a_chain[a_j][0], b_chain[b_j][0]))  # token hand-over
    for n, (chain, j, peer, peer_comms) in enumerate(order):
        if j + 1 >= len(chain) or chain[j + 1][1]:
            continue
        nxt = next((x for x in order[n + 1:] if x[0] is peer), None)
        if nxt is None or nxt[1] == 0:
            continue
        edges.append((peer[nxt[1] - 1][0], chain[j + 1][0]))  # compute after the peer launched
    return edges
