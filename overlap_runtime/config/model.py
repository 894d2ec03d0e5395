"""The decoder's configuration: ``Qwen3_5Config`` (the YAML ``model`` section) and its GDN kernel
options, as pure data (pydantic; no torch.distributed, no module is built).

Field names follow the Hugging Face Qwen3.5 / Qwen3-Next configs where one exists
(``config.hf`` translates a ``config.json``). :meth:`Qwen3_5Config.layer_parameters` counts the
parameters of one decoder layer from the fields alone (the simulator's memory model); a test
compares it with a layer built on the meta device.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from overlap_runtime.layers.rope import rotary_dim_for
from overlap_runtime.ops.gdn.options import GDNKernelOptions

LayerType = Literal["linear_attention", "full_attention"]
#: the decoder-layer kinds (``model.layer_types`` entries)
LAYER_KINDS: tuple[str, ...] = ("linear_attention", "full_attention")

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
        fused_forward: triton only, the fused forward (two prep launches with the l2 norm
            folded in, then one walk that keeps the state on chip and writes o).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    block_chunks: int | None = None
    num_segments: int | None = None
    recompute_w: bool | None = None
    fused_forward: bool | None = None

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

    def layer_parameters(self, kind: str) -> tuple[int, int]:
        """``(dense, routed-expert)`` parameter counts of one decoder layer of ``kind``
        (``"linear_attention"`` or ``"full_attention"``): its two norms, its mixer and its
        feed-forward block, counted from the fields (``models.qwen3_5.Qwen3_5DecoderLayer``
        holds exactly these tensors, no biases)."""
        h = self.hidden_size
        if kind == "linear_attention":
            key = self.linear_num_key_heads * self.linear_key_head_dim
            value = self.linear_num_value_heads * self.linear_value_head_dim
            conv = 2 * key + value
            mixer = (conv * h + value * h + 2 * self.linear_num_value_heads * h  # qkv, z, b, a
                     + conv * self.linear_conv_kernel_dim                       # depthwise conv
                     + 2 * self.linear_num_value_heads                          # dt_bias, A_log
                     + self.linear_value_head_dim + h * value)                  # norm, out
        elif kind == "full_attention":
            q = self.num_attention_heads * self.head_dim
            kv = self.num_key_value_heads * self.head_dim
            mixer = (q * (2 if self.attn_output_gate else 1) * h + 2 * kv * h + h * q
                     + 2 * self.head_dim)                                       # q/k norms
        else:
            raise ValueError(f"layer kind {kind!r} is not one of {LAYER_KINDS}")
        expert = 0
        if self.mlp == "moe":
            ffn = self.num_experts * h                                          # router
            expert = 3 * self.num_experts * h * self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                ffn += 3 * h * self.shared_expert_intermediate_size
            if self.shared_expert_gate:
                ffn += h
        else:
            ffn = 3 * h * self.intermediate_size
        return 2 * h + mixer + ffn, expert
