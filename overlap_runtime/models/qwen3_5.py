"""Qwen3.5-style hybrid decoder: Gated DeltaNet and full-attention layers at 3:1, composed from
``overlap_runtime.layers``.

::

    input_ids [B, S] --embed_tokens--> h [B, S, hidden]
    for each layer i (layer_types[i]):
        h = h + mixer(input_layernorm(h))      mixer: GatedDeltaNet ("linear_attention")
                                                      or Qwen3_5Attention ("full_attention")
        h = h + mlp(post_attention_layernorm(h))      mlp: SwiGLU or MoE (config.mlp)
    (autograd nodes: input_layernorm passes h through as the residual,
    RMSNorm.forward_keep_input; the mixer's add and post_attention_layernorm are one,
    RMSNorm.add_forward: each use of h twice gets one summed gradient)
    logits = lm_head(norm(h))                  [B, S, vocab]   (lm_head tied to the embedding
                                                                if tie_word_embeddings)

Layer ``i``'s mixer is ``layer_types[i]``: an explicit list, or when none is given full attention
for ``(i + 1) % full_attention_interval == 0`` (interval 4: three GDN layers, then one attention
layer, as Qwen3.5).

Hugging Face parity (``transformers``' ``qwen3_5`` / ``qwen3_5_moe`` text models): with
``zero_centered_norms``, ``shared_expert_gate``, ``router_renormalize_top1`` and
``init_style="hf"`` (what :func:`~overlap_runtime.config.hf.config_from_hf` sets for an
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

from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from overlap_runtime.config.model import (KERNEL_TUNING_FIELDS, GDNKernelOptionsConfig, LayerType,
                                          Qwen3_5Config)
from overlap_runtime.layers import GatedDeltaNet, Qwen3_5Attention, RMSNorm
from overlap_runtime.layers.segments import document_positions
from overlap_runtime.models.mlp import build_mlp
from overlap_runtime.moe.pooled_aux import RouterStatsPool

# the configuration classes live in the configuration floor (``config.model``); the model
# package presents them with the modules they configure


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
        # the input's two uses (norm, residual) get one gradient: the residual passes through
        # the norm's node, and the mixer's add and the next norm are one node
        x, residual = self.input_layernorm.forward_keep_input(hidden_states)
        if self.linear_attn is not None:
            mixed = self.linear_attn(x, cu_seqlens=cu_seqlens)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(x, position_ids, cu_seqlens=cu_seqlens)
        h, y = self.post_attention_layernorm.add_forward(residual, mixed)
        if router_pool is not None:
            return h + self.mlp(y, router_pool=router_pool)
        return h + self.mlp(y)


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
            pool = RouterStatsPool(self.config.moe_aux_loss_coef)
        for layer in self.layers:
            h = layer(h, position_ids, cu_seqlens, pool)
        return self.lm_head(self.norm(h))
