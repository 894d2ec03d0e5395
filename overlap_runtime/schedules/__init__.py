"""Pipeline schedules: IR, spec, builders, lowering, validation, compilation to a task graph, and
the runtime that executes them (PipelineStage, PipelineSchedule).

Names are re-exported lazily (PEP 562) so that ``overlap-runtime --help``, which imports the
``schedule`` subcommand module, does not pay for pydantic and the passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "Action": "ir",
    "ActionKind": "ir",
    "Schedule": "ir",
    "dump_csv": "ir",
    "load_csv": "ir",
    "parse_action": "ir",
    "ScheduleKindInfo": "spec",
    "ScheduleSpec": "spec",
    "register_schedule_kind": "spec",
    "schedule_kinds": "spec",
    "build_1f1b": "builders",
    "build_gpipe": "builders",
    "build_interleaved_1f1b": "builders",
    "build_schedule": "builders",
    "pair_backward_forward": "builders",
    "register_builder": "builders",
    "split_backward": "builders",
    "build_zero_bubble": "builders_zero_bubble",
    "build_dualpipev": "builders_dualpipev",
    "DeferredLinear": "deferred_w",
    "DeferredWQueue": "deferred_w",
    "FlushWhileWaiting": "deferred_w",
    "SavedTensorMeter": "saved_memory",
    "LoweringError": "lowering",
    "lower": "lowering",
    "ScheduleValidationError": "validate",
    "infer_stage_to_rank": "validate",
    "validate_schedule": "validate",
    "CompiledSchedule": "compile",
    "compile_schedule": "compile",
    "compile_spec": "compile",
    "PipelineStage": "stage",
    "TensorMeta": "stage",
    "PipelineSchedule": "runtime",
    "ScheduleGPipe": "runtime",
    "Schedule1F1B": "runtime",
    "ScheduleInterleaved1F1B": "runtime",
    "PipelineTimeout": "context",
    "ActionContext": "context",
    "ExecutionTrace": "exec_trace",
    "gather_traces": "exec_trace",
    "measured_bubble": "exec_trace",
    "write_execution_trace": "exec_trace",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover
    from .context import ActionContext, PipelineTimeout
    from .exec_trace import ExecutionTrace, gather_traces, measured_bubble, write_execution_trace
    from .runtime import PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from .stage import PipelineStage, TensorMeta
    from .builders import (
        build_1f1b,
        build_gpipe,
        build_interleaved_1f1b,
        build_schedule,
        pair_backward_forward,
        register_builder,
        split_backward,
    )
    from .compile import CompiledSchedule, compile_schedule, compile_spec
    from .builders_dualpipev import build_dualpipev
    from .builders_zero_bubble import build_zero_bubble
    from .deferred_w import DeferredLinear, DeferredWQueue, FlushWhileWaiting
    from .saved_memory import SavedTensorMeter
    from .ir import Action, ActionKind, Schedule, dump_csv, load_csv, parse_action
    from .lowering import LoweringError, lower
    from .spec import ScheduleKindInfo, ScheduleSpec, register_schedule_kind, schedule_kinds
    from .validate import ScheduleValidationError, infer_stage_to_rank, validate_schedule
