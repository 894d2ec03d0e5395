"""The torch runtime of pipeline schedules: ``PipelineStage`` (a model chunk's forward, backward
and split backward), ``PipelineSchedule.step`` (executes this rank's lowered program over
torch.distributed), the public ``ActionContext`` that the built-in executor and user callbacks
(``register_custom_function``) share, the deferred-W queue, the execution trace and the
saved-activation meter, the shim that runs our overlap inside torch.distributed.pipelining's
runtime (``torch_interop``), and the step's errors (``PipelineError``: ``PipelineTimeout``,
``PipelinePeerFailed``, ``PipelineActionError``, each with its ``ActionSite``).

May import: torch (``torch.distributed`` included), ``overlap_runtime.schedules`` (the pure IR,
spec and compiler whose output it runs), ``overlap_runtime.graph`` and ``overlap_runtime.ops``.
Never ``coordinator``, ``moe``, ``models`` or ``trainer`` (they sit above and import this).

Names are re-exported lazily (PEP 562): importing the package does not import torch.distributed
until a name is used.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "PipelineStage": "stage",
    "BoundaryMeta": "tensor_meta",
    "TensorMeta": "tensor_meta",
    "PipelineSchedule": "schedule",
    "ScheduleGPipe": "schedule",
    "Schedule1F1B": "schedule",
    "ScheduleInterleaved1F1B": "schedule",
    "ActionContext": "context",
    "ActionFn": "context",
    "ActionSite": "errors",
    "PipelineActionError": "errors",
    "PipelineError": "errors",
    "PipelinePeerFailed": "errors",
    "PipelineTimeout": "errors",
    "DeferredLinear": "deferred_w",
    "DeferredWQueue": "deferred_w",
    "FlushWhileWaiting": "flush",
    "SavedTensorMeter": "saved_memory",
    "ExecutionTrace": "exec_trace",
    "gather_traces": "exec_trace",
    "measured_bubble": "exec_trace",
    "write_execution_trace": "exec_trace",
    "TorchInteropError": "torch_interop",
    "make_torch_overlap_f_b_callback": "torch_interop",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
