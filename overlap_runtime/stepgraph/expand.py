"""The one expansion of a pipeline graph into op tasks on the ranks of a layout.

:func:`expand` copies the pipeline graph (``schedules.compile_spec``: one program per pp rank)
onto the global ranks of a :class:`~overlap_runtime.config.layout.Layout` (rank
``g = pp * inner + i``, pp outermost; ``inner = world / pp``) and expands each F/B/I/W task
into the op chain an *op source* gives for it on that rank: ``ops_of(task, rank)`` ->
``(layer, LayerOp)`` pairs (``layer`` None for an op of no decoder layer). The default source
is the layer program (:func:`~.compose.layer_ops`, unpriced: a pass prices the graph later,
``stepgraph.pricing``); a caller may give priced ops instead (``stepgraph.scale.priced_ops``,
``stepgraph.predict.measured_ops``). The ops of one task are all priced (``cost`` set) or none
(ValueError naming the unpriced ones otherwise)::

    task ids   (rank, "1F3", k)     k-th op of action 1F3 on global rank ``rank``
               (rank, "0SEND_F1")   pipeline messages
    lanes      compute / fwd / bwd  the action's lane (fwd, bwd: the two threads of OVERLAP_B_F)
               comm:<group>         an op's group (cp, ep, cp_a2a, cp_ring; host: the runtime's
                                    own work between program steps, measured)
               comm:pp              pipeline SEND/RECV, between ranks of equal (dp, cp)

Collectives carry the group instance as their key (``ep[0,1]``: its global ranks), so the
validator checks that every member issues them in one order; send/receive pairs carry
``(action, layer, message, src, dst)``. Point-to-point messages and a message with a ``join``
(the MoE combine joins ``moe.combine_wait``, so the shared expert runs beside it) are
non-blocking: they fork from the op before them and join the next compute op, or the op named
``join`` (a receive of the GDN state chain joins the compute op after the next one, and the
chain's send: the local prepare + summary, or the local backward, runs while the state is on
its way); the other ops block their thread. An op with ``program_only`` (leading) gets only the
action's program edge: its data inputs go to the op after it. Task ``meta``: ``action``,
``layer``, ``op`` (the :class:`~.layer_program.LayerOp`), ``action_lane`` (the lane of the
pipeline action), ``flops`` (compute). A compound step (OVERLAP_B_F) follows the
HookCoordinator when ``coordinated`` (:mod:`.overlap_edges`), else its sub-actions run one
after the other.

**Symmetry reduction** (``representative=True``): the ranks of one pipeline coordinate run the
same program with the same costs, so their timelines are identical; only inner index 0 is
built, and each of its collectives is a group of one (``ep[0]``) whose cost is still that of
the full group (the op source priced it by the group's size). A point-to-point op has no peer
there: the op source must price it as a wait of its group (``scale.priced_ops``), else
ValueError. That the ranks of one stage are alike is an assumption of the cost model
(balanced routing, equal shards); ``representative=False`` checks it on small layouts.

Simulation view (both off for the conformance graph, whose lanes and edges are what the
recorder can observe): ``async_p2p`` puts each pipeline SEND on a lane per peer and each RECV
on a lane of its own per peer with no program order between messages, as the runtime's
``isend`` / early ``irecv`` complete (off: one in-order ``comm:pp`` lane per rank, the launch
order); ``hook_waits`` adds the coordinator's COMPUTE-hook waits (:mod:`.overlap_edges`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

from overlap_runtime.graph._gc import gc_paused
from overlap_runtime.graph.task_graph import TaskGraph
from overlap_runtime.graph.tasks import CommInfo, Task

from .layer_program import LayerOp
from .overlap_edges import overlap_edges

if TYPE_CHECKING:
    from overlap_runtime.config.layout import Layout

#: An op source: the ``(layer, op)`` chain of pipeline task ``task`` (F/B/I/W, ``task.rank``
#: its pp rank, ``meta['stage']`` its stage) on global rank ``rank``.
OpSource = Callable[[Task, int], Sequence[tuple["int | None", LayerOp]]]
#: Actions per global rank: ``{"1F3": [(rank, "1F3", 0), ...]}`` in program order.
Actions = dict[int, dict[str, list[Hashable]]]

COMPUTE_KINDS = ("F", "B", "I", "W")


def group_key(name: str, ranks: list[int] | tuple[int, ...]) -> str:
    """The key of one group instance: ``cp[0,1]`` (its sorted global ranks)."""
    return f"{name}[{','.join(str(r) for r in sorted(ranks))}]"


def rank_groups(dims: "Layout", rank: int) -> dict[str, tuple[str, list[int]]]:
    """``{"cp"|"ep"|"host"(|"cp_a2a"|"cp_ring"): (group key, member global ranks in group-rank
    order)}`` of global ``rank``: CP groups are the ``cp`` consecutive ranks of one (pp, dp),
    EP groups ``ep`` consecutive ranks of one dp_shard x cp block, ``host`` the rank alone; the
    two hierarchical CP groups when ``dims.cp_a2a`` is set (cp rank = ring index x a2a + a2a
    index: ``cp_a2a`` the ``a`` ranks of one ring index, ``cp_ring`` the ranks ``a`` apart)."""
    c = dims.coordinates(rank)
    base = rank - c["cp"]
    cp = list(range(base, base + dims.cp))
    e0 = rank - (c["dp_shard"] * dims.cp + c["cp"]) % dims.ep
    ep = list(range(e0, e0 + dims.ep))
    out = {"cp": (group_key("cp", cp), cp), "ep": (group_key("ep", ep), ep),
           "host": (group_key("host", [rank]), [rank])}
    if dims.cp_a2a:
        a = dims.cp_a2a
        inner = list(range(base + c["cp"] // a * a, base + c["cp"] // a * a + a))
        outer = list(range(base + c["cp"] % a, base + dims.cp, a))
        out["cp_a2a"] = (group_key("cp_a2a", inner), inner)
        out["cp_ring"] = (group_key("cp_ring", outer), outer)
    return out


def pp_peer(dims: "Layout", rank: int, pp: int) -> int:
    """The global rank with pipeline coordinate ``pp`` and ``rank``'s other coordinates."""
    return pp * (dims.world_size // dims.pp) + rank % (dims.world_size // dims.pp)


def _message_name(op_name: str) -> str:
    """The name both ends of a message share: ``gdn.chain.send_H`` / ``recv_H`` -> ``msg_H``."""
    return re.sub(r"\b(send|recv)", "msg", op_name)


def _is_chain(op: LayerOp, kind: str) -> bool:
    """A message of the GDN state chain (``gdn.chain.recv_H`` ...): its receive is waited
    after the rank's next compute op (the local prepare + summary, or the local backward, run
    while the state is on its way) and before its send (the state out is the state in,
    carried one rank on)."""
    return op.kind == kind and ".chain." in op.name


class _Expander:
    """The state of one :func:`expand` call (module doc): tasks, edges and entry points."""

    def __init__(self, dims: "Layout", ops_of: OpSource, representative: bool) -> None:
        self.dims, self.ops_of, self.representative = dims, ops_of, representative
        self.tasks: list[Task] = []
        self.program: list[tuple[Hashable, Hashable]] = []
        self.first: dict[tuple[int, str], Hashable] = {}
        self.first_data: dict[tuple[int, str], Hashable] = {}
        self.last: dict[tuple[int, str], Hashable] = {}
        self.alone: dict[tuple[str, int], str] = {}  # representative: (group, rank) -> key

    def comm_task(self, rank: int, groups: dict[str, tuple[str, list[int]]], t: Task,
                  tid: Hashable, layer: int | None, op: LayerOp, meta: dict, label: str
                  ) -> Task:
        text = str(t.id)
        if op.group not in groups:
            raise ValueError(f"{label}: op group {op.group!r} is not a group of the layout "
                             f"(known: {sorted(groups)})")
        gkey, members = groups[op.group]
        if op.kind == "collective":
            if self.representative:
                gkey = self.alone.get((op.group, rank))
                if gkey is None:
                    gkey = self.alone[(op.group, rank)] = group_key(op.group, [rank])
            elif op.group_size not in (1, len(members)):
                raise ValueError(f"{label}: priced for a group of {op.group_size} but its "
                                 f"{op.group} group {gkey} has {len(members)} ranks")
            info = CommInfo("collective", gkey, None, op.nbytes)
            kind = op.task_kind or f"{op.collective}:L{layer}.{op.name}"
        else:
            if self.representative:
                raise ValueError(f"{label}: a {op.kind} to a peer has no peer in a "
                                 f"representative expansion (one rank per pipeline "
                                 f"coordinate); price it as a wait of its group first "
                                 f"(stepgraph.scale.priced_ops)")
            me = members.index(rank)
            peer = members[(me + op.peer) % len(members)]  # type: ignore[operator]
            src, dst = (rank, peer) if op.kind == "send" else (peer, rank)
            info = CommInfo(op.kind, (text, layer, _message_name(op.name), src, dst), peer,
                            op.nbytes)
            kind = op.task_kind or op.kind
        return Task(tid, rank, f"comm:{op.group}", kind, cost=op.cost, comm=info, step=t.step,
                    label=label, meta=meta)

    def action(self, rank: int, groups: dict[str, tuple[str, list[int]]], t: Task,
               ops: Sequence[tuple[int | None, LayerOp]]) -> list[Hashable]:
        """Append the op tasks of pipeline action ``t`` on ``rank`` and their program edges."""
        text = str(t.id)
        if not ops:
            raise ValueError(f"r{rank}:{text}: the op source gave no ops")
        unpriced = [op.name for _, op in ops if op.cost is None]
        if unpriced and len(unpriced) < len(ops):
            raise ValueError(f"r{rank}:{text}: ops {unpriced} of {text} have no cost (price "
                             f"them first: every op of a task priced, or none)")
        ids: list[Hashable] = [(rank, text, k) for k in range(len(ops))]
        key = (rank, text)
        self.first[key], self.last[key] = ids[0], ids[-1]
        program = self.program
        prev_sync: Hashable | None = None
        pending: list[Hashable] = []
        chain_in: list[tuple[Hashable, bool]] = []  # (chain receive, compute seen)
        joins: dict[str, list[Hashable]] = {}
        for k, (layer, op) in enumerate(ops):
            tid = ids[k]
            label = (f"r{rank}:{text}.L{layer}.{op.name}" if layer is not None
                     else f"r{rank}:{text}.{op.name}")
            if not op.is_comm:
                self.tasks.append(Task(tid, rank, t.lane, op.task_kind or op.name,
                                       cost=op.cost, step=t.step, label=label,
                                       meta={"action": text, "layer": layer, "op": op,
                                             "action_lane": t.lane, "flops": op.flops}))
            else:
                meta = {"action": text, "layer": layer, "op": op, "action_lane": t.lane}
                self.tasks.append(self.comm_task(rank, groups, t, tid, layer, op, meta, label))
            if key not in self.first_data and not op.program_only:
                self.first_data[key] = tid
            if op.kind in ("send", "recv") or op.join is not None:
                if prev_sync is not None:
                    program.append((prev_sync, tid))
                if op.join is not None:
                    joins.setdefault(op.join, []).append(tid)
                elif _is_chain(op, "recv"):
                    chain_in.append((tid, False))
                else:
                    if _is_chain(op, "send"):  # the state out needs the state in
                        program.extend((r, tid) for r, _ in chain_in)
                    pending.append(tid)
                continue
            if prev_sync is not None:
                program.append((prev_sync, tid))
            if not op.is_comm:
                program.extend((p, tid) for p in pending)
                program.extend((r, tid) for r, seen in chain_in if seen)
                pending = []
                chain_in = [(r, True) for r, seen in chain_in if not seen]
            program.extend((x, tid) for x in joins.pop(op.name, ()))
            prev_sync = tid
        tail = pending + [r for r, _ in chain_in] + [x for xs in joins.values() for x in xs]
        for p in tail:  # still in flight at the end: the action's last op waits for them
            if p != ids[-1]:
                program.append((p, ids[-1]))
            elif prev_sync is not None:
                program.append((prev_sync, p))
        return ids


@gc_paused
def expand(pipe: TaskGraph, dims: "Layout", ops_of: OpSource, *, coordinated: bool,
           representative: bool = False, message_bytes: int | None = None,
           message_cost: Callable[[Task], float] | None = None, async_p2p: bool = False,
           hook_waits: bool = False, name: str = "step") -> tuple[TaskGraph, Actions]:
    """Expand ``pipe`` (ranks = pipeline ranks) over the ranks of ``dims`` (module doc).

    Args:
        pipe: the compiled pipeline graph (F/B/I/W tasks carry ``meta['stage']``).
        dims: the layout (its ``pp`` is the pipeline's).
        ops_of: the op source (module doc).
        coordinated: an OVERLAP_B_F step runs its two sides on two threads under the
            HookCoordinator (``overlap_b_f`` and ``ep > 1``); False: one after the other.
        representative: build inner index 0 only (symmetry reduction, module doc).
        message_bytes: bytes of one pipeline message (``CommInfo.nbytes``).
        message_cost: seconds of a pipeline SEND (its RECV then costs 0); None: unpriced.
        async_p2p, hook_waits: the simulation view (module doc).

    Returns:
        The task graph and, per built rank, its actions' op task ids in program order.
    """
    if dims.world_size % dims.pp:
        raise ValueError(f"world {dims.world_size} is not a multiple of pp={dims.pp}")
    inner = dims.world_size // dims.pp
    ranks = [pp * inner for pp in range(dims.pp)] if representative else \
        list(range(dims.world_size))
    ex = _Expander(dims, ops_of, representative)
    p2p_ids: set[Hashable] = set()
    actions: Actions = {}
    by_pp: dict[int, list[Task]] = {}
    for t in sorted(pipe.tasks(), key=lambda t: (t.rank, t.step if t.step is not None else 0)):
        by_pp.setdefault(t.rank, []).append(t)
    for rank in ranks:
        c = dims.coordinates(rank)
        groups = rank_groups(dims, rank)
        acts: dict[str, list[Hashable]] = {}
        by_step: dict[int, list[Task]] = {}
        for t in by_pp.get(c["pp"], []):
            by_step.setdefault(t.step if t.step is not None else -1, []).append(t)
        for step in sorted(by_step):
            expanded: dict[str, tuple[Task, list[Hashable], list[LayerOp]]] = {}
            for t in by_step[step]:
                text = str(t.id)
                if t.kind not in COMPUTE_KINDS:  # pipeline SEND/RECV
                    cm = t.comm
                    assert cm is not None, t
                    d, src_stage, mb = cm.key
                    peer = pp_peer(dims, rank, cm.peer)  # type: ignore[arg-type]
                    key = ("pp", c["dp_replicate"], c["dp_shard"], c["cp"], d, src_stage, mb)
                    lane = t.lane
                    if async_p2p:
                        lane = f"comm:pp{'>' if cm.op == 'send' else '<'}{peer}"
                        p2p_ids.add(t.id)
                    cost = None if message_cost is None else \
                        (message_cost(t) if cm.op == "send" else 0.0)
                    tid = (rank, text)
                    ex.tasks.append(Task(tid, rank, lane, t.kind, cost=cost, comm=CommInfo(
                        cm.op, key, peer, message_bytes), step=step, label=f"r{rank}:{text}",
                        meta={"action": text, "action_lane": t.lane}))
                    ex.first[(rank, text)] = ex.first_data[(rank, text)] = \
                        ex.last[(rank, text)] = tid
                    acts[text] = [tid]
                    continue
                ops = ops_of(t, rank)
                acts[text] = ex.action(rank, groups, t, ops)
                expanded[text] = (t, acts[text], [op for _, op in ops])
            if len(expanded) == 2 and not coordinated:  # sub-actions run in order, one thread
                a, b = list(expanded)
                ex.program.append((ex.last[(rank, a)], ex.first[(rank, b)]))
            elif len(expanded) == 2:  # OVERLAP_B_F: the coordinator's protocol
                sides = {("fwd" if t.kind == "F" else "bwd"): list(zip(ids, ops))
                         for t, ids, ops in expanded.values()}
                chain, waits = overlap_edges(sides["fwd"], sides["bwd"],
                                             hook_waits=hook_waits)
                ex.program.extend(zip(chain, chain[1:]))
                ex.program.extend(waits)
                _reorder(ex.tasks, chain)
        actions[rank] = acts
    graph = TaskGraph(name)
    graph.add_tasks(ex.tasks)
    graph.add_edges([e for e in ex.program if e[0] != e[1]], "program")
    _pipeline_edges(graph, pipe, dims, ranks, ex, p2p_ids)
    graph.programs = {r: list(pipe.programs.get(dims.coordinates(r)["pp"], [])) for r in ranks}
    return graph, actions


def _reorder(tasks: list[Task], chain: list[Hashable]) -> None:
    """Put the chained all-to-alls of an OVERLAP_B_F step in launch order in ``tasks`` (the
    validator matches collectives of a group by their order of insertion within a step)."""
    where = {t.id: i for i, t in enumerate(tasks)}
    slots = sorted(where[c] for c in chain)
    moved = [tasks[where[c]] for c in chain]
    for i, t in zip(slots, moved):
        tasks[i] = t


def _pipeline_edges(graph: TaskGraph, pipe: TaskGraph, dims: "Layout", ranks: list[int],
                    ex: _Expander, p2p_ids: set[Hashable]) -> None:
    """The pipeline graph's edges on every built rank: ``u -> v`` becomes last op of ``u`` ->
    first op of ``v`` (a data or match edge: its first op that is not ``program_only``); an
    edge across pp ranks joins the ranks of equal (dp, cp). With ``p2p_ids`` (async_p2p) the
    program edges between two pipeline messages are left out."""
    of_pp: dict[int, list[int]] = {}
    for r in ranks:
        of_pp.setdefault(r * dims.pp // dims.world_size, []).append(r)
    for kind in ("program", "data", "match"):
        entry = ex.first if kind == "program" else ex.first_data
        edges: list[tuple[Hashable, Hashable]] = []
        for u, v, _ in pipe.edges(kind):
            if kind == "program" and u in p2p_ids and v in p2p_ids:
                continue
            ru, rv = pipe.task(u).rank, pipe.task(v).rank
            for rank in of_pp.get(ru, []):
                other = rank if ru == rv else pp_peer(dims, rank, rv)
                a, b = ex.last.get((rank, str(u))), entry.get((other, str(v)))
                if a is not None and b is not None:
                    edges.append((a, b))
        graph.add_edges(edges, kind)
