"""``python -m tests.support.interpreter_check`` (``TRITON_INTERPRET=1``): the shortcut of
``tests.support.interpreter`` against triton's own path on one kernel that calls a
``@triton.jit`` helper of its own and ``tl.sum`` (a helper that sees ``triton.language.core``)
16 times each per program. Prints ``RESULT {"known", "triton", "installed", "patches":
{"triton", "shortcut"}, "bitwise", "within_bound"}``: how often ``triton.language`` was patched
in one launch of two programs each way, whether the outputs agree bitwise, and whether the
shortcut's sums are within ``16 eps32 sum|terms|`` of float64."""

from __future__ import annotations

import json
from typing import Any

import torch

import triton  # noqa: E402  (after the check: TRITON_INTERPRET must be set first)
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as interp  # noqa: E402

from tests.support import interpreter  # noqa: E402


@triton.jit
def _scaled_row(x, r, n: tl.constexpr):
    return tl.load(x + r * n + tl.arange(0, n)) * (r + 1.0)


@triton.jit
def _kernel(x, y, t, n: tl.constexpr):
    acc = tl.zeros([n], dtype=tl.float32)
    tot = 0.0
    for r in range(n):
        row = _scaled_row(x, r, n)
        acc += row
        tot += tl.sum(row, axis=0)  # a helper seeing triton.language.core, not the kernel's tl
    tl.store(y + tl.program_id(0) * n + tl.arange(0, n), acc)
    tl.store(t + tl.program_id(0), tot)


def check() -> dict[str, Any]:
    known = interpreter.known_interpreter(interp)  # before install() replaces the helper call
    patches = [0]
    patch_lang = interp._patch_lang

    def counted(fn: Any) -> Any:
        patches[0] += 1
        return patch_lang(fn)

    interp._patch_lang = counted
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    outs, sums, counts, installed = {}, {}, {}, False
    for tag in ("triton", "shortcut"):
        if tag == "shortcut":
            installed = interpreter.install()
        patches[0] = 0
        y, t = torch.empty(2, 16), torch.empty(2)
        _kernel[(2,)](x, y, t, 16)
        outs[tag], sums[tag], counts[tag] = y, t, patches[0]
    terms = x.double() * torch.arange(1.0, 17.0, dtype=torch.float64)[:, None]
    # 16 fp32 additions per column: |error| <= 16 eps32 sum|terms|
    bound = 16 * torch.finfo(torch.float32).eps * terms.abs().sum(0)
    excess = ((outs["shortcut"].double() - terms.sum(0)).abs() - bound).max()
    return {"known": known, "triton": triton.__version__,
            "installed": installed, "patches": counts,
            "bitwise": (torch.equal(outs["triton"], outs["shortcut"])
                        and torch.equal(sums["triton"], sums["shortcut"])),
            "within_bound": bool(excess <= 0)}


if __name__ == "__main__":
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print("RESULT " + json.dumps(check()))
