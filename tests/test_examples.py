"""examples/: every script runs on gloo ranks and passes its own check.

Two launch paths, the same assertions (exit status 0, the script's ``CHECK <name>: ... <= 1e-05
...: OK`` line, the lines of ``EXPECTED_LINES``; the script compares itself with a single-process
reference and exits 1 on a mismatch):

* ``test_example_runs_forked_and_passes_its_check``: every example but ``TORCHRUN_EXAMPLE``
  runs under ``python -m tests.support.fork_launch`` (one interpreter imports torch and the
  script's imports once and forks the ranks, each with torchrun's environment; a fresh
  interpreter per rank costs ~2 s of CPU). This checks the script's own logic, its collectives
  and its output on the rank count used here, not torchrun's start-up.
* ``test_example_runs_under_real_torchrun_and_passes_its_check``: ``TORCHRUN_EXAMPLE`` (the
  cheapest two-rank one) is started as a user starts it (``python -m torch.distributed.run
  --standalone --nproc-per-node N examples/<name>.py``): proof that an example works under real
  torchrun (its rendezvous, a fresh interpreter per rank, ``init_from_env`` on its environment).

Each run is in a fresh session; on a timeout (``RUN_TIMEOUT_S``) or a failure the whole process
group of the run is killed. Static checks: every script in examples/ is listed here and in
README.md, its docstring gives the torchrun command with the rank count used here, and it
imports only the public API (``overlap_runtime.<subpackage>`` exports; never
``overlap_runtime.testing``).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "examples"

# script -> ranks (the smallest layout each shows)
EXAMPLES = {
    "pipeline_interleaved_overlap.py": 2,
    "moe_hook_coordinator.py": 2,
    "moe_pipeline_overlap_b_f.py": 4,
    "gdn_context_parallel.py": 2,
    "attention_context_parallel.py": 2,
    "dualpipev_deferred_w.py": 2,
    "train_4d.py": 8,
    "hf_finetune_export.py": 4,
}
# the one example still run under real torchrun (the cheapest two-rank one); the others fork
TORCHRUN_EXAMPLE = "dualpipev_deferred_w.py"
RUN_TIMEOUT_S = 240
# the fork launcher's own --timeout: inside RUN_TIMEOUT_S, so its report of the ranks still
# running (with their stacks) comes before the session is killed
FORK_LAUNCH_MARGIN_S = 15
# script -> lines its output must also hold (beyond the CHECK line): train_4d.py is the trainer's
# eight-rank layout (pp2 interleaved x fsdp4 x cp2 x ep2) checked against one device over 5 steps
# and its first step against the step graph (the conformance line is logged only on success)
EXPECTED_LINES = {
    "train_4d.py": [
        r"^layout: pp2\(interleaved_1f1b,v2\) x fsdp4 x cp2:p2p/ring x ep2$",
        r"^step graph: step 1 conforms \(\d+ launches recorded on 8 ranks\)$",
        r"^CHECK train_4d: .* \(loss and grad norm, 5 steps\): OK$",
    ],
}
# `testing` is the test harness, not a user API
PUBLIC_MODULES = {"context_parallel", "coordinator", "graph", "launch", "layers", "models", "moe",
                  "ops", "pipeline", "platform", "schedules", "trainer"}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a fresh torchrun, not nested in someone else's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_example(name: str, nproc: int, timeout_s: float = RUN_TIMEOUT_S
                ) -> subprocess.CompletedProcess[str]:
    """torchrun ``examples/<name>`` on ``nproc`` CPU ranks; the run's process group is killed on
    a timeout (and whatever is left of it afterwards)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(EXAMPLES_DIR / name)]
    return _run_in_session(cmd, name, nproc, timeout_s)


def run_example_forked(name: str, nproc: int, timeout_s: float = RUN_TIMEOUT_S
                       ) -> subprocess.CompletedProcess[str]:
    """``examples/<name>`` on ``nproc`` CPU ranks forked by ``tests.support.fork_launch``
    (its own timeout ``FORK_LAUNCH_MARGIN_S`` earlier); the run's process group is killed on a
    timeout (and whatever is left of it afterwards)."""
    cmd = [sys.executable, "-m", "tests.support.fork_launch", f"--nproc-per-node={nproc}",
           f"--timeout={max(timeout_s - FORK_LAUNCH_MARGIN_S, 1)}", str(EXAMPLES_DIR / name)]
    return _run_in_session(cmd, name, nproc, timeout_s)


def _run_in_session(cmd: list[str], name: str, nproc: int, timeout_s: float
                    ) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a fresh session, stdout and stderr together; its process group is killed on a
    timeout (a test failure) and afterwards (whatever outlived the launcher)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} on {nproc} ranks still running after {timeout_s} s; output:\n"
                    f"{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived torchrun, if any
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", [n for n in EXAMPLES if n != TORCHRUN_EXAMPLE])
def test_example_runs_forked_and_passes_its_check(name: str) -> None:
    _assert_passes_its_check(name, run_example_forked(name, EXAMPLES[name]))


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_example_runs_under_real_torchrun_and_passes_its_check() -> None:
    assert TORCHRUN_EXAMPLE in EXAMPLES, f"{TORCHRUN_EXAMPLE} is not in EXAMPLES"
    _assert_passes_its_check(TORCHRUN_EXAMPLE,
                             run_example(TORCHRUN_EXAMPLE, EXAMPLES[TORCHRUN_EXAMPLE]))


def _assert_passes_its_check(name: str, result: subprocess.CompletedProcess[str]) -> None:
    out = result.stdout
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{out[-6000:]}"
    stem = name.removesuffix(".py")
    check = re.findall(rf"^CHECK {stem}: max rel(?:ative difference|-L2) (\S+) <= 1e-05 .*: OK$",
                       out, re.MULTILINE)
    assert len(check) == 1, f"{name}: no single 'CHECK {stem}: ... OK' line in:\n{out[-6000:]}"
    assert float(check[0]) <= 1e-5, check
    for line in EXPECTED_LINES.get(name, []):
        assert re.search(line, out, re.MULTILINE), f"{name}: no line {line!r} in:\n{out[-6000:]}"


def test_every_example_is_run_and_documents_its_command() -> None:
    on_disk = sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))
    assert on_disk == sorted(EXAMPLES), f"examples/ holds {on_disk}; this test runs {EXAMPLES}"
    readme = (ROOT / "README.md").read_text()
    for name, nproc in EXAMPLES.items():
        assert f"`torchrun --nproc-per-node {nproc} examples/{name}`" in readme, (
            f"README.md's Examples section does not list {name} with its command")
        doc = ast.get_docstring(ast.parse((EXAMPLES_DIR / name).read_text()))
        assert doc, f"{name} has no docstring header"
        command = f"torchrun --nproc-per-node {nproc} examples/{name}"
        assert command in doc, f"{name}: its docstring lacks the command {command!r}"
        for section in ("What it shows:", "Run (", "Prints ("):
            assert section in doc, f"{name}: its docstring lacks {section!r}"


def _overlap_runtime_imports(tree: ast.Module) -> list[tuple[str, str]]:
    """(module, name) of ``from overlap_runtime.x import name`` and ``import overlap_runtime.x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("overlap_runtime"):
            found += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith("overlap_runtime")]
    return found


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_uses_only_the_public_api(name: str) -> None:
    imports = _overlap_runtime_imports(ast.parse((EXAMPLES_DIR / name).read_text()))
    assert imports, f"{name} uses nothing of overlap_runtime"
    for module, imported in imports:
        parts = module.split(".")
        assert len(parts) == 2 and parts[1] in PUBLIC_MODULES, (
            f"{name} imports from {module!r}: examples use overlap_runtime.<subpackage> only "
            f"({sorted(PUBLIC_MODULES)})")
        if not imported:  # ``import overlap_runtime.x``: the module itself is public
            continue
        mod = importlib.import_module(module)
        exported = getattr(mod, "__all__", None)
        public = (imported in exported if exported is not None
                  else not imported.startswith("_") and hasattr(mod, imported))
        assert public, f"{name} imports {imported!r}, which {module} does not export"
