"""Assembling the parallel model of one rank: CP, EP, pipeline split, FSDP2, schedule.

::

    model = Qwen3_5ForCausalLM(config.model)        whole, same seed on every rank (= baseline)
    parallelize_qwen3_5_cp(model, mesh "cp")         GDN + attention CP (contiguous shards)
    parts = split_qwen3_5(model, stages of this pp rank)        pp > 1, else {0: model}
    parallelize_qwen3_5_ep(part, mesh "ep")          routed experts sharded; with overlap_b_f
                                                     the A/B/C/D hooks of one HookCoordinator;
                                                     with defer_expert_w one DeferredWQueue
                                                     per rank (experts + dispatchers)
    apply_fsdp(part, mesh "fsdp", expert_mesh "expert_fsdp")     per part
    PipelineSchedule(spec, [PipelineStage(part) ...])           pp > 1; OVERLAP_B_F callback
                                                                 registered when asked for

Order matters: CP and EP swap strategies on the plain modules, the split takes submodules of
the already parallel model, and FSDP wraps last (it replaces parameters by DTensor shards).
Everything is built from the same seed on every rank before sharding, so the initial weights
equal the single-device baseline's.

Loss scaling: the last stage's ``loss_fn`` returns ``CE_sum(microbatch) / global_tokens`` and
the schedule does not rescale (``scale_grads=False``), so the gradients summed over microbatches,
data-parallel and context-parallel ranks are those of the mean CE over the global batch, exactly
as on one device. The MoE load-balancing loss is attached to each MoE layer's output
(``moe.attach_aux_loss``) and so flows back with every microbatch; it is computed per MoE call
over the tokens that call routes (one microbatch's shard on one rank) and is not rescaled, so
its total weight grows with the number of microbatches x data/context ranks. Alignment with one
device therefore uses ``moe_aux_loss_coef: 0`` (docs/training.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from overlap_runtime.config.cp import layer_cp_modes
from overlap_runtime.config.train import TrainConfig, schedule_spec
from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.layers.compile import compile_elementwise
from overlap_runtime.models.parallelize import parameter_count
from overlap_runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from overlap_runtime.models.spec import get_model_spec
from overlap_runtime.moe import MoE, make_overlap_b_f_callback
from overlap_runtime.ops.comm import DEFAULT_TIMEOUT_S
from overlap_runtime.pipeline import DeferredWQueue, PipelineSchedule, PipelineStage, TensorMeta
from overlap_runtime.schedules import ActionKind
from overlap_runtime.trainer.fsdp_pipeline import check_fsdp_internals
from overlap_runtime.trainer.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from overlap_runtime.pipeline import ExecutionTrace


def build_model(config: TrainConfig, device: torch.device | str = "cpu", *,
                meta: bool = False) -> Qwen3_5ForCausalLM:
    """The model of ``config.model`` (fp32, on ``device``): initialised from
    ``config.train.seed``, or with ``model.init_from`` loaded from that Hugging Face checkpoint.

    Every rank builds it whole from the same seed before it is split and sharded, so the initial
    weights equal the baseline's. ``meta=True`` with ``model.init_from``: the model stays on the
    meta device (no memory) for :func:`build_parallel_model` to shard, materialise and load.
    """
    spec = get_model_spec("qwen3_5")
    if config.model.init_from is not None:
        model = spec.build(config.model, device, True)
        if not meta:
            model.materialize(device)
            spec.load_hf([model], config.model.init_from, config.model, None)
    else:
        torch.manual_seed(config.train.seed)
        model = spec.build(config.model, device, False)
    model.set_activation_checkpointing(config.train.activation_checkpoint)
    return model


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropy in fp32: logits ``[B, S, V]``, labels ``[B, S]`` int64."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")


@dataclass
class ParallelModel:
    """What one rank trains.

    Attributes:
        parts: ``{stage index: module}``: this rank's pipeline stages, or ``{0: model}``.
        schedule: the pipeline schedule (pp > 1), else None.
        overlap: the rank's ``CommComputeOverlap`` (OVERLAP_B_F with EP), closed by
            :meth:`close`.
        deferred_w: the rank's W queue of the expert GEMMs (``defer_expert_w``), else None;
            PipelineStage finds it on the experts and runs I as one walk inside its capture.
        w_runs: ``{reason: count}`` of the W tasks that queue ran (``"window"``: inside an
            EP all-to-all wait; ``"action"``: the program's W; ``"drain"``: end of step),
            summed over the run.
        expert_params / other_params: this rank's parameters, routed experts apart (their
            norm is summed over the EP group too).
        num_parameters: parameters of the whole model (before any split or sharding).
    """

    parts: dict[int, nn.Module]
    schedule: Any | None
    overlap: Any | None
    expert_params: list[nn.Parameter]
    other_params: list[nn.Parameter]
    num_parameters: int
    global_tokens: int
    deferred_w: Any | None = None
    w_runs: dict[str, int] = field(default_factory=dict)
    _closed: bool = field(default=False, repr=False)

    @property
    def has_first(self) -> bool:
        return 0 in self.parts

    @property
    def has_last(self) -> bool:
        return self.schedule is None or (self.schedule.spec.num_stages - 1) in self.parts

    def parameters(self) -> list[nn.Parameter]:
        return [*self.other_params, *self.expert_params]

    def modules(self) -> list[nn.Module]:
        return [self.parts[s] for s in sorted(self.parts)]

    def close(self) -> None:
        """Stop the overlap worker thread (idempotent)."""
        if self.overlap is not None and not self._closed:
            self.overlap.close()
        self._closed = True


def _split_params(modules: list[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    expert_ids: set[int] = set()
    for m in modules:
        for moe in (x for x in m.modules() if isinstance(x, MoE)):
            expert_ids.update(id(p) for p in moe.experts.parameters())
    seen: set[int] = set()
    experts, others = [], []
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            (experts if id(p) in expert_ids else others).append(p)
    return experts, others


def build_parallel_model(config: TrainConfig, dims: ParallelDims, device: torch.device,
                         rank_of_pp: int, *, debug: bool = False,
                         trace: ExecutionTrace | None = None) -> ParallelModel:
    """Build this rank's part of the model, parallel over ``dims`` (meshes already built).

    Args:
        config: the validated configuration.
        dims: the layout, after ``dims.build_meshes``.
        device: this rank's device.
        rank_of_pp: this rank's coordinate on the pipeline dimension.
        debug: build the HookCoordinator (OVERLAP_B_F with EP) with ``debug=True``: it keeps
            its hook events and its serializer the launch log of every EP all-to-all, which
            ``serializer.check_launch_order`` compares across ranks.
        trace: handed to every MoE dispatcher (ep > 1), which records its all-to-all, hook
            and expert spans into it; None: no spans.
    """
    acc, pl = config.train.accelerator, config.train.pipeline
    model_spec = get_model_spec("qwen3_5")
    model = build_model(config, device, meta=True)
    n_params = parameter_count(model)
    if config.train.compile:  # regional: before CP, the pipeline split and FSDP2 wrap it

        compile_elementwise(model)
    model_spec.parallelize_cp(
        model, dims.mesh("cp"), ulysses_degree=acc.ulysses_degree,
        linear_attention_gdn_backend=acc.linear_attention_gdn_backend,
        timeout_s=acc.comm_timeout_s,
        layer_modes=layer_cp_modes(acc, config.model.layer_types),
        hierarchical_cp_mesh=dims.mesh("cp_hierarchical") if dims.cp_a2a else None,
    )
    spec = None
    if dims.pp > 1:
        spec = schedule_spec(config)
        mine = [s for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank_of_pp]
        parts: dict[int, nn.Module] = dict(model_spec.split(model, spec.num_stages, mine,
                                                            pl.layers_per_stage))
    else:
        parts = {0: model}

    coordinator = overlap = queue = None
    w_runs: dict[str, int] = {}
    if pl.defer_expert_w:  # the config rule guarantees pp > 1, ep > 1, zero_bubble/dualpipev

        queue = DeferredWQueue(name=f"pp{rank_of_pp}.experts")
        queue.listeners.append(lambda run: w_runs.__setitem__(run.reason,
                                                               w_runs.get(run.reason, 0) + 1))
    if dims.ep > 1:
        if spec is not None and pl.overlap_b_f:
            coordinator = HookCoordinator(timeout_s=acc.comm_timeout_s or DEFAULT_TIMEOUT_S,
                                          debug=debug)
            overlap = CommComputeOverlap(coordinator, device)
        for s, part in parts.items():
            model_spec.parallelize_ep(part, dims.mesh("ep"), coordinator=coordinator,
                                   tag_prefix=f"S{s}.", timeout_s=acc.comm_timeout_s,
                                   trace=trace, deferred_w=queue)

    mp_policy = None
    if config.train.precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # on a one-rank FSDP mesh a "shard" is the whole parameter: resharding after forward would
    # free only the compute-dtype copy and cast and copy every parameter again in backward
    reshard = dims.mesh("fsdp").size() > 1
    for part in parts.values():
        model_spec.apply_fsdp(part, dims.mesh("fsdp"), mp_policy,
                              expert_mesh=dims.mesh("expert_fsdp") if config.model.mlp == "moe"
                              else None, reshard_after_forward=reshard)
    if config.model.init_from is not None:  # built on meta: materialise, then read this share
        for part in parts.values():
            part.to_empty(device=device)
        model_spec.load_hf(list(parts.values()), config.model.init_from, config.model, None)

    global_tokens = dims.dp * config.data.batch_size * config.data.seq_len
    schedule = None
    if spec is not None:
        schedule = _pipeline_schedule(config, dims, device, spec, parts, overlap, global_tokens)
    experts, others = _split_params(list(parts.values()))
    return ParallelModel(parts, schedule, overlap, experts, others, n_params, global_tokens,
                         deferred_w=queue, w_runs=w_runs)


def _pipeline_schedule(config: TrainConfig, dims: ParallelDims, device: torch.device, spec: Any,
                       parts: dict[int, nn.Module], overlap: Any, global_tokens: int) -> Any:
    acc, pl = config.train.accelerator, config.train.pipeline
    check_fsdp_internals(list(parts.values()))
    rows = config.data.batch_size // pl.microbatches
    dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
    # Every boundary is [rows, S/cp, hidden] in the compute dtype: known, so no metadata
    # exchange (whose no-grad forward would issue the EP/CP collectives outside the schedule).
    meta = TensorMeta((rows, config.data.seq_len // dims.cp, config.model.hidden_size), dtype)
    pp_group = dims.mesh("pp").get_group()
    stages = []
    for s, part in sorted(parts.items()):
        st = PipelineStage(part, s, spec.num_stages, device, pp_group,
                           input_meta=meta if s > 0 else None)
        if s < spec.num_stages - 1:
            st.output_meta = meta
        stages.append(st)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ce_sum(logits, labels) / global_tokens

    schedule = PipelineSchedule(spec, stages, loss_fn=loss_fn, group=pp_group,
                                timeout_s=acc.comm_timeout_s, scale_grads=False)
    if overlap is not None:
        schedule.register_custom_function(ActionKind.OVERLAP_B_F,
                                          make_overlap_b_f_callback(overlap, device))
    return schedule

