"""Compile a (lowered) schedule into a :class:`~overlap_runtime.graph.TaskGraph`.

Per rank, the lanes are::

    compute   plain F / B / I / W steps
    fwd, bwd  the two threads of a compound step (OVERLAP_B_F / OVERLAP_F_B): its forward
              sub-action on ``fwd``, its backward on ``bwd``; they share the device
    comm:pp   SEND / RECV when ``overlap_p2p`` (otherwise they sit on ``compute`` and block it)

Edges: ``program`` between consecutive steps of a rank (compute steps among themselves, comm
steps among themselves; a compound step forks to both threads and joins before the next step);
``data`` for F(s,m)->F(s+1,m), B(s+1,m)->B(s,m) (I likewise), F(s,m)->B(s,m), I(s,m)->W(s,m),
producer->SEND and RECV->consumer; ``match`` for SEND->RECV. Task ids are the action texts
(``1F3``, ``0SEND_F1``), unique within a schedule.

:func:`compile_spec` runs the whole pipeline: build, lower, check the pipeline rules, compile,
prove deadlock freedom. :func:`validate_schedule` checks a schedule someone else built: the
pipeline rules (:mod:`~overlap_runtime.schedules.rules`) and, for a lowered schedule, the same
deadlock proof. That proof lives in one place, :func:`_prove_deadlock_free`: the task-graph
validator with blocking semantics (a RECV blocks its lane; :func:`overlap_runtime.graph.
validate_graph`), which also matches every send to its receive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping

from ..graph._gc import gc_paused
from ..graph.simulate import CostModel, SimulationResult, simulate
from ..graph.task_graph import TaskGraph
from ..graph.tasks import CommInfo, Task
from ..graph.validate import CommMatching, validate_graph
from .build import build_schedule
from .ir import ActionKind, Schedule
from .lowering import lower
from .rules import check_pipeline_rules, infer_stage_to_rank
from .spec import ScheduleSpec

COMM_LANE = "comm:pp"
_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_SEND = {ActionKind.SEND_F: "F", ActionKind.SEND_B: "B"}
_RECV = {ActionKind.RECV_F: "F", ActionKind.RECV_B: "B"}
_VALUE = {k: k.value for k in ActionKind}


@gc_paused
def compile_schedule(
    schedule: Schedule,
    *,
    stage_to_rank: Mapping[int, int] | None = None,
    num_stages: int | None = None,
    overlap_p2p: bool = True,
    message_bytes: float | None = None,
    name: str = "pipeline",
) -> TaskGraph:
    """Build the task graph of ``schedule`` (compute-only or lowered).

    In a compute-only schedule, outputs cross ranks through plain data edges (free,
    instantaneous communication). ``message_bytes`` sets ``CommInfo.nbytes`` of every SEND.
    Edges to actions absent from the schedule are skipped (``validate_schedule`` reports them).
    The graph is not checked here (see :func:`validate_schedule`, ``graph.validate()``).
    """
    if stage_to_rank is None:
        stage_to_rank = infer_stage_to_rank(schedule)
    if num_stages is None:
        num_stages = max(stage_to_rank, default=-1) + 1
    last = num_stages - 1
    graph = TaskGraph(name)
    tasks: list[Task] = []
    program: list[tuple[str, str]] = []
    leaves: list[tuple[str, str, int, int]] = []  # (id, kind, stage, microbatch) of compute
    comms: list[tuple[str, bool, str, int, int]] = []  # (id, is_send, F|B, src stage, mb)
    programs: dict[int, list[str]] = {}
    comp_lane = "compute"
    comm_lane = COMM_LANE if overlap_p2p else comp_lane

    for rank in sorted(schedule):
        prev_comp: list[str] = []
        prev_comm: list[str] = []
        cells: list[str] = []
        for step, a in enumerate(schedule[rank]):
            if a is None:
                cells.append("")
                continue
            kind = a.kind
            d = _SEND.get(kind) or _RECV.get(kind)
            if d is not None:
                tid = f"{a.stage}{_VALUE[kind]}{a.microbatch}"
                cells.append(tid)
                is_send = kind in _SEND
                if is_send:
                    src_stage = a.stage
                    peer_stage = a.stage + 1 if d == "F" else a.stage - 1
                else:
                    src_stage = peer_stage = a.stage - 1 if d == "F" else a.stage + 1
                tasks.append(Task(
                    tid, rank, comm_lane, _VALUE[kind],
                    comm=CommInfo("send" if is_send else "recv", (d, src_stage, a.microbatch),
                                  stage_to_rank.get(peer_stage),
                                  message_bytes if is_send else None),
                    step=step, label=tid,
                ))
                comms.append((tid, is_send, d, src_stage, a.microbatch))  # type: ignore[arg-type]
                nodes = [tid]
                if overlap_p2p:
                    for p in prev_comm:
                        program.append((p, tid))
                    prev_comm = nodes
                    continue
            else:
                nodes = []
                compound = bool(a.sub_actions)
                for x in a.leaves():
                    xv = _VALUE[x.kind]
                    tid = f"{x.stage}{xv}{x.microbatch}"
                    lane = ("fwd" if x.kind is _F else "bwd") if compound else comp_lane
                    tasks.append(Task(tid, rank, lane, xv, step=step, label=tid,
                                      meta={"stage": x.stage, "microbatch": x.microbatch}))
                    leaves.append((tid, xv, x.stage, x.microbatch))  # type: ignore[arg-type]
                    nodes.append(tid)
                cells.append(str(a) if compound else nodes[0])
            for p in prev_comp:
                for n in nodes:
                    program.append((p, n))
            prev_comp = nodes
        programs[rank] = cells
    graph.add_tasks(tasks)
    ids = {t.id for t in tasks}  # type: ignore[misc]

    def bwd(stage: int, mb: int) -> str:
        b = f"{stage}B{mb}"
        return b if b in ids else f"{stage}I{mb}"

    def crosses(src: int, dst: int, key: str) -> bool:
        """True when the output goes through a SEND/RECV pair (then no direct edge)."""
        return stage_to_rank.get(src) != stage_to_rank.get(dst) and key in ids

    data: list[tuple[str, str]] = []
    match: list[tuple[str, str]] = []
    for tid, is_send, d, s, m in comms:
        if is_send:
            recv = f"{s + 1}RECV_F{m}" if d == "F" else f"{s - 1}RECV_B{m}"
            producer = f"{s}F{m}" if d == "F" else bwd(s, m)
            if producer in ids:
                data.append((producer, tid))
            if recv in ids:
                match.append((tid, recv))
        else:
            consumer = f"{s + 1}F{m}" if d == "F" else bwd(s - 1, m)
            if consumer in ids:
                data.append((tid, consumer))
    for tid, kind, s, m in leaves:
        if kind == "F":
            up = f"{s - 1}F{m}"
            if s > 0 and up in ids and not crosses(s - 1, s, f"{s}RECV_F{m}"):
                data.append((up, tid))
        elif kind == "B" or kind == "I":
            fwd = f"{s}F{m}"
            if fwd in ids:
                data.append((fwd, tid))
            if s < last:
                up = bwd(s + 1, m)
                if up in ids and not crosses(s + 1, s, f"{s}RECV_B{m}"):
                    data.append((up, tid))
        elif kind == "W":
            inp = f"{s}I{m}"
            if inp in ids:
                data.append((inp, tid))
    graph.add_edges(program, "program")
    graph.add_edges(data, "data")
    graph.add_edges(match, "match")
    graph.programs = programs
    return graph


def _prove_deadlock_free(graph: TaskGraph) -> CommMatching:
    """The deadlock check of the schedules package (the only caller of the graph validator).

    Raises :class:`overlap_runtime.graph.DeadlockError` with the cycle when the program order
    plus blocking sends and receives can wait in a circle, and
    :class:`overlap_runtime.graph.UnmatchedCommError` for a send without its receive.
    """
    return validate_graph(graph)


@gc_paused
def validate_schedule(
    schedule: Schedule,
    *,
    num_microbatches: int | None = None,
    num_stages: int | None = None,
    stage_to_rank: Mapping[int, int] | None = None,
    check_deadlock: bool = True,
) -> None:
    """Raise unless ``schedule`` follows the pipeline rules and, if lowered, cannot deadlock.

    The rules (:func:`~overlap_runtime.schedules.rules.check_pipeline_rules`) raise
    :class:`~overlap_runtime.schedules.rules.ScheduleValidationError`. With ``check_deadlock``
    and SEND/RECV present, the schedule is compiled and :func:`_prove_deadlock_free` runs
    (``DeadlockError`` / ``UnmatchedCommError``). ``num_microbatches`` / ``num_stages`` default
    to the largest index seen + 1; ``stage_to_rank`` to the placement seen.
    """
    mapping, n_stages, lowered = check_pipeline_rules(
        schedule, num_microbatches=num_microbatches, num_stages=num_stages,
        stage_to_rank=stage_to_rank)
    if check_deadlock and lowered:
        _prove_deadlock_free(compile_schedule(schedule, stage_to_rank=mapping,
                                              num_stages=n_stages))


@dataclass
class CompiledSchedule:
    """Everything :func:`compile_spec` produced for one spec."""

    spec: ScheduleSpec
    compute: Schedule
    lowered: Schedule
    graph: TaskGraph
    matching: CommMatching

    def simulate(self, costs: CostModel | None = None) -> SimulationResult:
        """Simulate the compiled graph (see :func:`overlap_runtime.graph.simulate`)."""
        return simulate(self.graph, costs, matching=self.matching)

    @property
    def comm_pairs(self) -> list[tuple[Hashable, Hashable]]:
        return self.matching.pairs


@gc_paused
def compile_spec(spec: ScheduleSpec, *, message_bytes: float | None = None) -> CompiledSchedule:
    """Build, lower, check the rules, compile and prove deadlock-free the schedule of ``spec``."""
    compute = build_schedule(spec)
    mapping = spec.stage_mapping()
    lowered = lower(compute, mapping, num_stages=spec.num_stages)
    check_pipeline_rules(lowered, num_microbatches=spec.num_microbatches,
                         num_stages=spec.num_stages, stage_to_rank=mapping)
    graph = compile_schedule(lowered, stage_to_rank=mapping, num_stages=spec.num_stages,
                             overlap_p2p=spec.overlap_p2p, message_bytes=message_bytes,
                             name=f"{spec.kind} pp={spec.pp_size} m={spec.num_microbatches} "
                                  f"v={spec.virtual_stages}")
    matching = _prove_deadlock_free(graph)
    return CompiledSchedule(spec, compute, lowered, graph, matching)
