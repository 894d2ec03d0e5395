"""tests.support.fork_launch: torchrun's environment, exit codes, a hang, the thread rule.

Each case runs ``python -m tests.support.fork_launch --nproc-per-node 2 script.py`` on a tiny
script written to a temporary directory, in a fresh session whose process group is killed after
``CASE_TIMEOUT_S``. The cases start together, two at a time (``Concurrently``, a module fixture);
each test asserts on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from overlap_runtime.testing import Concurrently
from tests.support.fork_launch import LAUNCHER_ERROR_EXIT, TIMEOUT_EXIT

ROOT = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_S = 60
HANG_TIMEOUT_S = 1.0

ALL_REDUCE = """
    import atexit
    import os
    import sys

    import torch
    import torch.distributed as dist

    from overlap_runtime.launch import init_from_env

    rc = init_from_env("cpu")
    t = torch.tensor([float(rc.rank + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE")
    print(" ".join(f"{k}={os.environ[k]}" for k in keys), f"sum={t.item():g}",
          f"argv={sys.argv}", f"name={__name__}", f"run_id={'TORCHELASTIC_RUN_ID' in os.environ}")
    atexit.register(print, f"rank {rc.rank} ran its exit handler")
    dist.destroy_process_group()
"""
RANK1_EXITS_3 = """
    import os
    import sys
    import time

    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(60)  # rank 0 outlives the failure: the launcher must kill it
"""
RANK1_HANGS = """
    import os
    import time
    from pathlib import Path

    if os.environ["RANK"] == "1":
        Path(__file__).with_name("rank1.pid").write_text(str(os.getpid()))
        time.sleep(600)
"""
STARTS_A_THREAD = """
    import thread_at_import

    print("ran")
"""
THREAD_AT_IMPORT = """
    import threading
    import time

    threading.Thread(target=time.sleep, args=(30,), name="started-at-import",
                     daemon=True).start()
"""


class Launched(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """A launcher run; ``outlived``: pids of its session still running after it exited."""

    outlived: list[int]


def _session(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes of session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(stat.parent.name))
    return found


def _launch(directory: Path, script: str, *extra: str) -> Launched:
    """The launcher on ``directory/script`` (2 ranks); its session is killed after
    ``CASE_TIMEOUT_S`` (``returncode`` None then) and afterwards."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tests.support.fork_launch", "--nproc-per-node", "2", *extra,
           str(directory / script)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    code: int | None
    try:
        out, err = proc.communicate(timeout=CASE_TIMEOUT_S)
        code = proc.returncode
        outlived = _session(proc.pid)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code, outlived = None, []
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = Launched(cmd, code, out, err)
    result.outlived = outlived
    return result


def _case(directory: Path, scripts: dict[str, str], *extra: str) -> tuple[Launched, float]:
    """Write ``scripts`` (file name -> source) to ``directory``, launch the first; the result
    and its wall time."""
    for file, source in scripts.items():
        (directory / file).write_text(textwrap.dedent(source))
    t0 = time.monotonic()
    result = _launch(directory, next(iter(scripts)), *extra)
    return result, time.monotonic() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Concurrently]:
    def case(name: str, scripts: dict[str, str], *extra: str):  # type: ignore[no-untyped-def]
        return lambda: _case(tmp_path_factory.mktemp(name), scripts, *extra)

    with Concurrently({
        "ok": case("ok", {"all_reduce.py": ALL_REDUCE}),
        "exit3": case("exit3", {"exit3.py": RANK1_EXITS_3}),
        "hang": case("hang", {"hang.py": RANK1_HANGS}, "--timeout", str(HANG_TIMEOUT_S)),
        "thread": case("thread", {"thread.py": STARTS_A_THREAD,
                                  "thread_at_import.py": THREAD_AT_IMPORT}),
    }, timeout_s=CASE_TIMEOUT_S + 30) as started:
        yield started


def test_ranks_get_torchruns_environment_and_all_reduce(runs: Concurrently) -> None:
    result, _ = runs.result("ok")
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    assert sorted(result.stdout.splitlines()) == sorted([
        *(f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 ROLE_RANK={r} "
          f"ROLE_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 TORCHELASTIC_USE_AGENT_STORE=True sum=3 "
          f"argv={[result.args[-1]]} name=__main__ run_id=True" for r in (0, 1)),
        "rank 0 ran its exit handler", "rank 1 ran its exit handler",
    ]), result.stdout
    assert result.outlived == [], f"processes outlived the launcher: {result.outlived}"


def test_a_rank_exiting_3_makes_the_launcher_exit_3_naming_it(runs: Concurrently) -> None:
    result, wall = runs.result("exit3")
    assert result.returncode == 3, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    assert "rank 1 of 2 exited with code 3" in result.stderr, result.stderr
    assert "killing ranks [0]" in result.stderr, result.stderr  # rank 0 sleeps 60 s
    assert wall < 30, f"the launcher took {wall:.1f} s: rank 0 was not killed"
    assert result.outlived == [], f"processes outlived the launcher: {result.outlived}"


def test_a_hanging_rank_is_killed_at_the_timeout(runs: Concurrently) -> None:
    result, wall = runs.result("hang")
    assert result.returncode == TIMEOUT_EXIT, (
        f"exit {result.returncode} (None: still running after {CASE_TIMEOUT_S} s):\n"
        f"{result.stderr[-4000:]}")
    assert (f"timeout: ranks [1] of 2 still running after {HANG_TIMEOUT_S:g} s"
            in result.stderr), result.stderr
    assert "hang.py\", line" in result.stderr, f"no stack of rank 1:\n{result.stderr}"
    assert wall < 30, f"the launcher took {wall:.1f} s"
    pid = int(Path(result.args[-1]).with_name("rank1.pid").read_text())
    assert result.outlived == [], f"rank 1 is pid {pid}; outlived the launcher: {result.outlived}"


def test_a_thread_started_before_the_fork_is_refused(runs: Concurrently) -> None:
    result, _ = runs.result("thread")
    assert result.returncode == LAUNCHER_ERROR_EXIT, (
        f"exit {result.returncode}:\n{result.stdout}\n{result.stderr[-4000:]}")
    assert "forking is only safe before any thread starts" in result.stderr, result.stderr
    assert "started-at-import" in result.stderr, result.stderr
    assert "ran" not in result.stdout, result.stdout
