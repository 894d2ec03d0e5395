"""Parallelising the Qwen3.5-style decoder: context parallelism and FSDP2.

``parallelize_qwen3_5_cp(model, cp_mesh, ...)`` puts every token mixer of the model on one 1-D CP
mesh: the full-attention layers get :class:`~overlap_runtime.context_parallel.ContextParallel`
(Ulysses by default), the Gated DeltaNet layers get
:class:`~overlap_runtime.context_parallel.LinearAttentionContextParallel`, each layer with its
own mode when ``layer_modes`` is given (the trainer's per-layer lists); a ``hierarchical``
attention layer uses the 2-D ``(cp_ring, cp_a2a)`` mesh of the same CP ranks. Afterwards the model's
forward takes this rank's sequence shard ``[B, S/P]`` of token ids and its position ids, and
returns the shard's logits; everything outside the mixers is token-wise and runs unchanged.

One sharding rule for the whole model: contiguous
---------------------------------------------------
The GDN layers carry a recurrent state left to right: rank ``r``'s first state is rank ``r-1``'s
last state, and the causal conv reads the last ``kernel - 1`` tokens of rank ``r-1``. That needs
rank order = sequence order, i.e. the contiguous split (rank ``r`` holds tokens
``[r*S/P, (r+1)*S/P)``); zigzag would put two distant pieces on one rank and break the chain.
A token's hidden state flows through every layer, so the attention layers must see the very same
split: they are applied with ``load_balance=None`` (contiguous) too, and the position ids follow
the tokens (``shard_positions(..., load_balance=None)``). The price is the causal imbalance of a
contiguous split in the attention layers (the last rank does ~2x the average attention work);
with one attention layer in four it is diluted, and GDN work is balanced.

FSDP2
-----
:func:`apply_fsdp` shards the parameters with ``fully_shard`` over all ``dp x cp`` ranks (a 1-D
mesh, e.g. ``mesh["dp", "cp"]._flatten()``). Every rank's gradient is a *partial sum* (its tokens
of its sequence), so the reduction must sum, not average: the trainer normalises the loss by the
global token count and :func:`apply_fsdp` sets the divide factor to 1 with sum-only collectives
(gloo has no ``PREMUL_SUM``).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlap_runtime.config.cp_modes import ATTN_HIERARCHICAL, ATTN_ULYSSES, GDN_ULYSSES
from overlap_runtime.context_parallel import MODES as FULL_ATTENTION_CP_MODES
from overlap_runtime.context_parallel import ContextParallel, LinearAttentionContextParallel
from overlap_runtime.context_parallel.ulysses import ulysses_kv_heads
from overlap_runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from overlap_runtime.moe import ExpertParallel, MoE, OverlapExpertParallel
from overlap_runtime.moe.dispatcher import SpanSink


def _check_cp_mesh(cp_mesh: DeviceMesh) -> int:
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a DeviceMesh, got {type(cp_mesh).__name__}")
    if cp_mesh.ndim != 1:
        names = cp_mesh.mesh_dim_names
        raise ValueError(
            f"cp_mesh must be the 1-D context-parallel mesh, got a {cp_mesh.ndim}-D mesh of "
            f"shape {tuple(cp_mesh.shape)} (dims {names}); pass mesh['cp'] (the mesh has no "
            f"single cp dimension otherwise)"
        )
    return cp_mesh.size()


def parallelize_qwen3_5_cp(
    model: Qwen3_5ForCausalLM,
    cp_mesh: DeviceMesh,
    ulysses_degree: int | None = None,
    linear_attention_cp_mode: str = GDN_ULYSSES.name,
    linear_attention_gdn_backend: str = "eager",
    full_attention_cp_mode: str = ATTN_ULYSSES.name,
    timeout_s: float | None = None,
    *,
    layer_modes: Sequence[str] | None = None,
    hierarchical_cp_mesh: DeviceMesh | None = None,
) -> Qwen3_5ForCausalLM:
    """Make every token mixer of ``model`` context parallel over the 1-D ``cp_mesh``.

    Args:
        model: a :class:`Qwen3_5ForCausalLM` (not yet FSDP-sharded).
        cp_mesh: the 1-D CP mesh (``mesh["cp"]``).
        ulysses_degree: Ulysses degree of the full-attention layers: None or ``cp_mesh.size()``
            (pure Ulysses); anything else raises NotImplementedError (Ulysses x ring is
            ``full_attention_cp_mode="hierarchical"``).
        linear_attention_cp_mode: GDN CP algorithm, ``"ulysses"``, ``"p2p"``, ``"all_gather"``
            (any name of ``LINEAR_ATTENTION_CP_MODES``).
        linear_attention_gdn_backend: local GDN kernel, ``"eager"`` or ``"triton"``.
        full_attention_cp_mode: full-attention CP algorithm, ``"ulysses"`` (default),
            ``"ring"``, ``"all_gather_kv"`` or ``"hierarchical"``
            (needs ``hierarchical_cp_mesh``); always contiguous.
        timeout_s: bound on every CP communication wait (None: the comm default).
        layer_modes: one mode per decoder layer (``config.cp.layer_cp_modes``: a GDN
            mode for a ``linear_attention`` layer, an attention mode for a ``full_attention``
            one); None: the two scalar modes above for every layer of their kind.
        hierarchical_cp_mesh: the 2-D ``("cp_ring", "cp_a2a")`` mesh of ``cp_mesh``
            (``context_parallel.hierarchical_cp_mesh``; the trainer's ``ParallelDims`` mesh
            ``"cp_hierarchical"``), required when a layer's mode is ``"hierarchical"``.

    Returns:
        ``model``, changed in place. With ``cp_mesh.size() == 1`` it is returned untouched
        (after the arguments are validated).

    Raises:
        NotImplementedError: ``ulysses_degree`` not in (None, cp size).
        ValueError: an unknown mode or backend, a ``layer_modes`` of the wrong length, a
            hierarchical layer without its mesh; head counts Ulysses cannot split; GDN kernel
            options (``model.gdn_kernel_options``) a layer's mode and backend cannot take
            (``LinearAttentionContextParallel.kernel_option_problems``).
    """
    cp_size = _check_cp_mesh(cp_mesh)
    if ulysses_degree is not None and ulysses_degree != cp_size:
        raise NotImplementedError(
            f"ulysses_degree={ulysses_degree}: only pure Ulysses (None or the cp size "
            f"{cp_size}) is supported for the full-attention layers; Ulysses x ring is "
            f"full_attention_cp_mode='hierarchical'"
        )
    cfg = model.config
    if layer_modes is None:
        layer_modes = [full_attention_cp_mode if t == "full_attention" else
                       linear_attention_cp_mode for t in cfg.layer_types]
    if len(layer_modes) != len(model.layers):
        raise ValueError(f"layer_modes has {len(layer_modes)} entries for a model of "
                         f"{len(model.layers)} decoder layers")
    # Validate every layer's mode (and the backend) before anything is changed.
    styles: list[Any] = []
    for i, (layer, mode) in enumerate(zip(model.layers, layer_modes)):
        if layer.linear_attn is not None:
            style = LinearAttentionContextParallel(
                mode=mode, backend=linear_attention_gdn_backend, tp_size=1, timeout_s=timeout_s)
            problems = style.kernel_option_problems(layer.linear_attn.kernel_options)
            if problems:  # model.gdn_kernel_options against this layer's mode and CP backend
                raise ValueError(f"layer {i} (linear_attention): {'; '.join(problems)}")
            styles.append(style)
            continue
        if mode not in FULL_ATTENTION_CP_MODES:
            raise ValueError(f"layer {i} (full_attention): unknown full_attention_cp_mode "
                             f"{mode!r}; supported: {FULL_ATTENTION_CP_MODES}")
        if cp_size > 1 and mode == ATTN_ULYSSES.name:
            ulysses_kv_heads(cfg.num_attention_heads, cfg.num_key_value_heads, cp_size)
        if cp_size > 1 and mode == ATTN_HIERARCHICAL.name:
            if hierarchical_cp_mesh is None or hierarchical_cp_mesh.size() != cp_size:
                raise ValueError(f"layer {i}: full_attention_cp_mode 'hierarchical' needs "
                                 f"hierarchical_cp_mesh, the 2-D (cp_ring, cp_a2a) mesh of the "
                                 f"{cp_size} CP ranks; got {hierarchical_cp_mesh!r}")
            ulysses_kv_heads(cfg.num_attention_heads, cfg.num_key_value_heads,
                             hierarchical_cp_mesh.size(1))
        styles.append(ContextParallel(mode=mode, load_balance=None, timeout_s=timeout_s,
                                      backend=cfg.attention_backend))
    if cp_size == 1:
        return model
    for layer, style in zip(model.layers, styles):
        if layer.linear_attn is not None:
            style.apply(layer.linear_attn, cp_mesh)
        else:
            mesh = hierarchical_cp_mesh if style.mode == ATTN_HIERARCHICAL.name else cp_mesh
            style.apply(layer.self_attn, mesh)
    model.cp_size = cp_size
    model.cp_rank = cp_mesh.get_local_rank()
    return model


def build_dp_cp_mesh(device_type: str, dp: int, cp: int) -> DeviceMesh:
    """The 2-D ``("dp", "cp")`` mesh of all ranks (``dp * cp`` must equal the world size).

    Rank ``d * cp + c`` is CP rank ``c`` of data-parallel group ``d``: the CP ranks of one
    sequence are adjacent (on one host when ``cp`` divides the GPUs per host).
    """
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def _flat_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over ``dp x cp`` that FSDP shards on (``mesh["dp", "cp"]`` flattened)."""
    return mesh["dp", "cp"]._flatten("dp_cp")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: Any | None = None,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """``fully_shard`` the routed experts, each decoder layer, then the root.

    Args:
        model: the (already context- and expert-parallel) model, or one pipeline stage of it
            (:class:`~overlap_runtime.models.pipeline_split.Qwen3_5Stage`): anything with a
            ``layers`` ModuleList / ModuleDict of decoder layers.
        mesh: the mesh of every rank that holds a piece of the data: 1-D (``dp_shard x cp``
            flattened, :func:`_flat_data_mesh`) or 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP.
        mp_policy: an FSDP ``MixedPrecisionPolicy`` or None (parameters' own dtype).
        reshard_after_forward: free the unsharded parameters after forward (re-gather in
            backward).
        expert_mesh: the mesh the routed experts of each MoE layer are sharded on (``efsdp``, or
            ``(dp_replicate, efsdp)``; see ``trainer.parallel_dims``); None: they are sharded
            with their layer on ``mesh``.

    Gradients are *summed* over the mesh (divide factor 1): each rank's loss must already be
    normalised by the global number of tokens. A tied LM head shares the embedding's parameter
    and both stay in the root's group.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    for name, m in (("mesh", mesh), ("expert_mesh", expert_mesh)):
        if m is not None and m.ndim not in (1, 2):
            raise ValueError(f"apply_fsdp: {name} must be 1-D (sharded) or 2-D (replicate, "
                             f"shard) for HSDP, got shape {tuple(m.shape)}")
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                              "mp_policy": policy}
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        if expert_mesh is not None:
            for moe in (m for m in layer.modules() if isinstance(m, MoE)):
                fully_shard(moe.experts, **{**kwargs, "mesh": expert_mesh})
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def parallelize_qwen3_5_ep(model: nn.Module, ep_mesh: DeviceMesh, *, coordinator: Any = None,
                           tag_prefix: str = "", timeout_s: float | None = None,
                           trace: SpanSink | None = None, deferred_w: Any = None) -> nn.Module:
    """Shard the routed experts of every MoE layer of ``model`` (or of a pipeline stage) over
    the 1-D ``ep_mesh``: each EP rank keeps ``num_experts / ep`` consecutive experts and gets an
    all-to-all dispatcher over the EP group (``moe.ExpertParallel``). With a ``coordinator``
    (a ``HookCoordinator``) the layers also get the A/B/C/D(/D_LAST) sync hooks, so the
    OVERLAP_B_F callback can interleave two microbatches' all-to-alls
    (``moe.OverlapExpertParallel``; ``tag_prefix`` names the stage, e.g. ``"S2."``).
    ``trace`` (a span sink such as a ``pipeline.ExecutionTrace``, or None) receives every
    dispatcher's all-to-all, hook and expert spans. ``deferred_w`` (a ``DeferredWQueue``, not
    with a ``coordinator``): the experts defer their weight gradients to it while it captures
    and the dispatchers run its pending tasks in the all-to-all windows.

    With ``ep_mesh.size() == 1`` the model is returned untouched.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"parallelize_qwen3_5_ep: ep_mesh must be the 1-D EP mesh, got shape "
                         f"{tuple(ep_mesh.shape)}")
    if ep_mesh.size() == 1:
        return model
    if coordinator is not None and deferred_w is not None:
        raise ValueError("parallelize_qwen3_5_ep: deferred_w with a coordinator (OVERLAP_B_F "
                         "hooks) is not supported: its two threads would run one W queue at once")
    if coordinator is not None:
        style: Any = OverlapExpertParallel(coordinator, tag_prefix=tag_prefix, trace=trace,
                                           timeout_s=timeout_s)
    else:
        style = ExpertParallel(tag_prefix=tag_prefix, trace=trace, timeout_s=timeout_s,
                               deferred_w=deferred_w)
    return style.apply(model, ep_mesh)


def parameter_count(model: nn.Module) -> int:
    """Number of parameters (a tied weight counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

