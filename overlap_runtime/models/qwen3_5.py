"""Qwen3.5-style hybrid decoder: Gated DeltaNet and full-attention layers at 3:1, composed from
``overlap_runtime.layers``.

::

    input_ids [B, S] --embed_tokens--> h [B, S, hidden]
    for each layer i (layer_types[i]):
        h = h + mixer(input_layernorm(h))      mixer: GatedDeltaNet ("linear_attention")
                                                      or Qwen3_5Attention ("full_attention")
        h = h + mlp(post_attention_layernorm(h))      mlp: SwiGLU or MoE (config.mlp)
    logits = lm_head(norm(h))                  [B, S, vocab]   (lm_head tied to the embedding
                                                                if tie_word_embeddings)

Layer ``i``'s mixer is ``layer_types[i]``: an explicit list, or when none is given full attention
for ``(i + 1) % full_attention_interval == 0`` (interval 4: three GDN layers, then one attention
layer, as Qwen3.5).

Hugging Face parity (``transformers``' ``qwen3_5`` / ``qwen3_5_moe`` text models): with
``zero_centered_norms``, ``shared_expert_gate``, ``router_renormalize_top1`` and
``init_style="hf"`` (what :func:`~overlap_runtime.models.hf.config.config_from_hf` sets for an
imported checkpoint) the decoder computes what ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
compute, parameter for parameter (docs/training.md, "Start from a Hugging Face checkpoint"). Every piece outside the two mixers is
token-wise, so after ``parallelize_qwen3_5_cp`` the same forward runs on a contiguous sequence
shard ``[B, S/P]`` with that shard's position ids.

Packed documents: ``forward(input_ids, position_ids, cu_seqlens=...)`` (``layers.segments``)
makes every layer reset at document boundaries - full attention causal within each document, the
GDN conv and state restarting at each document - and, with ``position_ids=None``, RoPE positions
restarting too (otherwise pass per-document positions). The eager single-device path (cp == 1,
the whole model on one pipeline stage): each document runs through the mixers on its own, so the
result equals running the documents separately. Under context parallelism the same
call takes this rank's contiguous shard and the *global* ``cu_seqlens`` (over the ``B * S`` tokens
of the whole rows): the GDN mixers chain per-document state maps
(``context_parallel/gdn/varlen.py``), attention masks by document (``varlen_attention.py``).

Activation checkpointing (``model.set_activation_checkpointing(True)``) recomputes each decoder
layer in backward (``torch.utils.checkpoint``, non-reentrant, inside the layer's forward so that
FSDP's hooks on the layer stay outside the recomputed region). A layer's recompute issues the
same collectives in the same order on every CP rank, so it is safe with every CP mode.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from overlap_runtime.layers import GatedDeltaNet, Qwen3_5Attention, RMSNorm, rotary_dim_for
from overlap_runtime.layers.segments import document_positions
from overlap_runtime.models.mlp import build_mlp
from overlap_runtime.ops.gdn import GDNKernelOptions

__all__ = ["GDNKernelOptionsConfig", "KERNEL_TUNING_FIELDS", "Qwen3_5Config",
           "Qwen3_5DecoderLayer", "Qwen3_5ForCausalLM", "LayerType"]

LayerType = Literal["linear_attention", "full_attention"]

#: Model fields that change speed and memory only, never the model or its results: left out of
#: the model identity a checkpoint records (``trainer.loop``), so tuning them does not refuse a
#: resume.
KERNEL_TUNING_FIELDS: frozenset[str] = frozenset({"gdn_kernel_options"})

#: Model fields that say where the weights come from, not what the model is: left out of the
#: identity a checkpoint records, like :data:`KERNEL_TUNING_FIELDS`.
PROVENANCE_FIELDS: frozenset[str] = frozenset({"init_from"})


class GDNKernelOptionsConfig(BaseModel):
    """``model.gdn_kernel_options``: the GDN op's tuning knobs from YAML (all optional; unset:
    the backend's default). The values' rules are :class:`~overlap_runtime.ops.gdn.
    GDNKernelOptions`' own (checked here by building one); which backend each field applies to
    is checked against ``model.gdn_backend`` by :class:`Qwen3_5Config`.

    Attributes:
        block_chunks: eager only, chunks per recompute block of the memory-lean backward.
        num_segments: triton only, segments of the state scan (1: the plain sequential walk).
        recompute_w: triton only, do not save the WY factor w, form it again in the backward.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    block_chunks: int | None = None
    num_segments: int | None = None
    recompute_w: bool | None = None

    @model_validator(mode="after")
    def _check_values(self) -> "GDNKernelOptionsConfig":
        self.to_options()
        return self

    def to_options(self) -> GDNKernelOptions | None:
        """The op's :class:`GDNKernelOptions`, or None when no field is set."""
        set_fields = {k: v for k, v in self.model_dump().items() if v is not None}
        if not set_fields:
            return None
        try:
            return GDNKernelOptions(**set_fields)
        except TypeError as exc:  # pydantic reports ValueErrors only
            raise ValueError(str(exc)) from None


class Qwen3_5Config(BaseModel):
    """Size and structure of the decoder (defaults: a tiny CPU model).

    Field names follow the Hugging Face Qwen3.5/Qwen3-Next configs where one exists.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    vocab_size: int = Field(260, ge=2, description="256 bytes + 4 specials (trainer.data)")
    hidden_size: int = Field(32, ge=1)
    num_hidden_layers: int = Field(4, ge=1)
    full_attention_interval: int = Field(4, ge=1, description="every n-th layer is attention "
                                         "(used when layer_types is not given)")
    explicit_layer_types: tuple[LayerType, ...] | None = Field(
        None, alias="layer_types", description="the mixer of each layer, 'linear_attention' or "
        "'full_attention' (Hugging Face's layer_types); None: from full_attention_interval")
    # full attention
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int = Field(8, ge=2)
    rope_theta: float = Field(10000.0, gt=0)
    partial_rotary_factor: float = Field(0.5, gt=0, le=1)
    attn_output_gate: bool = True
    attention_backend: Literal["math", "flash", "cudnn"] = "math"
    # Gated DeltaNet
    linear_num_key_heads: int = Field(2, ge=1)
    linear_num_value_heads: int = Field(4, ge=1)
    linear_key_head_dim: int = Field(8, ge=1)
    linear_value_head_dim: int = Field(8, ge=1)
    linear_conv_kernel_dim: int = Field(4, ge=1)
    gdn_chunk_size: int = Field(64, ge=1)
    gdn_backend: Literal["eager", "triton"] = "eager"
    conv_backend: Literal["torch", "triton"] = Field(
        "torch", description="GDN causal conv + SiLU: torch (F.conv1d, compiled shifted sum "
        "under train.compile) or triton (ops.causal_conv, also in the CP halo conv)")
    gdn_kernel_options: GDNKernelOptionsConfig = Field(
        default_factory=GDNKernelOptionsConfig,
        description="GDN op tuning (GDNKernelOptions): block_chunks (eager), num_segments and "
        "recompute_w (triton); unset: the backend's defaults; an option of the other backend "
        "raises")
    # feed-forward
    mlp: Literal["swiglu", "moe"] = "swiglu"
    intermediate_size: int = Field(64, ge=1)
    num_experts: int = Field(4, ge=1)
    num_experts_per_tok: int = Field(2, ge=1)
    moe_intermediate_size: int = Field(32, ge=1)
    shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coef: float = Field(0.0, ge=0)
    moe_aux_loss_pooling: Literal["per_layer", "model"] = Field(
        "per_layer", description="the load-balancing loss: 'per_layer' (each MoE call's own "
        "statistic) or 'model' (one statistic over every MoE layer of the forward, Hugging "
        "Face's router_aux_loss_coef form; pp == 1)")
    shared_expert_gate: bool = Field(
        False, description="gate the shared expert per token by sigmoid(Linear(hidden -> 1)) "
        "(Qwen3.5-MoE); needs shared_expert_intermediate_size")
    router_renormalize_top1: bool = Field(
        False, description="renormalise the router's kept scores at num_experts_per_tok == 1 "
        "too (Hugging Face: always)")
    # the rest
    rms_norm_eps: float = Field(1e-6, gt=0)
    zero_centered_norms: bool = Field(
        False, description="decoder RMSNorms (input, post-attention, final, q_norm, k_norm) store "
        "scale - 1, starting at 0, as Hugging Face's Qwen3.5 (x_hat * (1 + w)); the GDN output "
        "norm stores its scale either way")
    tie_word_embeddings: bool = False
    initializer_range: float = Field(0.02, gt=0)
    init_style: Literal["overlap", "hf"] = Field(
        "overlap", description="random initialisation: 'overlap' (experts N(0, 1/fan_in), A_log "
        "from U(1, 16), torch's conv init) or 'hf' (transformers' _init_weights: every linear, "
        "conv and expert weight N(0, initializer_range), A_log from U(0.01, 16))")
    hf_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype of the Hugging Face checkpoint the weights came from; export "
        "writes this dtype (None: float32)")
    init_from: str | None = Field(
        None, description="a Hugging Face model directory (config.json + safetensors): the "
        "architecture fields come from its config.json and the weights from its safetensors, "
        "each rank reading only its share (models.hf)")
    @field_validator("gdn_kernel_options", mode="before")
    @classmethod
    def _null_is_no_options(cls, value: object) -> object:
        return {} if value is None else value  # YAML `gdn_kernel_options: null`

    @model_validator(mode="after")
    def _check(self) -> "Qwen3_5Config":
        options = self.gdn_kernel_options.to_options()
        if options is not None:
            try:
                options.check_backend(self.gdn_backend)
            except ValueError as exc:
                raise ValueError(f"model.gdn_kernel_options does not fit model.gdn_backend="
                                 f"{self.gdn_backend!r}: {exc}") from None
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"model.linear_num_value_heads={self.linear_num_value_heads} must be a multiple "
                f"of model.linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"model.num_experts={self.num_experts}"
            )
        rotary_dim_for(self.head_dim, self.partial_rotary_factor)  # raises on an odd rotary dim
        if self.explicit_layer_types is not None and \
                len(self.explicit_layer_types) != self.num_hidden_layers:
            raise ValueError(f"model.layer_types has {len(self.explicit_layer_types)} entries, "
                             f"model.num_hidden_layers={self.num_hidden_layers}: one per layer")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("model.shared_expert_gate=true needs a shared expert "
                             "(model.shared_expert_intermediate_size)")
        return self

    def identity(self) -> dict[str, Any]:
        """The JSON dump of the fields that define the model (all but
        :data:`KERNEL_TUNING_FIELDS` and :data:`PROVENANCE_FIELDS`): what a checkpoint records
        and a resume compares."""
        return self.model_dump(mode="json",
                               exclude=set(KERNEL_TUNING_FIELDS | PROVENANCE_FIELDS))

    @property
    def layer_types(self) -> list[LayerType]:
        """The mixer of every layer: ``model.layer_types`` when given, else
        ``"full_attention"`` for layers ``i`` with ``(i+1) % full_attention_interval == 0``."""
        if self.explicit_layer_types is not None:
            return list(self.explicit_layer_types)
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)]


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm residual block: a token mixer (GDN or attention) and a feed-forward block.

    Exactly one of ``linear_attn`` (GatedDeltaNet) and ``self_attn`` (Qwen3_5Attention) is set,
    per ``layer_type``.
    """

    def __init__(self, config: Qwen3_5Config, layer_type: LayerType) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.activation_checkpoint = False
        zc = config.zero_centered_norms
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zc)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zc)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: Qwen3_5Attention | None = None
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim,
                config.linear_conv_kernel_dim, config.rms_norm_eps, config.gdn_chunk_size,
                config.gdn_backend, config.conv_backend,
                kernel_options=config.gdn_kernel_options.to_options(),
            )
        else:
            self.self_attn = Qwen3_5Attention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, config.rope_theta, config.partial_rotary_factor,
                config.attn_output_gate, config.rms_norm_eps, config.attention_backend,
                norm_zero_centered=config.zero_centered_norms,
            )
        self.mlp = build_mlp(config)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, router_pool: Any = None) -> torch.Tensor:
        """``[B, S, hidden]`` (and ``position_ids [S]`` / ``[B, S]`` int64) -> ``[B, S, hidden]``.

        ``cu_seqlens``: packed documents, the mixers reset at their boundaries (module
        docstring). ``router_pool``: the forward's pooled load-balancing statistics
        (``moe.pooled_aux``), for an MoE feed-forward. With ``activation_checkpoint`` set, only the layer's input is kept for
        backward and the layer is recomputed there.
        """
        if self.activation_checkpoint and torch.is_grad_enabled():
            return torch_checkpoint.checkpoint(
                self._block, hidden_states, position_ids, cu_seqlens, router_pool,
                use_reentrant=False
            )
        return self._block(hidden_states, position_ids, cu_seqlens, router_pool)

    def _block(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
               cu_seqlens: torch.Tensor | None = None, router_pool: Any = None) -> torch.Tensor:
        x = self.input_layernorm(hidden_states)
        if self.linear_attn is not None:
            mixed = self.linear_attn(x, cu_seqlens=cu_seqlens)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(x, position_ids, cu_seqlens=cu_seqlens)
        h = hidden_states + mixed
        if router_pool is not None:
            return h + self.mlp(self.post_attention_layernorm(h), router_pool=router_pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5ForCausalLM(nn.Module):
    """The decoder with its embedding and LM head (see the module docstring).

    Attributes:
        cp_rank, cp_size: set by ``parallelize_qwen3_5_cp``; used only to derive default
            position ids of a contiguous shard when the caller passes none.
    """

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, t) for t in config.layer_types
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norms)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.cp_rank = 0
        self.cp_size = 1
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random weights by ``config.init_style``.

        ``"overlap"``: linear and embedding weights ~ N(0, initializer_range); the GDN gates, the
        conv and the routed experts keep their own init. ``"hf"``: transformers'
        ``_init_weights`` for Qwen3.5: linear, conv, embedding and routed-expert weights
        ~ N(0, initializer_range), ``dt_bias = 1``, ``A_log = log U(0.01, 16)``; norms keep
        their construction values (zero-centred 0, others 1).

        Draws from the global RNG in module order, so one seed gives one model on every rank.
        On the meta device (a model built to be loaded) nothing is drawn.
        """
        if self.embed_tokens.weight.is_meta:
            return
        std = self.config.initializer_range
        hf = self.config.init_style == "hf"
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) or (hf and isinstance(module, nn.Conv1d)):
                module.weight.normal_(0.0, std)
            elif hf and isinstance(module, GatedDeltaNet):
                module.dt_bias.fill_(1.0)
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16.0).log())
            elif hf and isinstance(getattr(module, "w1", None), nn.Parameter):
                # routed experts (moe.GroupedExperts, not imported here): stacked [E, ...]
                for w in (module.w1, module.w3, module.w2):
                    w.normal_(0.0, std)

    def materialize(self, device: torch.device | str) -> "Qwen3_5ForCausalLM":
        """Storage for a model built on the meta device (uninitialised, to be loaded), the
        embedding still tied to the LM head when ``tie_word_embeddings``. Returns self."""
        self.to_empty(device=device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        return self

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute every decoder layer in backward (True) or keep activations (False)."""
        for layer in self.layers:
            layer.activation_checkpoint = bool(enabled)

    def default_position_ids(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Positions ``[local_len]`` int64 of this rank's contiguous shard (all of it at cp=1)."""
        start = self.cp_rank * local_len
        return torch.arange(start, start + local_len, device=device)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the next token.

        Args:
            input_ids: ``[B, S]`` int64 (under CP: this rank's contiguous shard ``[B, S/P]``).
            position_ids: ``[S]`` or ``[B, S]`` int64 absolute positions of those tokens; None:
                the positions of a contiguous shard (:meth:`default_position_ids`), or with
                ``cu_seqlens`` the position of each token in its document.
            cu_seqlens: ``[n + 1]`` int32/int64 document starts over the ``B * S`` tokens
                flattened, then ``B * S`` (every row start included; ``layers.segments``):
                reset at document boundaries. None: one stream per row.

        Returns:
            ``[B, S, vocab]`` in the parameters' dtype.
        """
        if position_ids is None:
            if cu_seqlens is None:
                position_ids = self.default_position_ids(input_ids.shape[1], input_ids.device)
            else:  # cu_seqlens is global: this rank's contiguous slice of the document positions
                b, local = input_ids.shape
                start = self.cp_rank * local
                position_ids = document_positions(cu_seqlens, b, local * self.cp_size)[
                    :, start:start + local]
        h = self.embed_tokens(input_ids)
        pool = None
        if self.config.mlp == "moe" and self.config.moe_aux_loss_pooling == "model":
            from overlap_runtime.moe.pooled_aux import RouterStatsPool

            pool = RouterStatsPool(self.config.moe_aux_loss_coef)
        for layer in self.layers:
            h = layer(h, position_ids, cu_seqlens, pool)
        return self.lm_head(self.norm(h))
