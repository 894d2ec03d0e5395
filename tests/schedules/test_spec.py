"""ScheduleSpec rules, file loading and the one registry of schedule kinds."""

from __future__ import annotations

import json
import sys

import pytest
from pydantic import ValidationError

from overlap_runtime.schedules import (
    ScheduleKind,
    ScheduleSpec,
    build_schedule,
    get_schedule_kind,
    register_schedule_kind,
    schedule_kinds,
)
from overlap_runtime.schedules.ir import Action, ActionKind


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(kind="no_such_kind", pp_size=2, num_microbatches=4), "not a registered schedule kind"),
        (dict(kind="1f1b", pp_size=0, num_microbatches=4), "pp_size"),
        (dict(kind="1f1b", pp_size=2, num_microbatches=0), "num_microbatches"),
        (dict(kind="gpipe", pp_size=2, num_microbatches=4, virtual_stages=2),
         "virtual_stages=2 is out of range for kind='gpipe'"),
        (dict(kind="gpipe", pp_size=2, num_microbatches=4, overlap_b_f=True),
         "overlap_b_f=True needs a 1F1B steady state"),
        (dict(kind="1f1b", pp_size=2, num_microbatches=4, overlap_b_f=True, split_backward=True),
         "cannot be combined"),
        (dict(kind="interleaved_1f1b", pp_size=4, num_microbatches=9, virtual_stages=2),
         "multiple of the number of rounds"),
        (dict(kind="interleaved_1f1b", pp_size=2, num_microbatches=4, virtual_stages=2,
              placement="v"), "placement='v' is not supported by kind='interleaved_1f1b'"),
        (dict(kind="1f1b", pp_size=2, num_microbatches=4, placement="zigzag"), "placement"),
        (dict(kind="1f1b", pp_size=2, num_microbatches=4, microbatches=3), "microbatches"),
    ],
)
def test_invalid_specs_name_the_rule(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        ScheduleSpec(**fields)
    assert needle in str(info.value)


def test_derived_placement() -> None:
    spec = ScheduleSpec(kind="interleaved_1f1b", pp_size=4, num_microbatches=8, virtual_stages=3)
    assert spec.num_stages == 12
    assert [spec.stage_to_rank(s) for s in range(12)] == [0, 1, 2, 3] * 3
    from overlap_runtime.schedules.spec import stage_to_rank

    assert [stage_to_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="stage 12 is outside 0..11"):
        spec.stage_to_rank(12)


def test_spec_is_frozen() -> None:
    spec = ScheduleSpec(kind="1f1b", pp_size=2, num_microbatches=4)
    with pytest.raises(ValidationError):
        spec.pp_size = 3  # type: ignore[misc]


def test_load_yaml_and_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    y = tmp_path / "s.yaml"
    y.write_text("schedule:\n  kind: interleaved_1f1b\n  pp_size: 4\n  num_microbatches: 8\n"
                 "  virtual_stages: 2\n  overlap_b_f: true\n")
    j = tmp_path / "s.json"
    j.write_text(json.dumps(dict(kind="interleaved_1f1b", pp_size=4, num_microbatches=8,
                                 virtual_stages=2, overlap_b_f=True)))
    expected = ScheduleSpec(kind="interleaved_1f1b", pp_size=4, num_microbatches=8,
                            virtual_stages=2, overlap_b_f=True)
    assert ScheduleSpec.from_file(y) == expected
    assert ScheduleSpec.from_file(j) == expected
    assert ScheduleSpec.from_json(expected.model_dump_json()) == expected
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: gpipe\npp_size: 2\nnum_microbatches: 2\nvirtual_stages: 2\n")
    with pytest.raises(ValidationError, match="out of range for kind='gpipe'"):
        ScheduleSpec.from_file(bad)
    with pytest.raises(ValueError, match="must end in .yaml, .yml or .json"):
        ScheduleSpec.from_file(tmp_path / "s.toml")


def test_kind_registry_is_open() -> None:
    """A later issue adds a kind (rules and builder in one object) without touching the spec."""
    name = "test_only_reverse_gpipe"

    def _build(spec: ScheduleSpec) -> dict:
        m = spec.num_microbatches
        return {r: [Action(r, ActionKind.F, i) for i in range(m)]
                + [Action(r, ActionKind.B, i) for i in reversed(range(m))]
                for r in range(spec.pp_size)}

    register_schedule_kind(ScheduleKind(name, _build, max_virtual=1, overlap_b_f=False))
    try:
        spec = ScheduleSpec(kind=name, pp_size=2, num_microbatches=3)
        assert [str(a) for a in build_schedule(spec)[1]] == ["1F0", "1F1", "1F2", "1B2", "1B1",
                                                              "1B0"]
        with pytest.raises(ValidationError, match="needs a 1F1B steady state"):
            ScheduleSpec(kind=name, pp_size=2, num_microbatches=3, overlap_b_f=True)
    finally:
        from overlap_runtime.schedules import registry

        registry._KINDS.pop(name, None)
    assert name not in schedule_kinds()


def test_one_registry_by_name() -> None:
    """Every built-in kind is one ScheduleKind holding its builder; names are unique."""
    kinds = schedule_kinds()
    assert list(kinds) == ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev"]
    for name, kind in kinds.items():
        assert kind.name == name and get_schedule_kind(name) is kind
        # one file per kind: the module that defines the builder holds the kind (its rules)
        module = sys.modules[kind.build.__module__]
        assert module.__name__.startswith("overlap_runtime.schedules.kinds.") and module.KIND is kind
    with pytest.raises(ValueError, match="'nope' is not a registered schedule kind; known: "):
        get_schedule_kind("nope")
    with pytest.raises(ValueError, match="'1f1b' is already registered; pass replace=True"):
        register_schedule_kind(ScheduleKind("1f1b", kinds["gpipe"].build))
    assert get_schedule_kind("1f1b") is kinds["1f1b"]
    with pytest.raises(TypeError, match="takes a ScheduleKind"):
        register_schedule_kind("1f1b")  # type: ignore[arg-type]


def test_spec_docstring_lists_every_kind() -> None:
    doc = ScheduleSpec.__doc__ or ""
    assert "more later" not in doc
    for name in schedule_kinds():
        assert f"``{name}``" in doc, name
