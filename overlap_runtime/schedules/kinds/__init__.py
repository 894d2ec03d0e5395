"""The schedule kinds, one file each: its spec rules, its builder and its published bubble.

Each module defines ``KIND = ScheduleKind(...)`` (:mod:`overlap_runtime.schedules.kind`) and
imports only ``schedules.ir`` and ``schedules.kind`` (the spec is a type hint only).
:mod:`overlap_runtime.schedules.registry` lists the modules; a new kind is a new file here plus
one line in that list. Nothing is re-exported here: look kinds up by name with
:func:`overlap_runtime.schedules.get_schedule_kind`.
"""
