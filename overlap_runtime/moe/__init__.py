"""Expert parallelism with comm/compute overlap: inside a layer (the shared expert behind the
combine) and across a forward and a backward chunk (the HookCoordinator's OVERLAP_B_F).

What a user builds with: the :class:`MoE` layer (router, experts, shared expert), the token
dispatcher for custom layers (:class:`AllToAllTokenDispatcher` with its per-call
:class:`DispatchMetadata` / :class:`CombinePartialResult`), the EP styles
(:class:`ExpertParallel`, :class:`OverlapExpertParallel` with the coordinator's sync hooks), the
``OVERLAP_B_F`` callback for ``PipelineSchedule`` and the MoE op costs measured on a run, which
price a compiled step (predicted vs measured all-to-all overlap). Helpers (``RoutingResult``, ``attach_aux_loss``, ``FeedForward``,
``grouped_mm_supported``, ``moe_layers``, ``infer_last_layer_flags``, ``ep_group_of``,
``OverlapHooks``) are imported from their modules. See docs/moe.md.

May import: torch, ``overlap_runtime.platform``, ``overlap_runtime.ops`` (collectives),
``overlap_runtime.graph`` (tasks, for op costs), ``overlap_runtime.coordinator`` (sync hooks,
serializer) and ``overlap_runtime.schedules`` / ``overlap_runtime.pipeline`` (the OVERLAP_B_F callback's
actions and ``ActionContext``). Never ``context_parallel``, ``models`` or ``trainer``.
"""

from .dispatcher import AllToAllTokenDispatcher, CombinePartialResult, DispatchMetadata
from .experts import GroupedExperts
from .layer import MoE
from .overlap_callback import make_overlap_b_f_callback
from .parallel import ExpertParallel, OverlapExpertParallel
from .router import TopKRouter
from .step_costs import MoEOpCosts, moe_op_seconds, op_costs_from_trace

__all__ = [
    "AllToAllTokenDispatcher",
    "CombinePartialResult",
    "DispatchMetadata",
    "ExpertParallel",
    "GroupedExperts",
    "MoE",
    "MoEOpCosts",
    "OverlapExpertParallel",
    "TopKRouter",
    "make_overlap_b_f_callback",
    "moe_op_seconds",
    "op_costs_from_trace",
]
