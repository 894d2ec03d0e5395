"""The Triton-interpreter shortcut of the test children (``tests.support.interpreter``).

Every interpreter child and interpreted rank of the suite installs it: a ``@triton.jit``
helper called inside a launch skips triton's re-patch of ``triton.language`` (a tenth of the
interpreter's time in the GDN kernels). This checks, in a child with ``TRITON_INTERPRET=1``,
that it is active on the installed triton whenever that triton's helper call is the one it
replaces (otherwise the test is skipped, naming the version: the suite is slower there) and that
a kernel calling its own helper and ``tl.sum`` 16 times each per program gives bitwise the
result of triton's own path, within the fp32 bound of float64.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.gdn import run_interpreted

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed")]


def test_nested_helpers_skip_the_repatch_and_compute_the_same() -> None:
    r = run_interpreted("interpreter_check", timeout_s=120)
    if not r["known"]:
        pytest.skip(f"triton {r['triton']}: InterpretedFunction.__call__ is not the body the "
                    "shortcut replaces (tests.support.interpreter.KNOWN_HELPER_CALL): it stays off")
    assert r["installed"], "the shortcut did not install on this triton"
    # triton's path: the launch plus one patch per helper call (2 programs x 16 calls of each
    # of the two helpers)
    assert r["patches"]["triton"] >= 65, r
    # the launch's own patch and the first tl.sum's (triton.language.core), no other helper's
    assert r["patches"]["shortcut"] < 5, r
    assert r["bitwise"] and r["within_bound"], r
