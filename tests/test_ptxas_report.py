"""benchmarks/ptxas_report.py: a launch of a tiny kernel is recorded with the right types and
compiles for sm_90a to a report row with registers; the argument-type mapping agrees with
triton's own specialisation; ptxas -v output is parsed for the entry function.

Skipped without triton or its ``ptxas-blackwell`` binary, and under ``TRITON_INTERPRET=1``
(the test kernel must be a real JITFunction)."""

from __future__ import annotations

import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from benchmarks import ptxas_report as pr  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not pr.ptxas_path().exists(), reason="no ptxas-blackwell in triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="the test kernel must compile, not be interpreted"),
]


@triton.jit
def scale_add_kernel(x, y, out, n, alpha, BLOCK: tl.constexpr, HAS_Y: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask).to(tl.float32) * alpha
    if HAS_Y:
        v += tl.load(y + offs, mask=mask)
    tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)


def test_tiny_kernel_records_and_compiles_to_a_row() -> None:
    x, out = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000, dtype=torch.bfloat16)
    y = torch.zeros(1000, dtype=torch.float32)
    launch = pr.record_launch(scale_add_kernel.fn, (x, y, out, 1000, 0.5),
                              {"BLOCK": 256, "HAS_Y": True, "num_warps": 4, "num_stages": 2})
    assert {n: a.type for n, a in launch.args.items()} == {
        "x": "*bf16", "y": "*fp32", "out": "*bf16", "n": "i32", "alpha": "fp32"}
    assert launch.constexprs == {"BLOCK": 256, "HAS_Y": True}
    assert launch.options == {"num_warps": 4, "num_stages": 2}

    row = pr.compile_report(scale_add_kernel, launch.args, launch.constexprs, launch.options)
    assert row.registers > 0
    assert (row.spill_stores, row.spill_loads, row.stack) == (0, 0, 0)
    line = row.markdown()
    assert re.fullmatch(r"\| scale_add_kernel \| BLOCK=256 HAS_Y=T \| 4 \| 2 \| "
                        r"[1-9]\d* \| 0 \| 0 \| 0 \| \d+ \|", line), line
    assert line.count("|") == pr.Row.HEADER.splitlines()[0].count("|")


def test_arg_types_match_triton_specialisation() -> None:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    cases = [  # a list: True == 1 and False == 0 would merge as dict keys
        (torch.zeros(4, dtype=torch.bfloat16), "*bf16"),
        (torch.zeros(4, dtype=torch.float16), "*fp16"),
        (torch.zeros(4, dtype=torch.float32), "*fp32"),
        (torch.zeros(4, dtype=torch.int32), "*i32"),
        (torch.zeros(4, dtype=torch.int64), "*i64"),
        (torch.zeros(4, dtype=torch.bool), "*u1"),
        (0, "i32"), (17, "i32"), (-2**31, "i32"), (2**31 - 1, "i32"), (2**31, "i64"),
        (-2**31 - 1, "i64"), (2**63, "u64"), (0.5, "fp32"), (True, "u1"), (False, "u1"),
    ]
    for value, expected in cases:
        assert pr.arg_type(value) == expected, value
        assert native_specialize_impl(BaseBackend, value, False, True, True)[0] == expected
    assert pr.describe_arg(7) == pr.Arg("i32", 7)
    base = torch.zeros(16, dtype=torch.bfloat16)
    assert pr.describe_arg(base).aligned and not pr.describe_arg(base[1:]).aligned
    with pytest.raises(ValueError, match="complex64"):
        pr.arg_type(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="64 bits"):
        pr.arg_type(2**64)
    with pytest.raises(TypeError, match="'abc'"):
        pr.arg_type("abc")


def test_parse_ptxas_takes_the_entry_function_and_rows_mark_spills() -> None:
    text = """ptxas info    : Compiling entry function 'kern' for 'sm_90a'
ptxas info    : Function properties for helper
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers
ptxas info    : Function properties for kern
    64 bytes stack frame, 120 bytes spill stores, 96 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 64 bytes cumulative stack size
"""
    assert pr.parse_ptxas(text, "kern") == (255, 120, 96, 64)
    with pytest.raises(RuntimeError, match="'other'"):
        pr.parse_ptxas(text, "other")
    row = pr.Row("kern", "K=128 VARLEN=F", 8, 2, 255, 120, 96, 64, 40960)
    assert row.markdown() == ("| kern | K=128 VARLEN=F | 8 | 2 | 255 | **120** | **96** | 64 | "
                              "40960 |")
    assert pr.short_constexprs({"K": 128, "EPS": 1e-6, "VARLEN": False, "X": None}) == (
        "K=128 EPS=1e-06 VARLEN=F X=-")
