"""tests.support.forked_child: the Triton-interpreter children of the suite, forked from the
ranks' forkserver (torch and triton imported once per test process) instead of started as fresh
interpreters. A child runs its module as ``__main__`` under the interpreter, its output and exit
code reach the parent as a subprocess's would, and a hanging child is killed at the timeout."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time

import pytest

from overlap_runtime import rank_start

from tests.support.forked_child import ForkedChild

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def _result(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def test_a_child_runs_its_module_interpreted_forked_from_the_forkserver() -> None:
    child = ForkedChild("forked_child_probe", "ok")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, (out, err)
    r = _result(out)
    # as under ``python -m``: argv[0] is the module's file
    assert r["argv"][0].endswith("tests/support/forked_child_probe.py"), r["argv"]
    assert r["argv"][1:] == ["ok"] and r["name"] == "__main__"
    assert r["interpret"] == "1" and r["threads"] == 1 and r["tl_sum_interpreted"], r
    # forked from the forkserver, which had imported torch: not a fresh interpreter
    assert r["ppid"] == rank_start.start_forkserver() and r["torch_before"], r
    assert err.strip().endswith("to stderr"), err


@pytest.mark.parametrize("mode, code, text", [("exit3", 3, "to stderr"),
                                              ("raise", 1, "RuntimeError: the probe raised")])
def test_exit_codes_and_tracebacks_reach_the_parent(mode: str, code: int, text: str) -> None:
    child = ForkedChild("forked_child_probe", mode)
    out, err = child.communicate(timeout=120)
    assert child.returncode == code and child.poll() == code, (out, err)
    assert _result(out)["argv"][1] == mode
    assert text in err, err


def test_a_hanging_child_is_killed_at_the_timeout_with_its_output() -> None:
    child = ForkedChild("forked_child_probe", "hang")
    first = child.stdout.readline()  # the child has started and printed: now it sleeps
    assert _result(first)["argv"][1] == "hang"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        child.communicate(timeout=1)
    assert time.monotonic() - started < 40
    assert child.returncode == -9, child.returncode
    assert "to stderr" in info.value.stderr
