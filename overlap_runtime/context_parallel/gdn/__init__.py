"""Gated DeltaNet context parallelism: ``LinearAttentionContextParallel`` and its four modes.

``LinearAttentionContextParallel(mode, backend).apply(gdn_layer, cp_mesh)`` swaps the layer's
sequence mixer (the strategy protocol of ``overlap_runtime.layers.sequence_mixer``) for the
mode's CP mixer; the layer's token-wise work stays the layer's. One algorithm per module:
``common`` (``GDNCPPlan``, the CP mixers' base and boundary checks, bounded p2p helpers),
``halo`` (the conv halo: one autograd Function over the torch, Triton and document-masked
convs), ``state_passing`` (one autograd Function: an eager or Triton local backend driven
through a ``StateLink``), ``varlen`` (a shard's layout as a table: whole rows or document
pieces), ``ulysses`` (head all-to-all), ``p2p`` (the state chain: its link), ``all_gather``
(summary all-gather + prefix compose), ``prefix_scan`` (the entering states by an exclusive
scan in ceil(log2 P) point-to-point rounds, ``scan_rounds``: its link), ``step_costs`` (the p2p
chain's node costs as the cost model of a compiled step's pricing pass), ``style``
(the public style). See
docs/gdn_context_parallel.md.

May import ``torch``, ``overlap_runtime.ops``, ``overlap_runtime.graph`` and
``overlap_runtime.layers``; never the ``models`` package.
"""

from overlap_runtime.context_parallel.gdn.style import (
    LINEAR_ATTENTION_CP_MODES,
    LinearAttentionContextParallel,
)
from overlap_runtime.context_parallel.gdn.step_costs import (
    GDN_P2P_FUSED_NODE_KINDS,
    GDN_P2P_NODE_KINDS,
    chain_op_seconds,
)

__all__ = [
    "GDN_P2P_FUSED_NODE_KINDS",
    "GDN_P2P_NODE_KINDS",
    "LINEAR_ATTENTION_CP_MODES",
    "LinearAttentionContextParallel",
    "chain_op_seconds",
]
