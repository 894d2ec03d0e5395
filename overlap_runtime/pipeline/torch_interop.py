"""Our overlap inside torch.distributed.pipelining's runtime: a version-checked shim over the
private members torch's ``_PipelineScheduleRuntime`` executes actions with, and an
``OVERLAP_F_B`` callback that runs the pair's two sides on two threads through a
:class:`~overlap_runtime.coordinator.CommComputeOverlap` (our HookCoordinator's comm token, so the
MoE all-to-alls of the two microbatches take turns).

torch runs an ``OVERLAP_F_B`` step's sub-actions one after the other unless a function is
registered for it (``schedule.register_custom_function(OVERLAP_F_B, fn)``; ``fn(action, ctx)``
with torch's ``_PipelineContext``). The code that knows how to run one sub-action is a closure
local to ``_step_microbatches``, so a callback must redo its F and B branches on the schedule's
and the stages' members. Everything this module reads from torch is listed in :data:`PINNED`;
:func:`torch_pipelining_api` checks the module-level names when a callback is made, and
:meth:`TorchPipeliningAPI.check_schedule` the instance members on the first call, each failing
with :class:`TorchInteropError` naming the missing attribute, the installed torch and the
versions this shim was tested with (:data:`TESTED_TORCH`).

What the callback does differently from torch's sequential path (and from torchtitan's
``overlap_callback``, which this replaces for our models; see docs/pipeline_runtime.md):

* each side waits its own receive in its own thread, bounded by ``timeout_s`` (torch's
  ``_wait_batch_p2p`` waits without a limit): a stalled peer raises ``TorchInteropError`` naming
  the rank, action, and what it waited for;
* a failure on either side stops the other at its next sync hook and leaves the step with the
  first error, with a note naming the compound action and the side (``CommComputeOverlap.run``).

Imports only torch (this package may not import the coordinator: ``overlap`` is any object with
``run(fwd_fn, bwd_fn)``).
"""

from __future__ import annotations

import datetime
import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

TESTED_TORCH = ("2.13.0",)
"""torch releases this shim was run against (its tests and the PP2 x EP2 check)."""

_SCHEDULES = "torch.distributed.pipelining.schedules"

PINNED: dict[str, tuple[str, ...]] = {
    # module-level names of torch.distributed.pipelining.schedules
    "module": ("_PipelineScheduleRuntime", "_PipelineContext", "_Action", "_ComputationType",
               "OVERLAP_F_B", "FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT"),
    # members of the _PipelineScheduleRuntime instance the callback is registered on
    "schedule": ("_stages", "_n_microbatches", "fwd_recv_ops", "bwd_recv_ops",
                 "backward_counter", "_maybe_compute_loss", "_maybe_get_loss",
                 "_assert_unsharded", "register_custom_function"),
    # members of each _PipelineStageBase
    "stage": ("stage_index", "is_first", "is_last", "forward_one_chunk", "backward_one_chunk",
              "set_local_fwd_input", "set_local_bwd_input", "get_local_bwd_output"),
    # fields of _PipelineContext
    "context": ("schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs"),
    # fields of _Action
    "action": ("stage_index", "computation_type", "microbatch_index", "sub_actions"),
}
"""Everything the shim reads from torch, by owner."""


class TorchInteropError(RuntimeError):
    """torch's internals differ from what the shim was written for, or a pair step failed."""


def _missing(owner: str, what: str) -> TorchInteropError:
    return TorchInteropError(
        f"torch {torch.__version__}: {what} has no attribute {owner!r}; overlap_runtime's "
        f"torch.distributed.pipelining shim (pipeline/torch_interop.py) was written for torch "
        f"{', '.join(TESTED_TORCH)} and reads the private members listed in its PINNED table")


class PairRunner(Protocol):
    """What runs a pair's two sides (``CommComputeOverlap``): fwd in the caller, bwd aside."""

    def run(self, fwd_fn: Callable[[], Any], bwd_fn: Callable[[], Any]) -> Any: ...


@dataclass(frozen=True)
class TorchPipeliningAPI:
    """The pinned parts of torch's pipelining runtime (see :data:`PINNED`)."""

    module: Any
    OVERLAP_F_B: Any
    FORWARD: Any
    FULL_BACKWARD: Any
    BACKWARD_INPUT: Any

    def check_schedule(self, schedule: Any) -> None:
        """Raise :class:`TorchInteropError` unless ``schedule`` and its stages have every pinned
        member."""
        if not isinstance(schedule, self.module._PipelineScheduleRuntime):
            raise TorchInteropError(
                f"the OVERLAP_F_B callback needs a _PipelineScheduleRuntime (or a subclass such "
                f"as ScheduleDualPipeV), got {type(schedule).__name__}")
        for name in PINNED["schedule"]:
            if not hasattr(schedule, name):
                raise _missing(name, f"{type(schedule).__name__} (the schedule)")
        for st in schedule._stages:
            for name in PINNED["stage"]:
                if not hasattr(st, name):
                    raise _missing(name, f"{type(st).__name__} (stage {st.stage_index})")

    # ------------------------------------------------------------------ one sub-action
    def forward(self, schedule: Any, ctx: Any, action: Any, timeout_s: float) -> None:
        """torch's FORWARD branch: wait the activation (bounded), ``forward_one_chunk``, the
        loss on the last stage, the local hand-off to the next stage on this rank."""
        stages = {st.stage_index: st for st in schedule._stages}
        s, m = action.stage_index, action.microbatch_index
        stage = stages[s]
        schedule._assert_unsharded(stage)
        if not stage.is_first and (s - 1) not in stages:
            self._wait(schedule.fwd_recv_ops, (s, m), action, "its activation", timeout_s)
        output = stage.forward_one_chunk(m, ctx.arg_mbs[m], ctx.kwarg_mbs[m])
        loss_kwargs = getattr(ctx, "loss_kwargs", None)
        if loss_kwargs is not None:
            schedule._maybe_compute_loss(stage, output, ctx.target_mbs, m, loss_kwargs)
        else:
            schedule._maybe_compute_loss(stage, output, ctx.target_mbs, m)
        if (s + 1) in stages:
            stages[s + 1].set_local_fwd_input(output, m)

    def backward(self, schedule: Any, ctx: Any, action: Any, timeout_s: float) -> None:
        """torch's FULL_BACKWARD / BACKWARD_INPUT branch: wait the output gradient (bounded),
        ``backward_one_chunk``, the local hand-off to the previous stage on this rank."""
        stages = {st.stage_index: st for st in schedule._stages}
        s, m = action.stage_index, action.microbatch_index
        stage = stages[s]
        schedule._assert_unsharded(stage)
        if not stage.is_last and (s + 1) not in stages:
            self._wait(schedule.bwd_recv_ops, (s, m), action, "its output gradient", timeout_s)
        loss = schedule._maybe_get_loss(stage, m)
        full = action.computation_type == self.FULL_BACKWARD
        last = False
        if full:
            schedule.backward_counter[s] += 1
            last = schedule.backward_counter[s] == schedule._n_microbatches
        stage.backward_one_chunk(m, loss=loss, full_backward=full, last_backward=last)
        if (s - 1) in stages:
            stages[s - 1].set_local_bwd_input(stage.get_local_bwd_output(m), m)

    @staticmethod
    def _wait(ops: dict[tuple[int, int], list[Any]], key: tuple[int, int], action: Any,
              what: str, timeout_s: float) -> None:
        works = ops.pop(key, None)
        if works is None:
            raise TorchInteropError(f"rank {dist.get_rank()}: {action} runs before the receive of "
                                    f"{what} was posted (no RECV before it in the schedule)")
        limit = datetime.timedelta(seconds=timeout_s)
        for w in works:
            try:
                done = w.wait(limit)
            except RuntimeError as exc:  # gloo: timed out, or the peer closed the pair
                raise TorchInteropError(
                    f"rank {dist.get_rank()}: {action} waiting for {what} (thread "
                    f"'{threading.current_thread().name}', limit {timeout_s:.1f}s): {exc}") from exc
            if done is False:
                raise TorchInteropError(
                    f"rank {dist.get_rank()}: {action} waiting for {what}: not complete after "
                    f"{timeout_s:.1f}s (thread '{threading.current_thread().name}')")


def torch_pipelining_api() -> TorchPipeliningAPI:
    """Import torch's pipelining schedules and check the pinned module-level names."""
    try:
        mod = importlib.import_module(_SCHEDULES)
    except ImportError as exc:
        raise TorchInteropError(f"torch {torch.__version__} has no {_SCHEDULES}: {exc}") from exc
    for name in PINNED["module"]:
        if not hasattr(mod, name):
            raise _missing(name, _SCHEDULES)
    for name in PINNED["context"]:
        if name not in getattr(mod._PipelineContext, "__dataclass_fields__", {}):
            raise _missing(name, f"{_SCHEDULES}._PipelineContext")
    for name in PINNED["action"]:
        if name not in getattr(mod._Action, "_fields", ()):
            raise _missing(name, f"{_SCHEDULES}._Action")
    return TorchPipeliningAPI(mod, mod.OVERLAP_F_B, mod.FORWARD, mod.FULL_BACKWARD,
                              mod.BACKWARD_INPUT)


def make_torch_overlap_f_b_callback(overlap: PairRunner, *, timeout_s: float = 300.0,
                                    api: TorchPipeliningAPI | None = None
                                    ) -> Callable[[Any, Any], None]:
    """``fn(action, ctx)`` for torch's ``schedule.register_custom_function(OVERLAP_F_B, fn)``.

    Runs the pair's forward sub-action in the calling thread and its backward (B or I) in the
    overlap's worker, ``overlap.run(fwd, bwd)``: with our ``CommComputeOverlap`` and MoE layers
    under ``OverlapExpertParallel``, the two microbatches' all-to-alls take turns with the other
    side's compute. Receives are waited inside each side with ``timeout_s``.

    Raises :class:`TorchInteropError` here if torch's module-level names moved, at the first
    call if the schedule's or stages' members did, and for an action that is not an
    ``OVERLAP_F_B`` pair of one forward and one backward.
    """
    api = api if api is not None else torch_pipelining_api()
    checked: set[int] = set()
    bwd_kinds = (api.FULL_BACKWARD, api.BACKWARD_INPUT)

    def overlap_f_b(action: Any, ctx: Any) -> None:
        schedule = ctx.schedule_ref
        if id(schedule) not in checked:
            api.check_schedule(schedule)
            checked.add(id(schedule))
        subs = tuple(action.sub_actions or ())
        if action.computation_type != api.OVERLAP_F_B or len(subs) != 2:
            raise TorchInteropError(f"OVERLAP_F_B callback: {action} is not an OVERLAP_F_B step "
                                    "with two sub-actions")
        fwd = [a for a in subs if a.computation_type == api.FORWARD]
        bwd = [a for a in subs if a.computation_type in bwd_kinds]
        if len(fwd) != 1 or len(bwd) != 1:
            raise TorchInteropError(f"OVERLAP_F_B callback: {action} must hold one F and one B "
                                    "(or I) sub-action")
        f, b = fwd[0], bwd[0]

        def side(run: Callable[..., None], sub: Any, name: str) -> Callable[[], None]:
            def go() -> None:
                try:
                    run(schedule, ctx, sub, timeout_s)
                except Exception as exc:
                    exc.add_note(f"rank {dist.get_rank()}: in {sub} ({name} side, thread "
                                 f"'{threading.current_thread().name}') of torch's {action}")
                    raise
            return go

        with torch.profiler.record_function(f"pp.{action}"):
            overlap.run(side(api.forward, f, "forward"), side(api.backward, b, "backward"))

    return overlap_f_b
