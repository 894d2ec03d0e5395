"""Predict a training step at scale: step time, bubble, exposed communication and peak memory
per pipeline rank, for layouts far larger than can be run (pp32 x ep64 x cp64).

:func:`predict_at_scale` takes a validated :class:`~overlap_runtime.config.train.TrainConfig`
and a :class:`~overlap_runtime.stepgraph.costs.MachineProfile`:

1. the pipeline graph of the schedule (``schedules.compile_spec``; pp == 1: ``0F0 -> 0B0``);
2. every F/B/I/W expanded into its stage's layer ops (:func:`~overlap_runtime.stepgraph.
   layer_program.stage_program`), each priced by the profile (:func:`priced_ops`): compute from
   the op's FLOPs and its op class, collectives by group size and placement, the GDN state
   chain as ``cp - 1`` hops with their applies (rank ``cp - 1`` waits for all of them; NVLink
   hops inside a node, inter-node hops between nodes), the prefix scan as its
   ``ceil(log2 cp)`` rounds with their composes, the summary all-gather plus the far end's
   prefix compose, hierarchical attention's all-to-alls on ``cp_a2a`` and its ring on
   ``cp_ring`` (ranks ``cp_a2a`` apart), ring-attention hops only where they outlast the block
   they are prefetched behind;
3. the step graph of those priced ops with one representative rank per pipeline rank
   (:func:`~overlap_runtime.stepgraph.compose.compile_step` with ``representative=True``, the
   expansion the trainer's conformance check uses): ranks of one cp/ep/dp group run the same
   program; their collectives are costed by the group's size; pipeline messages complete out
   of order and an OVERLAP_B_F step keeps the coordinator's compute waits (the simulation
   view of ``stepgraph.expand``);
4. the list-scheduler simulation, plus what lies outside the pipeline: FSDP's one unshard
   (all-gather) and one reduce-scatter per step over ``dp_shard x cp``, and the optimizer step
   (16 bytes per sharded parameter through HBM);
5. peak memory per pipeline rank (:func:`peak_memory`).

Everything here is pure Python over the config (the parameter count uses a meta-device model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from overlap_runtime.graph._gc import gc_paused
from overlap_runtime.graph.simulate import SimulationResult, simulate
from overlap_runtime.graph.tasks import Task

from overlap_runtime.config.train import schedule_spec

from .compose import compile_step, pipeline_graph, stage_layers_of
from .costs import MachineProfile
from .layer_program import LayerOp, MicrobatchShape, microbatch_shape, stage_program

if TYPE_CHECKING:
    from overlap_runtime.config.train import TrainConfig


def op_class(name: str) -> str:
    """The profile's throughput class of a layer op: ``gdn``, ``attention`` (the core of full
    attention), ``moe`` (router, experts, shared expert) or ``gemm`` (everything else)."""
    if name.startswith(("gdn.", "recompute.gdn.")):
        return "gdn"
    if ".core" in name or ".block" in name:
        return "attention"
    if name.startswith(("moe.", "recompute.moe.")):
        return "moe"
    return "gemm"


def priced_ops(program: tuple[tuple[int, LayerOp], ...], profile: MachineProfile, *,
               cp: int, ep: int, cp_a2a: int | None = None) -> list[LayerOp]:
    """Price the ops of one stage action on ``profile`` (see the module doc for the rules).

    Returns the same ops priced (``cost``, ``task_kind`` ``compute`` / ``comm``, a message's
    ``group_size``), sends dropped. Compute ops keep their names; a receive becomes a blocking
    collective of its group (the wait of one rank, which then needs no peer built), so every
    message is a blocking op on ``comm:<group>`` but the combine (its ``join``) (the
    group's collectives are costed by its size and placement: ``cp`` and ``ep`` consecutive
    ranks; hierarchical attention's ``cp_a2a`` the ``cp_a2a`` consecutive ranks of one ring
    index, ``cp_ring`` the ``cp / cp_a2a`` ranks ``cp_a2a`` apart). Sends cost nothing on the
    thread (non-blocking). A receive waits one hop, except the GDN state hand-over, priced as
    its far end waits for it: the chain's receive ``cp - 1`` hops with their applies
    (:meth:`MachineProfile.state_chain`), the prefix scan's first receive of a direction every
    round with its compose (:meth:`MachineProfile.prefix_scan`; its other receives then cost
    nothing). The summary all-gather is followed by the far end's prefix compose (``state``).
    """
    return [op for _, op in priced_program(program, profile, cp=cp, ep=ep, cp_a2a=cp_a2a)]


def priced_program(program: tuple[tuple[int, LayerOp], ...], profile: MachineProfile, *,
                   cp: int, ep: int, cp_a2a: int | None = None) -> list[tuple[int, LayerOp]]:
    """:func:`priced_ops` with each op's decoder layer: ``(layer, priced op)`` (an op source's
    form, ``stepgraph.expand``)."""
    ops = [op for _, op in program]
    sizes: dict[str | None, tuple[int, int]] = {"cp": (cp, 1), "ep": (ep, 1)}
    if cp_a2a is not None:
        if cp_a2a < 1 or cp % cp_a2a:
            raise ValueError(f"priced_ops: cp_a2a={cp_a2a} does not divide cp={cp}")
        sizes["cp_a2a"] = (cp_a2a, 1)
        sizes["cp_ring"] = (cp // cp_a2a, cp_a2a)
    scans_priced: set[str] = set()
    out: list[tuple[int, LayerOp]] = []
    for j, (layer, op) in enumerate(program):
        if op.kind == "compute":
            out.append((layer, replace(op, cost=profile.compute(op.flops, op_class(op.name)),
                                       task_kind="compute")))
            continue
        if op.group in ("cp_a2a", "cp_ring") and op.group not in sizes:
            raise ValueError(f"priced_ops: op {op.name!r} is on group {op.group!r} "
                             f"(hierarchical attention) but cp_a2a was not given")
        g, stride = sizes.get(op.group, (1, 1))
        if op.kind == "collective":
            if op.collective == "all_to_all":
                cost = profile.all_to_all(op.nbytes, g, stride) + profile.copy(op.nbytes)
            else:
                cost = profile.all_gather(op.nbytes, g, stride)
        elif op.kind == "send":
            continue
        elif ".chain." in op.name:  # the state chain: the far end waits for every hop
            cost = profile.state_chain(op.nbytes, g, op.flops)
        elif ".scan" in op.name and op.name.removeprefix("recompute.").startswith("gdn.scan"):
            # every round of the scan, on its first receive (per direction; a recompute's own)
            which = op.name.split("gdn.scan")[0] + (
                "gdn.scan.bwd" if "gdn.scan.bwd" in op.name else "gdn.scan")
            if which in scans_priced:
                continue
            scans_priced.add(which)
            mine = [o.nbytes for o in ops if o.name.startswith(which)
                    and (which.endswith(".bwd") or not o.name.startswith(which + ".bwd"))]
            cost = profile.prefix_scan(min(mine), max(mine), g, op.flops)
        else:  # a halo or ring hop: prefetched behind the next compute op
            nxt = next((o for o in ops[j + 1:] if o.kind == "compute"), None)
            prefetched = ".ring" in op.name or ".dkv" in op.name
            hidden = profile.compute(nxt.flops, op_class(nxt.name)) \
                if nxt is not None and prefetched else 0.0
            cost = max(0.0, profile.ring_step(op.nbytes, g, stride) - hidden)
        # a collective, or a receive as a blocking wait of its group (no peer on one rank)
        out.append((layer, replace(op, kind="collective", peer=None, cost=cost,
                                   task_kind="comm", group_size=g)))
        if op.kind == "collective" and op.flops and op.name.startswith("gdn.gather_summary"):
            out.append((layer, LayerOp(f"{op.name}.compose", "compute", flops=op.flops,
                                       cost=profile.compute(op.flops, "state"),
                                       task_kind="compute")))
    return out


def _stage_parameters(config: "TrainConfig", stage_layers: list[list[int]]
                     ) -> list[tuple[int, int]]:
    """Per stage ``(dense parameters, routed-expert parameters)``: the decoder layers it holds,
    the embedding on the first stage, the final norm and LM head on the last (layers of one type
    are alike: ``Qwen3_5Config.layer_parameters`` counts one from the fields)."""
    m = config.model
    by_type = {kind: m.layer_parameters(kind) for kind in set(m.layer_types)}
    per_layer = [by_type[k] for k in m.layer_types]
    embed = m.vocab_size * m.hidden_size
    head = m.hidden_size + (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size)
    out = []
    last = len(stage_layers) - 1
    for s, layers in enumerate(stage_layers):
        dense = sum(per_layer[i][0] for i in layers) + (embed if s == 0 else 0) \
            + (head if s == last else 0)
        out.append((dense, sum(per_layer[i][1] for i in layers)))
    return out


def _activation_bytes(config: "TrainConfig", layers: list[int], shape: MicrobatchShape) -> float:
    """Saved activations of one microbatch through ``layers`` on one rank (bytes): per token
    and layer ``e x`` (4 hidden + the mixer's projections + the MLP's inner activations), an
    estimate of what autograd keeps (inputs of every GEMM and nonlinearity)."""
    m, e, t = config.model, shape.dtype_bytes, shape.tokens
    total = 0.0
    for i in layers:
        per = 4 * m.hidden_size
        if m.layer_types[i] == "linear_attention":
            conv = 2 * m.linear_num_key_heads * m.linear_key_head_dim \
                + m.linear_num_value_heads * m.linear_value_head_dim
            per += 2 * conv + 3 * m.linear_num_value_heads * m.linear_value_head_dim
        else:
            per += (3 * m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
        if m.mlp == "moe":
            shared = m.shared_expert_intermediate_size or 0
            per += m.num_experts_per_tok * (m.hidden_size + 3 * m.moe_intermediate_size) \
                + 3 * shared
        else:
            per += 3 * m.intermediate_size
        total += per * e * t
    return total


def _inflight(pipeline: Any) -> dict[int, dict[int, int]]:
    """Per pipeline rank and stage: the most microbatches whose activations are held at once
    (F done, its B / W not yet), walking the rank's program."""
    out: dict[int, dict[int, int]] = {}
    by_rank: dict[int, list[Task]] = {}
    for t in pipeline.tasks():
        if t.comm is None and t.kind in ("F", "B", "W"):
            by_rank.setdefault(t.rank, []).append(t)
    for r, ts in by_rank.items():
        ts.sort(key=lambda t: (t.step, 0 if t.kind == "B" else 1))
        held: dict[int, int] = {}
        best: dict[int, int] = {}
        peak_total, split = 0, any(t.kind == "W" for t in ts)
        for t in ts:
            s = int(t.meta["stage"])
            if t.kind == "F":
                held[s] = held.get(s, 0) + 1
            elif (t.kind == "W") == split:
                held[s] -= 1
            total = sum(held.values())
            if total > peak_total:
                peak_total = total
                best = dict(held)
        out[r] = best
    return out


def peak_memory(config: "TrainConfig", pipeline: Any, stage_layers: list[list[int]],
                stage_to_rank: dict[int, int], shape: MicrobatchShape,
                params: list[tuple[int, int]] | None = None) -> dict[int, dict[str, float]]:
    """Peak bytes per pipeline rank: ``params`` (sharded fp32 master + grads + AdamW = 16 B per
    parameter over ``dp_shard x cp``, routed experts over ``ep x efsdp``), ``gathered`` (the
    stage's parameters unsharded in the compute dtype plus their full fp32 gradients during the
    step: ``GatheredStep``) and ``activations`` (in-flight microbatches x saved bytes)."""
    dims = config.train.accelerator.layout()
    shard = dims.dp_shard * dims.cp
    e = shape.dtype_bytes
    params = params if params is not None else _stage_parameters(config, stage_layers)
    act = [_activation_bytes(config, layers, shape) for layers in stage_layers]
    inflight = _inflight(pipeline)
    out: dict[int, dict[str, float]] = {}
    for r in sorted(set(stage_to_rank.values())):
        stages = [s for s, q in stage_to_rank.items() if q == r]
        dense = sum(params[s][0] for s in stages)
        expert = sum(params[s][1] for s in stages) / dims.ep
        sharded = 16.0 * (dense / shard + expert / dims.efsdp)
        gathered = (e + 4.0) * (dense + expert) if config.train.accelerator.pp > 1 else \
            (e + 4.0) * (dense + expert) / max(1, len(config.model.layer_types))
        held = inflight.get(r, {})
        activations = sum(held.get(s, 0) * act[s] for s in stages)
        out[r] = {"params": sharded, "gathered": gathered, "activations": activations,
                  "total": sharded + gathered + activations}
    return out


@dataclass
class RankPrediction:
    """One pipeline rank: ``busy_s`` (device), ``bubble``, ``exposed_comm_s`` and memory."""

    pp_rank: int
    busy_s: float
    bubble: float
    exposed_comm_s: float
    memory: dict[str, float]


@dataclass
class ScalePrediction:
    """A predicted step: ``pipeline_s`` (the simulated schedule), ``fsdp_s`` and
    ``optimizer_s`` (outside it), ``step_s`` (their sum), per-rank figures, and how long the
    prediction took (``build_s``, ``simulate_s``) over how many tasks."""

    config_label: str
    profile: str
    pipeline_s: float
    fsdp_s: float
    optimizer_s: float
    bubble: float
    ranks: list[RankPrediction]
    tasks: int
    represented_ranks: int
    world: int
    build_s: float = 0.0
    simulate_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    result: SimulationResult | None = field(default=None, repr=False)

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.fsdp_s + self.optimizer_s

    @property
    def exposed_comm_s(self) -> float:
        return max((r.exposed_comm_s for r in self.ranks), default=0.0)

    @property
    def peak_memory_bytes(self) -> float:
        return max((r.memory["total"] for r in self.ranks), default=0.0)


@gc_paused
def predict_at_scale(config: "TrainConfig", profile: MachineProfile, *,
                     representative: bool = True) -> ScalePrediction:
    """Predict one training step of ``config`` on ``profile`` (module doc).

    ``representative=False`` builds every rank (small layouts only: the check of the
    symmetry reduction).
    """
    t0 = time.perf_counter()
    acc = config.train.accelerator
    dims = acc.layout()
    world = dims.world_size
    inner = world // dims.pp
    shape = microbatch_shape(config)
    pipeline = pipeline_graph(config)
    if dims.pp > 1:
        spec = schedule_spec(config)
        num_stages, stage_to_rank = spec.num_stages, spec.stage_mapping()
    else:
        num_stages, stage_to_rank = 1, {0: 0}
    stage_layers = stage_layers_of(config, num_stages)
    last = num_stages - 1
    cache: dict[tuple[int, str], list[tuple[int, LayerOp]]] = {}
    rep_cp = min(1, dims.cp - 1)  # a middle rank: halo and chain messages both ways
    cp_a2a = acc.hierarchical_cp.a2a if acc.hierarchical_cp is not None else None

    def ops_of(t: Task, rank: int) -> list[tuple[int, LayerOp]]:
        stage = int(t.meta["stage"])
        key = (stage, t.kind)
        if key not in cache:
            prog = stage_program(config, stage_layers[stage], t.kind, shape,  # type: ignore[arg-type]
                                 cp_rank=rep_cp, stage=stage, first=stage == 0,
                                 last=stage == last)
            cache[key] = priced_program(prog, profile, cp=dims.cp, ep=dims.ep, cp_a2a=cp_a2a)
        return cache[key]

    act_bytes = shape.tokens * config.model.hidden_size * shape.dtype_bytes
    pp_link = profile.link(2, inner)
    graph = compile_step(config, validate=False, representative=representative, ops=ops_of,
                         message_cost=lambda t: pp_link.time(act_bytes), async_p2p=True,
                         hook_waits=True, pipeline=pipeline).graph
    t1 = time.perf_counter()
    res = simulate(graph)
    t2 = time.perf_counter()

    # outside the pipeline: FSDP unshard + reduce-scatter, optimizer
    params = _stage_parameters(config, stage_layers)
    shard = dims.dp_shard * dims.cp
    fsdp_s = opt_s = 0.0
    for r in range(dims.pp):
        stages = [s for s, q in stage_to_rank.items() if q == r]
        dense = sum(params[s][0] for s in stages)
        expert = sum(params[s][1] for s in stages) / dims.ep
        gather = profile.all_gather(dense / shard * shape.dtype_bytes, shard) + \
            profile.all_gather(expert / dims.efsdp * shape.dtype_bytes, dims.efsdp)
        reduce = profile.all_gather(dense / shard * 4.0, shard) + \
            profile.all_gather(expert / dims.efsdp * 4.0, dims.efsdp)
        fsdp_s = max(fsdp_s, gather + reduce)
        opt_s = max(opt_s, 16.0 * (dense / shard + expert / dims.efsdp) * 2 / profile.hbm_Bps)
    memory = peak_memory(config, pipeline, stage_layers, stage_to_rank, shape, params)
    ranks = []
    for g in res.ranks:
        r = g // inner
        ranks.append(RankPrediction(r, res.busy_by_rank[g], res.bubble_by_rank[g],
                                    res.exposed_comm_by_rank[g], memory[r]))
    label = (f"pp{dims.pp} x dp_shard{dims.dp_shard} x cp{dims.cp} x ep{dims.ep} "
             f"({config.train.pipeline.schedule}, v{config.train.pipeline.virtual_stages}, "
             f"m{config.train.pipeline.microbatches})")
    notes = []
    if any(r.memory["total"] > profile.memory_bytes for r in ranks):
        notes.append(f"peak memory exceeds the {profile.memory_bytes / 2**30:.0f} GiB of one "
                     f"{profile.name}")
    return ScalePrediction(label, profile.name, res.makespan, fsdp_s, opt_s, res.bubble_ratio,
                           ranks, len(graph), len(res.ranks), world, t1 - t0, t2 - t1, notes,
                           res)
