"""Expert parallelism with comm/compute overlap (seed 001, directions A and B).

See docs/moe.md: the dispatcher's metadata design, the layer's forward order, the sync hooks,
the OVERLAP_B_F callback and the task-graph nodes.
"""

from .dispatcher import (
    AllToAllTokenDispatcher,
    CombinePartialResult,
    DispatchMetadata,
    OverlapHooks,
)
from .experts import FeedForward, GroupedExperts, grouped_mm_supported
from .layer import MoE
from .overlap_callback import make_overlap_b_f_callback
from .parallel import (
    ExpertParallel,
    OverlapExpertParallel,
    ep_group_of,
    infer_last_layer_flags,
    moe_layers,
)
from .router import RoutingResult, TopKRouter, attach_aux_loss
from .task_nodes import (
    MoENodeCosts,
    measured_a2a_overlap,
    moe_layer_task_graph,
    moe_overlap_pair_task_graph,
    predicted_a2a_overlap,
)

__all__ = [
    "AllToAllTokenDispatcher",
    "CombinePartialResult",
    "DispatchMetadata",
    "ExpertParallel",
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "MoENodeCosts",
    "OverlapExpertParallel",
    "OverlapHooks",
    "RoutingResult",
    "TopKRouter",
    "attach_aux_loss",
    "ep_group_of",
    "grouped_mm_supported",
    "infer_last_layer_flags",
    "make_overlap_b_f_callback",
    "measured_a2a_overlap",
    "moe_layer_task_graph",
    "moe_layers",
    "moe_overlap_pair_task_graph",
    "predicted_a2a_overlap",
]
