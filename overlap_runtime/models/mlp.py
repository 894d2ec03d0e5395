"""The decoder's feed-forward block: ``layers.SwiGLU`` or a mixture of experts (``moe.MoE``).

The choice is the model config's ``mlp`` field (``"swiglu"`` or ``"moe"``). The MoE layer lives
in another package that this one does not depend on: it is imported only when ``mlp="moe"``,
and a missing or incompatible ``overlap_runtime.moe`` raises ``NotImplementedError`` naming the
field.

Both blocks are token-wise (a token's output reads only that token), so they run unchanged on a
context-parallel sequence shard. Caveat for MoE under CP: the router's load-balancing loss is a
statistic of the tokens a rank sees, so with ``moe_aux_loss_coef > 0`` a CP run optimises a
slightly different objective than one device (set it to 0 for an exact alignment check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from overlap_runtime.layers.mlp import SwiGLU

if TYPE_CHECKING:
    from overlap_runtime.models.qwen3_5 import Qwen3_5Config


def build_mlp(config: "Qwen3_5Config") -> nn.Module:
    """The feed-forward block ``config.mlp`` names.

    Raises:
        NotImplementedError: ``mlp="moe"`` and ``overlap_runtime.moe`` has no usable ``MoE``.
        ValueError: an unknown ``mlp`` value.
    """
    if config.mlp == "swiglu":
        return SwiGLU(config.hidden_size, config.intermediate_size)
    if config.mlp == "moe":
        try:
            from overlap_runtime.moe import MoE
        except ImportError as exc:
            raise NotImplementedError(
                f"model.mlp='moe' needs overlap_runtime.moe.MoE, which is not available "
                f"({exc}); use model.mlp='swiglu'"
            ) from exc
        return MoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            shared_ffn_hidden=config.shared_expert_intermediate_size,
            # pooled over the model: the forward's RouterStatsPool carries the coefficient
            aux_loss_coef=(config.moe_aux_loss_coef if config.moe_aux_loss_pooling == "per_layer"
                           else 0.0),
            shared_expert_gate=config.shared_expert_gate,
            renormalize_top1=config.router_renormalize_top1,
        )
    raise ValueError(f"model.mlp={config.mlp!r}: must be 'swiglu' or 'moe'")
