"""``compile_step(config) -> StepGraph``: one task graph for one training step, on every rank.

The pipeline graph of the configured schedule (``schedules.compile_spec``, one program per pp
rank; pp == 1: one stage, ``0F0`` then ``0B0`` over the whole batch) is copied onto every
global rank of the layout (``ParallelDims.coordinates``) and each compute task (F/B/I/W) is
expanded into its stage's layer ops (:func:`~.layer_program.stage_program`) on that rank::

    task ids   (rank, "1F3", k)     k-th op of action 1F3 on global rank ``rank``
               (rank, "0SEND_F1")   pipeline messages
    lanes      compute / fwd / bwd  the action's lane (fwd, bwd: the two threads of OVERLAP_B_F)
               comm:cp, comm:ep     context-parallel and expert all-to-all messages
               comm:cp_a2a/cp_ring  hierarchical attention CP's inner a2a / outer ring
               comm:pp              pipeline SEND/RECV, between ranks of equal (dp, cp)

Collectives carry the group instance as their key (``ep[0,1]``: its global ranks), so the
validator checks that every member issues them in one order; send/receive pairs carry
``(action, layer, message, src, dst)``. Point-to-point messages and the MoE combine are
non-blocking in the runtime: they fork from the op before them and join the next compute op
(the combine joins ``moe.combine_wait``, so the shared expert runs beside it; a receive of the
GDN state chain joins the compute op after the next one, and the chain's send: the local
prepare + summary, or the local backward, runs while the state is on its way); the other
collectives block their thread. In an OVERLAP_B_F step the expert all-to-alls of both sides are
emitted in the HookCoordinator's launch order (backward side first, then alternating comm
regions) and chained on ``comm:ep``: one all-to-all in flight per EP group. Without the
coordinator (no ``overlap_b_f`` or no EP) a compound step's sub-actions run one after the other.

Outside the graph: FSDP2's unshard / reduce-scatter (``GatheredStep``: one unshard and one
reduce per step for pp > 1, per layer for pp == 1; they run inside torch's FSDP, not through
``ops.comm``), the pipeline's one-time metadata exchange, the loss / grad-norm all-reduces
after the step. Simplification: any other receive joins the next compute op, which may be
earlier than the runtime's wait.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

from overlap_runtime.config.layout import split_layers
from overlap_runtime.config.train import schedule_spec
from overlap_runtime.graph import CommInfo, Task, TaskGraph
from overlap_runtime.graph.validate import CommMatching
from overlap_runtime.schedules import compile_spec
from overlap_runtime.schedules.overlap_order import BACKWARD, comm_turns

from .layer_program import LayerOp, MicrobatchShape, microbatch_shape, stage_program

if TYPE_CHECKING:
    from overlap_runtime.config.layout import Layout as ParallelDims
    from overlap_runtime.config.train import TrainConfig

_COMPUTE_KINDS = ("F", "B", "I", "W")


def group_key(name: str, ranks: list[int] | tuple[int, ...]) -> str:
    """The key of one group instance: ``cp[0,1]`` (its sorted global ranks)."""
    return f"{name}[{','.join(str(r) for r in sorted(ranks))}]"


def _message_name(op_name: str) -> str:
    """The name both ends of a message share: ``gdn.chain.send_H`` / ``recv_H`` -> ``msg_H``."""
    return re.sub(r"\b(send|recv)", "msg", op_name)


@dataclass
class StepGraph:
    """The step's task graph plus what it was built from.

    ``graph``: the :class:`~overlap_runtime.graph.TaskGraph`; ``dims``: the layout;
    ``shape``: the microbatch per rank; ``actions[rank]``: per global rank, the pipeline actions
    in program order with their op task ids (``{"1F3": [(rank, "1F3", 0), ...]}``);
    ``stage_layers``: decoder layers of each stage.
    """

    config: "TrainConfig"
    dims: "ParallelDims"
    shape: MicrobatchShape
    graph: TaskGraph
    actions: dict[int, dict[str, list[Hashable]]]
    stage_layers: list[list[int]]
    matching: CommMatching | None = None
    build_s: float = 0.0
    validate_s: float = field(default=0.0)

    def validate(self) -> CommMatching:
        """Prove the step deadlock-free (``graph.validate_graph``): every message matched, one
        collective order per group, no cycle under blocking communication."""
        t0 = time.perf_counter()
        self.matching = self.graph.validate()
        self.validate_s = time.perf_counter() - t0
        return self.matching

    def summary(self) -> str:
        return (f"step graph: {len(self.graph)} tasks, {self.graph.num_edges()} edges on "
                f"{len(self.dims_ranks())} ranks (built in {self.build_s:.2f}s, validated in "
                f"{self.validate_s:.2f}s)")

    def dims_ranks(self) -> list[int]:
        return list(range(self.dims.world_size))

    def comm_tasks(self, rank: int, action: str) -> list[Task]:
        """The communication tasks of ``action`` on ``rank``, in issue order."""
        return [t for t in (self.graph.task(i) for i in self.actions[rank].get(action, []))
                if t.comm is not None]


def stage_layers_of(config: "TrainConfig", num_stages: int) -> list[list[int]]:
    return [list(r) for r in split_layers(config.model.num_hidden_layers, num_stages,
                                          config.train.pipeline.layers_per_stage)]


def _groups(dims: "ParallelDims") -> dict[int, dict[str, tuple[str, list[int]]]]:
    """rank -> {"cp"|"ep"(|"cp_a2a"|"cp_ring"): (group key, member global ranks in group-rank
    order)}; the two hierarchical CP groups when ``dims.cp_a2a`` is set."""
    coords = [dims.coordinates(r) for r in range(dims.world_size)]
    out: dict[int, dict[str, tuple[str, list[int]]]] = {}
    for r, c in enumerate(coords):
        cp = [q for q, d in enumerate(coords) if all(d[k] == c[k] for k in
                                                      ("pp", "dp_replicate", "dp_shard"))]
        ep = [q for q, d in enumerate(coords) if d["pp"] == c["pp"] and
              d["dp_replicate"] == c["dp_replicate"] and d["efsdp"] == c["efsdp"]]
        ep.sort(key=lambda q: coords[q]["ep"])
        out[r] = {"cp": (group_key("cp", cp), cp), "ep": (group_key("ep", ep), ep)}
        if dims.cp_a2a:  # hierarchical attention CP: cp rank = ring index * a2a + a2a index
            a = dims.cp_a2a
            inner = [q for q in cp if coords[q]["cp"] // a == c["cp"] // a]
            outer = [q for q in cp if coords[q]["cp"] % a == c["cp"] % a]
            inner.sort(key=lambda q: coords[q]["cp"])
            outer.sort(key=lambda q: coords[q]["cp"])
            out[r]["cp_a2a"] = (group_key("cp_a2a", inner), inner)
            out[r]["cp_ring"] = (group_key("cp_ring", outer), outer)
    return out


def _pp_peer(dims: "ParallelDims", rank: int, pp: int) -> int:
    """The global rank with pipeline coordinate ``pp`` and ``rank``'s other coordinates."""
    c = dims.coordinates(rank)
    return ((pp * dims.dp_replicate + c["dp_replicate"]) * dims.dp_shard
            + c["dp_shard"]) * dims.cp + c["cp"]


def pipeline_graph(config: "TrainConfig") -> Any:
    """The per-pp-rank pipeline graph: ``compile_spec`` (pp > 1) or ``0F0 -> 0B0``."""
    if config.train.accelerator.pp > 1:
        return compile_spec(schedule_spec(config)).graph
    g = TaskGraph("pp1")
    g.add_tasks([Task("0F0", 0, "compute", "F", step=0, meta={"stage": 0, "microbatch": 0}),
                 Task("0B0", 0, "compute", "B", step=1, meta={"stage": 0, "microbatch": 0})])
    g.add_edges([("0F0", "0B0")], "data")
    g.add_edges([("0F0", "0B0")], "program")
    g.programs = {0: ["0F0", "0B0"]}
    return g


def _overlap_order(sides: dict[str, list[int]], ops: dict[str, list[LayerOp]]
                   ) -> list[tuple[str, int]]:
    """Launch order of the expert all-to-alls of one OVERLAP_B_F step: its comm regions (a
    dispatch's counts + tokens, or a combine) in the coordinator's turns
    (``schedules.overlap_order.comm_turns``)."""
    regions: dict[str, list[list[int]]] = {}
    for side, idxs in sides.items():
        out: list[list[int]] = []
        for i in idxs:
            if ops[side][i].name == "moe.dispatch" and out and \
                    ops[side][out[-1][-1]].name == "moe.dispatch_counts":
                out[-1].append(i)
            else:
                out.append([i])
        regions[side] = out
    b, f = regions.get("bwd", []), regions.get("fwd", [])
    order: list[tuple[str, int]] = []
    for side, k in comm_turns(len(b), len(f)):
        order += [("bwd", i) for i in b[k]] if side == BACKWARD else [("fwd", i) for i in f[k]]
    return order


def estimate_tasks(config: "TrainConfig") -> int:
    """About how many tasks :func:`compile_step` builds for ``config``: each pipeline rank's
    actions expanded into their ops (as on CP rank 0), times the ranks per pipeline rank. Cheap
    (no graph is built), so the trainer checks it before compiling."""
    dims = config.train.accelerator.layout()
    shape = microbatch_shape(config)
    pipe = pipeline_graph(config)
    num_stages = max((t.meta.get("stage", 0) for t in pipe.tasks() if t.meta), default=0) + 1
    stage_layers = stage_layers_of(config, num_stages)
    per_kind: dict[tuple[int, str], int] = {}
    total = 0
    for t in pipe.tasks():
        if t.kind not in _COMPUTE_KINDS:
            total += 1
            continue
        s = t.meta["stage"]
        key = (s, t.kind)
        if key not in per_kind:
            per_kind[key] = len(stage_program(config, stage_layers[s], t.kind, shape,  # type: ignore[arg-type]
                                              stage=s, first=s == 0, last=s == num_stages - 1))
        total += per_kind[key]
    return total * (dims.world_size // dims.pp)


def compile_step(config: "TrainConfig", *, validate: bool = True,
                 dims: "ParallelDims | None" = None) -> StepGraph:
    """The task graph of one training step of ``config`` on every rank (module doc).

    With ``validate`` the graph is proven deadlock-free before it is returned (raises a
    :class:`~overlap_runtime.graph.GraphValidationError` naming the tasks). ``dims``: the
    layout (default: ``config.train.accelerator.layout()``).
    """
    t0 = time.perf_counter()
    dims = dims if dims is not None else config.train.accelerator.layout()
    shape = microbatch_shape(config)
    pipe = pipeline_graph(config)
    num_stages = max((t.meta.get("stage", 0) for t in pipe.tasks() if t.meta), default=0) + 1
    stage_layers = stage_layers_of(config, num_stages)
    groups = _groups(dims)
    # the HookCoordinator runs the two sides of a compound step on two threads only with
    # overlap_b_f and EP (trainer.build); otherwise the sub-actions run in order
    coordinated = config.train.pipeline.overlap_b_f and dims.ep > 1
    coords = [dims.coordinates(r) for r in range(dims.world_size)]
    graph = TaskGraph(f"step {pipe.name} x {dims.describe()}")
    tasks: list[Task] = []
    program: list[tuple[Hashable, Hashable]] = []
    first: dict[tuple[int, str], Hashable] = {}
    last: dict[tuple[int, str], Hashable] = {}
    actions: dict[int, dict[str, list[Hashable]]] = {}
    pipe_tasks = sorted(pipe.tasks(), key=lambda t: (t.rank, t.step if t.step is not None else 0))
    for rank in range(dims.world_size):
        c = coords[rank]
        mine = [t for t in pipe_tasks if t.rank == c["pp"]]
        acts: dict[str, list[Hashable]] = {}
        by_step: dict[int, list[Task]] = {}
        for t in mine:
            by_step.setdefault(t.step if t.step is not None else -1, []).append(t)
        for step in sorted(by_step):
            expanded: dict[str, tuple[Task, list[LayerOp], list[int]]] = {}
            for t in by_step[step]:
                text = str(t.id)
                if t.kind not in _COMPUTE_KINDS:  # pipeline SEND/RECV
                    d, src_stage, mb = t.comm.key  # type: ignore[union-attr]
                    peer = _pp_peer(dims, rank, t.comm.peer)  # type: ignore[union-attr]
                    key = ("pp", c["dp_replicate"], c["dp_shard"], c["cp"], d, src_stage, mb)
                    tid = (rank, text)
                    tasks.append(Task(tid, rank, t.lane, t.kind, comm=CommInfo(
                        t.comm.op, key, peer, _pp_bytes(shape, config)),  # type: ignore[union-attr]
                        step=step, label=f"r{rank}:{text}", meta={"action": text}))
                    first[(rank, text)] = last[(rank, text)] = tid
                    acts[text] = [tid]
                    continue
                s = t.meta["stage"]
                ops = [op for _, op in stage_program(
                    config, stage_layers[s], t.kind, shape, cp_rank=c["cp"], stage=s,  # type: ignore[arg-type]
                    first=s == 0, last=s == num_stages - 1)]
                layers = [layer for layer, _ in stage_program(
                    config, stage_layers[s], t.kind, shape, cp_rank=c["cp"], stage=s,  # type: ignore[arg-type]
                    first=s == 0, last=s == num_stages - 1)]
                expanded[text] = (t, ops, layers)
            # emission: plain steps in op order; OVERLAP_B_F: the a2a in the coordinator's order
            for text, (t, ops, layers) in expanded.items():
                ids = [(rank, text, k) for k in range(len(ops))]
                acts[text] = list(ids)
                first[(rank, text)], last[(rank, text)] = ids[0], ids[-1]
                prev_sync: Hashable | None = None
                pending: list[Hashable] = []
                chain_in: list[tuple[Hashable, bool]] = []  # (chain receive, compute seen)
                combine: Hashable | None = None
                for k, op in enumerate(ops):
                    tid = ids[k]
                    if not op.is_comm:
                        tasks.append(Task(tid, rank, t.lane, op.name, step=step,
                                          label=f"r{rank}:{text}.L{layers[k]}.{op.name}",
                                          meta={"action": text, "layer": layers[k],
                                                "flops": op.flops, "op": op}))
                    else:
                        gkey, members = groups[rank][op.group]  # type: ignore[index]
                        if op.kind == "collective":
                            info = CommInfo("collective", gkey, None, op.nbytes)
                            kind = f"{op.collective}:L{layers[k]}.{op.name}"
                        else:
                            me = members.index(rank)
                            peer = members[(me + op.peer) % len(members)]  # type: ignore[operator]
                            src, dst = (rank, peer) if op.kind == "send" else (peer, rank)
                            info = CommInfo(op.kind, (text, layers[k], _message_name(op.name),
                                                      src, dst), peer, op.nbytes)
                            kind = op.kind
                        tasks.append(Task(tid, rank, f"comm:{op.group}", kind, comm=info,
                                          step=step,
                                          label=f"r{rank}:{text}.L{layers[k]}.{op.name}",
                                          meta={"action": text, "layer": layers[k], "op": op}))
                    asynchronous = op.kind in ("send", "recv") or op.name == "moe.combine"
                    if asynchronous:
                        if prev_sync is not None:
                            program.append((prev_sync, tid))
                        if op.name == "moe.combine":
                            combine = tid
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
                        if op.name == "moe.combine_wait" and combine is not None:
                            program.append((combine, tid))
                            combine = None
                    prev_sync = tid
                for p in pending + [r for r, _ in chain_in] + \
                        ([combine] if combine is not None else []):
                    program.append((p, ids[-1]) if p != ids[-1] else (prev_sync, p))
            if len(expanded) == 2 and not coordinated:  # sub-actions run in order, one thread
                (a, _), (b, _) = list(expanded.items())
                program.append((last[(rank, a)], first[(rank, b)]))
            elif len(expanded) == 2:  # OVERLAP_B_F: chain the expert all-to-alls in launch order
                sides = {}
                ops_by = {}
                for text, (t, ops, _) in expanded.items():
                    side = "fwd" if t.kind == "F" else "bwd"
                    ops_by[side] = ops
                    sides[side] = [k for k, op in enumerate(ops) if op.group == "ep"]
                    sides[side + "_text"] = text  # type: ignore[assignment]
                texts = {side: sides.pop(side + "_text") for side in ("fwd", "bwd")}
                order = _overlap_order(sides, ops_by)  # type: ignore[arg-type]
                chain = [(rank, texts[side], k) for side, k in order]  # type: ignore[index]
                program.extend(zip(chain, chain[1:]))
                _reorder(tasks, chain)
        actions[rank] = acts
    graph.add_tasks(tasks)
    graph.add_edges([e for e in program if e[0] != e[1]], "program")
    _pipeline_edges(graph, pipe, dims, coords, first, last)
    graph.programs = {r: list(pipe.programs.get(coords[r]["pp"], []))
                      for r in range(dims.world_size)}
    sg = StepGraph(config, dims, shape, graph, actions, stage_layers,
                   build_s=time.perf_counter() - t0)
    if validate:
        sg.validate()
    return sg


def _is_chain(op: LayerOp, kind: str) -> bool:
    """A message of the GDN state chain (``gdn.chain.recv_H`` ...): its receive is waited
    after the rank's next compute op (the local prepare + summary, or the local backward, run
    while the state is on its way) and before its send (the state out is the state in,
    carried one rank on)."""
    return op.kind == kind and ".chain." in op.name


def _reorder(tasks: list[Task], chain: list[Hashable]) -> None:
    """Put the chained all-to-alls of an OVERLAP_B_F step in launch order in ``tasks`` (the
    validator matches collectives of a group by their order of insertion within a step)."""
    where = {t.id: i for i, t in enumerate(tasks)}
    slots = sorted(where[c] for c in chain)
    moved = [tasks[where[c]] for c in chain]
    for i, t in zip(slots, moved):
        tasks[i] = t


def _pp_bytes(shape: MicrobatchShape, config: "TrainConfig") -> int:
    """One pipeline activation (or its gradient): ``[rows, local_len, hidden]``."""
    return shape.tokens * config.model.hidden_size * shape.dtype_bytes


def _pipeline_edges(graph: TaskGraph, pipe: Any, dims: "ParallelDims", coords: list[dict],
                    first: dict[tuple[int, str], Hashable],
                    last: dict[tuple[int, str], Hashable]) -> None:
    """The pipeline graph's edges on every copy: ``u -> v`` becomes last op of ``u`` -> first
    op of ``v``; an edge across pp ranks joins the ranks of equal (dp, cp)."""
    by_kind: dict[str, list[tuple[Hashable, Hashable]]] = {}
    for u, v, kind in pipe.edges():
        ru, rv = pipe.task(u).rank, pipe.task(v).rank
        for rank in range(dims.world_size):
            if coords[rank]["pp"] != ru:
                continue
            other = rank if ru == rv else _pp_peer(dims, rank, rv)
            a, b = last.get((rank, str(u))), first.get((other, str(v)))
            if a is not None and b is not None:
                by_kind.setdefault(kind, []).append((a, b))
    for kind, edges in by_kind.items():
        graph.add_edges(edges, kind)
