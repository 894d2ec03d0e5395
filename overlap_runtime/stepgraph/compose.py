"""``compile_step(config) -> StepGraph``: one task graph for one training step, on every rank.

The pipeline graph of the configured schedule (``schedules.compile_spec``, one program per pp
rank; pp == 1: one stage, ``0F0`` then ``0B0`` over the whole batch) is expanded onto the
global ranks of the layout (``ParallelDims.coordinates``) by :func:`~.expand.expand`, each
compute task (F/B/I/W) into its stage's layer ops on that rank (:func:`layer_ops`, the layer
program :func:`~.layer_program.stage_program`); task ids, lanes, keys and the blocking rules
are the expansion's (``stepgraph.expand``). In an OVERLAP_B_F step the expert all-to-alls of
both sides are chained in the HookCoordinator's launch order (``stepgraph.overlap_edges``):
one all-to-all in flight per EP group. Without the coordinator (no ``overlap_b_f`` or no EP) a
compound step's sub-actions run one after the other.

The same entry point builds the simulator's graphs: ``representative`` (one rank per pipeline
coordinate, ``stepgraph.scale``), a priced op source (``ops``: ``scale.priced_ops``,
``predict.measured_ops``), ``message_cost`` for pipeline SENDs and the simulation view
(``async_p2p``, ``hook_waits``).

Outside the graph: FSDP2's unshard / reduce-scatter (``GatheredStep``: one unshard and one
reduce per step for pp > 1, per layer for pp == 1; they run inside torch's FSDP, not through
``ops.comm``), the pipeline's one-time metadata exchange, the loss / grad-norm all-reduces
after the step. Simplification: any other receive joins the next compute op, which may be
earlier than the runtime's wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

from overlap_runtime.config.layout import split_layers
from overlap_runtime.config.train import schedule_spec
from overlap_runtime.graph import Task, TaskGraph
from overlap_runtime.graph.validate import CommMatching
from overlap_runtime.schedules import compile_spec

from .expand import COMPUTE_KINDS, OpSource, expand
from .layer_program import LayerOp, MicrobatchShape, microbatch_shape, stage_program

if TYPE_CHECKING:
    from overlap_runtime.config.layout import Layout as ParallelDims
    from overlap_runtime.config.train import TrainConfig


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
        """The global ranks built: all of them, or one per pipeline coordinate
        (``representative``)."""
        return sorted(self.actions)

    def comm_tasks(self, rank: int, action: str) -> list[Task]:
        """The communication tasks of ``action`` on ``rank``, in issue order."""
        return [t for t in (self.graph.task(i) for i in self.actions[rank].get(action, []))
                if t.comm is not None]


def stage_layers_of(config: "TrainConfig", num_stages: int) -> list[list[int]]:
    return [list(r) for r in split_layers(config.model.num_hidden_layers, num_stages,
                                          config.train.pipeline.layers_per_stage)]


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
        if t.kind not in COMPUTE_KINDS:
            total += 1
            continue
        s = t.meta["stage"]
        key = (s, t.kind)
        if key not in per_kind:
            per_kind[key] = len(stage_program(config, stage_layers[s], t.kind, shape,  # type: ignore[arg-type]
                                              stage=s, first=s == 0, last=s == num_stages - 1))
        total += per_kind[key]
    return total * (dims.world_size // dims.pp)




def layer_ops(config: "TrainConfig", dims: "ParallelDims", stage_layers: list[list[int]],
              shape: MicrobatchShape) -> OpSource:
    """The default op source: the layer program of a pipeline task's stage and kind on the
    global rank's CP rank (:func:`~.layer_program.stage_program`), unpriced."""
    num_stages = len(stage_layers)
    cache: dict[tuple[int, str, int], tuple[tuple[int, LayerOp], ...]] = {}

    def ops_of(t: Task, rank: int) -> tuple[tuple[int, LayerOp], ...]:
        s, cp_rank = int(t.meta["stage"]), dims.coordinates(rank)["cp"]
        key = (s, t.kind, cp_rank)
        if key not in cache:
            cache[key] = stage_program(config, stage_layers[s], t.kind, shape,  # type: ignore[arg-type]
                                       cp_rank=cp_rank, stage=s, first=s == 0,
                                       last=s == num_stages - 1)
        return cache[key]

    return ops_of


def compile_step(config: "TrainConfig", *, validate: bool = True,
                 dims: "ParallelDims | None" = None, representative: bool = False,
                 ops: OpSource | None = None, message_cost: Callable[[Task], float] | None = None,
                 async_p2p: bool = False, hook_waits: bool = False,
                 pipeline: TaskGraph | None = None) -> StepGraph:
    """The task graph of one training step of ``config`` on every rank (module doc).

    With ``validate`` the graph is proven deadlock-free before it is returned (raises a
    :class:`~overlap_runtime.graph.GraphValidationError` naming the tasks). ``dims``: the
    layout (default: ``config.train.accelerator.layout()``). ``representative``, ``ops``
    (default :func:`layer_ops`), ``message_cost``, ``async_p2p``, ``hook_waits``: see
    :func:`~.expand.expand`; the defaults give the graph a run is checked against.
    ``pipeline``: :func:`pipeline_graph` of ``config`` when the caller has it already.
    """
    t0 = time.perf_counter()
    dims = dims if dims is not None else config.train.accelerator.layout()
    shape = microbatch_shape(config)
    pipe = pipeline if pipeline is not None else pipeline_graph(config)
    num_stages = max((t.meta.get("stage", 0) for t in pipe.tasks() if t.meta), default=0) + 1
    stage_layers = stage_layers_of(config, num_stages)
    # the HookCoordinator runs the two sides of a compound step on two threads only with
    # overlap_b_f and EP (trainer.build); otherwise the sub-actions run in order
    coordinated = config.train.pipeline.overlap_b_f and dims.ep > 1
    graph, actions = expand(
        pipe, dims, ops if ops is not None else layer_ops(config, dims, stage_layers, shape),
        coordinated=coordinated, representative=representative,
        message_bytes=_pp_bytes(shape, config), message_cost=message_cost,
        async_p2p=async_p2p, hook_waits=hook_waits,
        name=f"step {pipe.name} x {dims.describe()}")
    sg = StepGraph(config, dims, shape, graph, actions, stage_layers,
                   build_s=time.perf_counter() - t0)
    if validate:
        sg.validate()
    return sg


def _pp_bytes(shape: MicrobatchShape, config: "TrainConfig") -> int:
    """One pipeline activation (or its gradient): ``[rows, local_len, hidden]``."""
    return shape.tokens * config.model.hidden_size * shape.dtype_bytes
