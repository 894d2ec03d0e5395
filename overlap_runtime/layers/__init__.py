"""Plain model layers: Gated DeltaNet, attention, norms, RoPE, SwiGLU.

The floor between ``ops`` (kernels and collectives) and the packages that parallelise or compose
layers (``context_parallel``, ``models``). May import ``torch`` and ``overlap_runtime.ops`` only.

Every layer runs on one device as built. Each parallel concern is one swappable strategy
submodule on the layer, holding configuration only:

* ``GatedDeltaNet.sequence_mixer`` (``sequence_mixer.GDNSequenceMixer``): the causal conv and the
  GDN recurrence, from the layer's projections to ``o [B, T, HV, V]``; ``LocalGDNMixer`` by
  default, a CP mode's mixer after ``context_parallel.LinearAttentionContextParallel.apply``.
* ``core_attention`` of the attention layers (``core_attention.CoreAttention``): ``(q, k, v) ->
  out [B, S, Hq, D]``; swapped by ``context_parallel.ContextParallel.apply``.

Everything else in a layer is token-wise and runs unchanged on a sequence shard.

Packed documents (``segments``): the mixers take ``cu_seqlens`` and run each document alone
(single device), so a packed row resets at its document boundaries.

Helpers (``rope.apply_rotary``, ``rope.apply_partial_rotary``, ``segments.segments_of``,
``segments.apply_per_segment``, ``shared_input.shared_input_linear``) are imported from their
modules.
"""

from overlap_runtime.layers.attention import Qwen3_5Attention, ReferenceAttention
from overlap_runtime.layers.core_attention import CoreAttention, HasCoreAttention
from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.layers.mlp import SwiGLU
from overlap_runtime.layers.norm import RMSNorm, RMSNormGated
from overlap_runtime.layers.rope import rotary_dim_for
from overlap_runtime.layers.segments import document_positions
from overlap_runtime.layers.sequence_mixer import GDNSequenceMixer, LocalGDNMixer, MixerInputs

__all__ = [
    "CoreAttention",
    "GDNProjections",
    "GDNSequenceMixer",
    "GatedDeltaNet",
    "HasCoreAttention",
    "LocalGDNMixer",
    "MixerInputs",
    "Qwen3_5Attention",
    "RMSNorm",
    "RMSNormGated",
    "ReferenceAttention",
    "SwiGLU",
    "document_positions",
    "rotary_dim_for",
]
