"""Context parallelism: sequence sharding, full-attention CP (Ulysses, ring, all-gather K/V,
hierarchical Ulysses x ring) and Gated DeltaNet CP (ulysses, p2p state chain, all-gather of
affine summaries).

Both styles swap one strategy on a ``overlap_runtime.layers`` module and leave the rest of the
layer alone: ``ContextParallel(mode, load_balance).apply(attn, cp_mesh)`` replaces
``attn.core_attention``; ``LinearAttentionContextParallel(mode, backend).apply(gdn, cp_mesh)``
replaces ``gdn.sequence_mixer``. See docs/context_parallel.md and docs/gdn_context_parallel.md.
One algorithm per module: ``sharding`` (contiguous and zigzag splits), ``ulysses``, ``ring``
(+ ``ring_accumulate``), ``all_gather_kv``, ``hierarchical``, ``api`` (``ContextParallel``), and the ``gdn``
subpackage. Internal helpers (zigzag permutations, head-layout checks, the GDN CP mixers) are
imported from their modules.

May import ``torch``, ``overlap_runtime.ops``, ``overlap_runtime.graph``, ``overlap_runtime.config``
(the CP-mode registry) and ``overlap_runtime.layers``; never the ``models`` package (which imports this one).
"""

from overlap_runtime.context_parallel.all_gather_kv import all_gather_kv_attention
from overlap_runtime.context_parallel.api import (
    MODES,
    ContextParallel,
    ContextParallelCoreAttention,
    Mode,
)
from overlap_runtime.context_parallel.gdn import (
    GDN_P2P_NODE_KINDS,
    LINEAR_ATTENTION_CP_MODES,
    LinearAttentionContextParallel,
    chain_op_seconds,
)
from overlap_runtime.context_parallel.hierarchical import (
    HIERARCHICAL_MESH_DIMS,
    hierarchical_attention,
    hierarchical_cp_mesh,
)
from overlap_runtime.context_parallel.packed import PackedLayout
from overlap_runtime.context_parallel.ring import ring_attention
from overlap_runtime.context_parallel.sharding import (
    LoadBalance,
    gather_sequence,
    shard_batch,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from overlap_runtime.context_parallel.ulysses import ulysses_attention
from overlap_runtime.context_parallel.varlen_attention import (
    packed_ring_attention,
    packed_ulysses_attention,
)
from overlap_runtime.ops.comm_stats import CommStats

__all__ = [
    "GDN_P2P_NODE_KINDS",
    "HIERARCHICAL_MESH_DIMS",
    "LINEAR_ATTENTION_CP_MODES",
    "MODES",
    "CommStats",
    "ContextParallel",
    "ContextParallelCoreAttention",
    "LinearAttentionContextParallel",
    "LoadBalance",
    "Mode",
    "PackedLayout",
    "all_gather_kv_attention",
    "chain_op_seconds",
    "gather_sequence",
    "hierarchical_attention",
    "hierarchical_cp_mesh",
    "packed_ring_attention",
    "packed_ulysses_attention",
    "ring_attention",
    "shard_batch",
    "shard_positions",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]
