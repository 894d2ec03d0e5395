"""Pipeline schedules as data, pure: IR, ``ScheduleSpec``, the schedule kinds (one file each in
``kinds/``, one registry looked up by name), lowering (SEND/RECV), the pipeline rules,
compilation to a :class:`~overlap_runtime.graph.TaskGraph` with its deadlock proof, the
published bubbles and the ``overlap-runtime schedule`` command.

May import: the standard library, pydantic, PyYAML, and ``overlap_runtime.graph``. Never
``torch.distributed`` (a test checks the whole import closure), never ``overlap_runtime.
pipeline`` (the torch runtime that executes these schedules sits above this package).

Names are re-exported lazily (PEP 562) so that ``overlap-runtime --help``, which imports the
``schedule`` subcommand module, does not pay for pydantic and the passes. Helpers that only
passes need (``split_backward``, ``infer_stage_to_rank``, ``analytic_idle``...) stay in their
modules.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "Action": "ir",
    "ActionKind": "ir",
    "Schedule": "ir",
    "dump_csv": "ir",
    "load_csv": "ir",
    "parse_action": "ir",
    "ScheduleKind": "kind",
    "get_schedule_kind": "registry",
    "register_schedule_kind": "registry",
    "schedule_kinds": "registry",
    "ScheduleSpec": "spec",
    "ScheduleTooLargeError": "spec",
    "MAX_SCHEDULE_ACTIONS": "spec",
    "build_schedule": "build",
    "LoweringError": "lowering",
    "lower": "lowering",
    "ScheduleValidationError": "rules",
    "CompiledSchedule": "compile",
    "compile_schedule": "compile",
    "compile_spec": "compile",
    "validate_schedule": "compile",
    "TableSpec": "torch_csv",
    "compile_table": "torch_csv",
    "load_torch_csv": "torch_csv",
    "to_torch_csv": "torch_csv",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
