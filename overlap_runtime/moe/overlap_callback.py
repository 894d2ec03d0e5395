"""The OVERLAP_B_F custom function for ``PipelineSchedule``: a backward and a forward chunk on
two threads whose EP all-to-alls the HookCoordinator hands back and forth.

``ScheduleInterleaved1F1B(..., overlap_b_f=True)`` fuses, in the 1F1B steady state, the backward
of microbatch i with the forward of microbatch i+1 into one compound step
``(sB_i;s'F_j)OVERLAP_B_F``. The callback made here runs that step on two threads of the rank::

    overlap.run(fwd_fn = lambda: ctx.run(s'F_j),        # caller thread (forward side)
                bwd_fn = lambda: ctx.run(sB_i))         # overlap's worker (backward side)

``ctx.run`` is the runtime's standard path for each side: the forward waits its ``RECV_F``
activation, the backward its ``RECV_B`` gradient (bounded by the schedule's timeout, posted early
under ``overlap_p2p``), each inside its own thread, and both record their spans in the step's
execution trace under their thread's name. The sends of both results follow the compound step
in the lowered program, so neither side waits on the other's send. The sync hooks that
``OverlapExpertParallel`` put in the chunks hand the comm token back and forth between the two
threads, so one side's all-to-all runs while the other side computes, and the all-to-alls are
launched in the same order on every EP rank.

If either side raises, the other is stopped at its next hook and ``run`` re-raises the first
error here (the runtime then clears its stages and fails the step).
"""

from __future__ import annotations

import torch

from overlap_runtime.coordinator import CommComputeOverlap
from overlap_runtime.platform import resolve_device
from overlap_runtime.pipeline.context import ActionContext, ActionFn
from overlap_runtime.schedules.ir import Action, ActionKind

_BACKWARD_KINDS = (ActionKind.B, ActionKind.I, ActionKind.W)


def make_overlap_b_f_callback(overlap: CommComputeOverlap,
                              device: str | torch.device | None = None) -> ActionFn:
    """Build ``fn(action, ctx)`` for ``register_custom_function(ActionKind.OVERLAP_B_F, fn)``.

    Args:
        overlap: the rank's CommComputeOverlap (its coordinator is the one the MoE layers'
            hooks use). Disabled coordinator: the two sides run one after the other here.
        device: the rank's device; must be ``overlap.device`` (the worker thread makes that
            device current for itself before each backward). None: ``overlap.device``.

    The callback raises ValueError for an action that is not an OVERLAP_B_F step with one
    forward and one backward sub-action.
    """
    if device is not None and resolve_device(device) != overlap.device:
        raise ValueError(f"make_overlap_b_f_callback: device {device} differs from the overlap's "
                         f"device {overlap.device}; the backward worker would compute on the "
                         f"wrong device")

    def overlap_b_f(action: Action, ctx: ActionContext) -> None:
        if action.kind is not ActionKind.OVERLAP_B_F:
            raise ValueError(f"overlap_b_f callback: got {action}, which is not OVERLAP_B_F")
        fwd = [a for a in action.sub_actions if a.kind is ActionKind.F]
        bwd = [a for a in action.sub_actions if a.kind in _BACKWARD_KINDS]
        if len(fwd) != 1 or len(bwd) != 1 or len(action.sub_actions) != 2:
            raise ValueError(f"overlap_b_f callback: {action} must hold one forward and one "
                             f"backward sub-action")
        f, b = fwd[0], bwd[0]
        with ctx.span(str(action), "compound"):
            overlap.run(lambda: ctx.run(f), lambda: ctx.run(b))

    return overlap_b_f
