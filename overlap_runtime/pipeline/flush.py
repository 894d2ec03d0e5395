"""``FlushWhileWaiting``: a custom function that runs deferred W tasks while a receive is in
flight, written only with the public :class:`~overlap_runtime.pipeline.context.ActionContext`
API (an example of what a user's callback can do).

Per (sub-)action whose input comes from another rank (``ctx.input_recv``), while that receive
is still in flight (``ctx.recv_completed`` is False), it runs the queue's oldest tasks until the
receive completes; then it runs the action. With ``defer_backward=True`` the full backwards of
compound steps defer their weight gradients too (``ctx.backward(sub, defer_w=True)``), to be
flushed in later windows (DualPipeV's steady state: W tasks fill the waits on communication,
what is left drains in the cool-down).
"""

from __future__ import annotations

from typing import Callable

from overlap_runtime.schedules.ir import Action, ActionKind

from .context import ActionContext
from .deferred_w import DeferredWQueue


class FlushWhileWaiting:
    """Custom function that runs pending W tasks in communication windows.

    Register it for ``OVERLAP_F_B`` / ``OVERLAP_B_F`` (and optionally ``F``, ``I``, ``B``)::

        flush = FlushWhileWaiting(queue, defer_backward=True)
        schedule.register_custom_function(ActionKind.OVERLAP_F_B, flush)

    Before each (sub-)action whose input arrives from another rank, while that receive is still
    in flight, it runs the queue's oldest tasks (``queue.flush(until=receive completed)``), then
    runs the action (``inner(sub, ctx)`` if given, else the standard way). With
    ``defer_backward=True`` the full backwards (``B``) of compound steps also defer their weight
    gradients to the queue, to be flushed in later windows; whatever is left runs at the
    program's W actions or in the drain at the end of the step (``PipelineSchedule.step`` drains
    every stage's queue). Needs ``overlap_p2p=True`` (otherwise receives are waited where the
    program lists them and no window is open when compute starts).
    """

    def __init__(self, queue: DeferredWQueue, *, defer_backward: bool = False,
                 inner: Callable[[Action, ActionContext], None] | None = None) -> None:
        self.queue = queue
        self.defer_backward = defer_backward
        self.inner = inner

    def __call__(self, action: Action, ctx: ActionContext) -> None:
        if not action.is_compound:
            self._window(action, ctx)
            self._run(action, ctx, compound=False)
            return
        with ctx.span(action, "compound"):
            for sub in action.sub_actions:
                self._window(sub, ctx)
                self._run(sub, ctx, compound=True)

    def _run(self, sub: Action, ctx: ActionContext, compound: bool) -> None:
        if self.inner is not None:
            self.inner(sub, ctx)
        elif (self.defer_backward and sub.kind is ActionKind.B
              and ctx.stages[sub.stage].deferred_w is self.queue):
            with ctx.span(sub, "compute"):
                ctx.backward(sub, defer_w=True)
        elif compound:
            ctx.run(sub)
        else:
            ctx.run_default(sub)

    def _window(self, sub: Action, ctx: ActionContext) -> None:
        recv = ctx.input_recv(sub)
        if recv is None or not self.queue.pending():
            return
        kind, stage, mb = recv
        if ctx.recv_completed(kind, stage, mb) is not False:  # done, or not posted yet
            return
        with ctx.span(f"W flush before {sub}", "compute"):
            self.queue.flush(lambda: bool(ctx.recv_completed(kind, stage, mb)),
                             reason="window", during=str(ctx.current_action),
                             step=ctx.step_index)
