"""Context parallelism: sequence sharding, full-attention CP (Ulysses, ring, all-gather K/V) and
Gated DeltaNet CP (ulysses, p2p state chain, all-gather of affine summaries).

See docs/context_parallel.md and docs/gdn_context_parallel.md. One algorithm per module:
``sharding`` (contiguous and zigzag splits), ``ulysses``, ``ring``, ``all_gather_kv``, ``api``
(``ContextParallel``), ``linear_attention``
(``LinearAttentionContextParallel``) with ``gdn_cp_ulysses``, ``gdn_cp_p2p``,
``gdn_cp_all_gather`` and ``gdn_cp_task_graph``.
"""

from overlap_runtime.context_parallel.all_gather_kv import all_gather_kv_attention
from overlap_runtime.context_parallel.api import (
    MODES,
    ContextParallel,
    ContextParallelCoreAttention,
    CoreAttention,
    HasCoreAttention,
    Mode,
    ReferenceAttention,
    apply_rotary,
)
from overlap_runtime.context_parallel.gdn_cp_task_graph import (
    GDN_P2P_NODE_KINDS,
    gdn_p2p_cost_model,
    gdn_p2p_task_graph,
    simulate_gdn_p2p,
)
from overlap_runtime.context_parallel.linear_attention import (
    LINEAR_ATTENTION_CP_MODES,
    LinearAttentionContextParallel,
)
from overlap_runtime.context_parallel.ring import ring_attention
from overlap_runtime.context_parallel.sharding import (
    LoadBalance,
    check_sequence_length,
    gather_sequence,
    reorder_to_sequence,
    reorder_to_shards,
    sequence_permutation,
    shard_batch,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from overlap_runtime.ops.comm_stats import CommStats
from overlap_runtime.context_parallel.ulysses import ulysses_attention, ulysses_kv_heads

__all__ = [
    "GDN_P2P_NODE_KINDS",
    "LINEAR_ATTENTION_CP_MODES",
    "LinearAttentionContextParallel",
    "gdn_p2p_cost_model",
    "gdn_p2p_task_graph",
    "simulate_gdn_p2p",
    "MODES",
    "CommStats",
    "ContextParallel",
    "ContextParallelCoreAttention",
    "CoreAttention",
    "HasCoreAttention",
    "LoadBalance",
    "Mode",
    "ReferenceAttention",
    "all_gather_kv_attention",
    "apply_rotary",
    "check_sequence_length",
    "gather_sequence",
    "reorder_to_sequence",
    "reorder_to_shards",
    "ring_attention",
    "sequence_permutation",
    "shard_batch",
    "shard_positions",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_kv_heads",
    "unshard_sequence",
]
