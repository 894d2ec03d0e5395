"""The spawn harness: results, failures, hangs, crashes, orphans, torchrun.

The runs that wait out a timeout or a grace period and the ones in fresh interpreters start
together, two at a time (``Concurrently``, a module fixture); each test asserts on its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from overlap_runtime import rank_start
from overlap_runtime.launch import RankFailedError, RanksTimeoutError, init_from_env, spawn
from overlap_runtime.testing import Concurrently, run_ranks


def _identity(rank: int, world: int, base: float) -> dict:
    return {"rank": rank, "world": world, "t": torch.full((2,), base + rank),
            "dist_rank": dist.get_rank(), "backend": str(dist.get_backend())}


def test_results_come_back_in_rank_order() -> None:
    out = run_ranks(_identity, 4, args=(10.0,))
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [o["dist_rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 and o["backend"] == "gloo" for o in out)
    assert torch.equal(out[3]["t"], torch.tensor([13.0, 13.0]))


def _record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def _wait_dead(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _one_rank_raises(rank: int, world: int, pid_dir: str) -> None:
    _record_pid(pid_dir, rank)
    dist.barrier()  # every pid is on disk before anyone fails
    if rank == 2:
        raise ValueError("boom on purpose")
    dist.barrier()  # the others block here until they are killed


def test_a_rank_that_raises_fails_all_fast_and_leaves_no_orphans(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_one_rank_raises, 4, timeout_s=60, args=(str(tmp_path),))
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 2
    assert "rank 2 of 4 raised ValueError: boom on purpose" in str(info.value)
    assert "_one_rank_raises" in info.value.child_traceback
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 4
    assert _wait_dead(pids) == [], "orphan ranks survived"


def _one_rank_hangs(rank: int, world: int, pid_dir: str) -> None:
    _record_pid(pid_dir, rank)
    dist.barrier()
    if rank in (1, 3):
        while True:
            time.sleep(0.05)


# The job's timeout counts from the launch: it must cover four ranks starting, joining the group
# and passing a barrier on a loaded two-core machine (seconds), and then the two finished ranks
# must not be named. 10 s; the hang is reported within the timeout plus the stack dump and kill.
HANG_TIMEOUT_S = 10.0


def _hang(pid_dir: Path) -> tuple[RanksTimeoutError, float, Path]:
    t0 = time.monotonic()
    with pytest.raises(RanksTimeoutError) as info:
        run_ranks(_one_rank_hangs, 4, timeout_s=HANG_TIMEOUT_S, args=(str(pid_dir),))
    return info.value, time.monotonic() - t0, pid_dir


def _grace() -> tuple[RankFailedError, float]:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_fail_in_turn, 4, timeout_s=60, failure_grace_s=3.0)
    return info.value, time.monotonic() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Concurrently]:
    """The runs that wait out a timeout or a grace period (~4 s each) and the ones in fresh
    interpreters (one core each), started together, two at a time."""
    def in_dir(fn: Any, name: str) -> Any:
        return lambda: fn(tmp_path_factory.mktemp(name))

    with Concurrently({"hang": in_dir(_hang, "hang"), "grace": _grace,
                       "decoy": in_dir(_decoy_in_the_working_directory, "decoy"),
                       "sigkill": in_dir(_sigkilled_parent, "sigkill"),
                       "torchrun": in_dir(_torchrun_with_init_from_env, "torchrun")}) as started:
        yield started


def test_a_hang_fails_naming_the_ranks_still_running(runs: Concurrently) -> None:
    err, wall, tmp_path = runs.result("hang")
    assert HANG_TIMEOUT_S <= wall < HANG_TIMEOUT_S + 10
    assert err.ranks == [1, 3]
    assert "ranks [1, 3]" in str(err)
    assert "_one_rank_hangs" in err.stacks[1]
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert _wait_dead(pids) == []


def _one_rank_dies(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_one_rank_dies, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "exit code 3" in str(info.value)


def _fail_in_turn(rank: int, world: int) -> str:
    # Every rank is past the process group's connect before rank 0 fails: a rank still
    # connecting when rank 0 exits raises "connection closed" of its own (the ranks start
    # seconds apart on a loaded machine), which is not the path this test is about.
    dist.barrier()
    if rank == 0:
        raise ValueError("rank 0 first")
    if rank == 1:
        time.sleep(1.5)  # after the 1 s that spawn always waits for a death
        raise KeyError("rank 1 after it")
    if rank == 2:
        time.sleep(0.2)
        return "rank 2 finished"
    time.sleep(60)  # rank 3 never ends on its own
    return "never"


def test_failure_grace_collects_the_other_ranks_errors_then_kills_the_rest(
        runs: Concurrently) -> None:
    err, wall = runs.result("grace")
    assert err.rank == 0 and sorted(err.failures) == [0, 1] and err.unfinished == [3], str(err)
    assert err.failures[0].exc_type == "ValueError" and err.failures[0].after_s == 0
    assert err.failures[1].exc_type == "KeyError" and 1.0 < err.failures[1].after_s < 3.0
    msg = str(err)
    assert msg.startswith("rank 0 of 4 raised ValueError: rank 0 first")
    assert "--- the other ranks within 3s of rank 0's failure ---" in msg
    assert "rank 1 raised KeyError: 'rank 1 after it'" in msg and "rank 2 finished" in msg
    assert "rank 3 still running after the 3s grace: killed" in msg
    assert wall < 20


def _raise_then_die(rank: int, world: int) -> None:
    # Both ranks are running after the barrier (the ranks start seconds apart on a loaded
    # machine); the death then follows the error by 0.1 s, inside the launcher's 1 s window.
    dist.barrier()
    if rank == 0:  # e.g. "connection closed" at a peer that died: seen first, but a consequence
        raise RuntimeError("peer closed the connection")
    time.sleep(0.1)
    os._exit(5)


def test_a_death_right_after_another_failure_is_reported_as_the_failure() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_then_die, 2, timeout_s=60)
    assert info.value.rank == 1 and info.value.failures[1].died, str(info.value)
    assert str(info.value).startswith("rank 1 of 2 died with exit code 5")
    assert info.value.failures[0].exc_type == "RuntimeError"


def _ctx_from_env(rank: int, world: int) -> tuple[int, int, int, str]:
    ctx = init_from_env(device="cpu")  # already initialised by spawn: must just describe it
    return ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend


def test_init_from_env_reads_the_environment() -> None:
    out = run_ranks(_ctx_from_env, 2)
    assert out == [(0, 2, 0, "gloo"), (1, 2, 1, "gloo")]


def test_init_from_env_without_torchrun_names_the_missing_variables(monkeypatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="RANK.*WORLD_SIZE.*torchrun"):
        init_from_env()


def test_spawn_argument_checks() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        spawn(_identity, 0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        spawn(_identity, 1, timeout_s=0)


def test_torchrun_with_init_from_env(runs: Concurrently) -> None:
    runs.result("torchrun")


def _torchrun_with_init_from_env(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from overlap_runtime.launch import init_from_env
        from overlap_runtime.ops.comm import all_gather
        ctx = init_from_env(device="cpu")
        out = all_gather(torch.tensor([float(ctx.rank)]))
        assert out.tolist() == [0.0, 1.0], out
        print(f"rank {ctx.rank} ok {ctx.backend}")
        dist.destroy_process_group()
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 ok gloo" in proc.stdout and "rank 1 ok gloo" in proc.stdout


_ORPHAN_PARENT = """
import os, sys, time
from pathlib import Path
from overlap_runtime.launch import spawn

def sleeper(rank, world, pid_dir):
    Path(pid_dir, f"rank{rank}.pid").write_text(f"{os.getpid()} {os.getppid()}")
    time.sleep(600)

if __name__ == "__main__":
    spawn(sleeper, 2, args=(sys.argv[1],), timeout_s=300)
"""


def test_a_sigkilled_parent_leaves_no_rank_forkserver_or_temp_dir(runs: Concurrently) -> None:
    """kill -KILL the process running spawn: its ranks, the forkserver and spawn's files go."""
    runs.result("sigkill")


def _sigkilled_parent(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    tmp_dir = tmp_path / "tmp"
    pid_dir.mkdir()
    tmp_dir.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_PARENT)
    env = dict(os.environ, TMPDIR=str(tmp_dir))
    parent = subprocess.Popen([sys.executable, str(script), str(pid_dir)], env=env)
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.glob("*.pid"))) < 2:
            assert parent.poll() is None, f"parent exited early with {parent.returncode}"
            assert time.monotonic() < deadline, "ranks did not start within 120 s"
            time.sleep(0.1)
        time.sleep(0.2)  # both pid files fully written
        pairs = [tuple(int(x) for x in p.read_text().split()) for p in pid_dir.glob("*.pid")]
        ranks = [pid for pid, _ in pairs]
        servers = sorted({ppid for _, ppid in pairs})
        assert parent.pid not in servers, "ranks are expected to be forked by the forkserver"
    finally:
        parent.kill()
        parent.wait(30)
    survivors = _wait_dead(ranks + servers, seconds=5.0)
    assert survivors == [], (f"still alive 5 s after the parent's SIGKILL: {survivors} "
                             f"(ranks {ranks}, forkserver {servers})")
    left = sorted(p.name for p in tmp_dir.glob("overlap_runtime_spawn_*"))
    assert left == [], f"spawn left temporary directories behind: {left}"
    deadline = time.monotonic() + 5.0  # the exiting forkserver removes the parent's pymp-*
    while (left := sorted(p.name for p in tmp_dir.glob("pymp-*"))) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"multiprocessing's directory of the killed parent was left: {left}"


def _listening_addresses(port: int) -> list[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    import ipaddress

    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.append(str(ipaddress.ip_address(raw)))
    return sorted(found)


def _store_listen(rank: int, world: int) -> tuple[str, list[str]]:
    return os.environ["MASTER_ADDR"], _listening_addresses(int(os.environ["MASTER_PORT"]))


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_the_rendezvous_store_listens_on_loopback_only_by_default(monkeypatch) -> None:
    monkeypatch.delenv("OVERLAP_RUNTIME_STORE_HOST", raising=False)
    out = run_ranks(_store_listen, 2)
    assert out == [("127.0.0.1", ["127.0.0.1"])] * 2


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_the_rendezvous_store_host_can_be_chosen(monkeypatch) -> None:
    monkeypatch.setenv("OVERLAP_RUNTIME_STORE_HOST", "0.0.0.0")
    out = spawn(_store_listen, 1, backend="gloo", timeout_s=120)
    assert out == [("127.0.0.1", ["0.0.0.0"])]  # children reach a wildcard bind through loopback
    monkeypatch.delenv("OVERLAP_RUNTIME_STORE_HOST")
    out = spawn(_store_listen, 1, backend="gloo", timeout_s=120, store_host="localhost")
    assert out[0][1] in (["127.0.0.1"], ["::1"]) and out[0][0] == out[0][1][0]
    with pytest.raises(ValueError, match="store_host 'no such host.invalid' does not resolve"):
        spawn(_store_listen, 1, backend="gloo", timeout_s=120, store_host="no such host.invalid")


_DECOY_PARENT = """
import json, sys
import overlap_runtime
from overlap_runtime.launch import spawn

def where(rank, world):
    import overlap_runtime, overlap_runtime.launch, os
    return [overlap_runtime.__file__, overlap_runtime.launch.__file__,
            os.environ.get("PYTHONSAFEPATH"), os.environ.get("PYTHONPATH")]

if __name__ == "__main__":
    print(json.dumps({"parent": overlap_runtime.__file__,
                      "ranks": spawn(where, 2, timeout_s=120)}))
"""


def test_ranks_import_the_parents_package_not_a_copy_in_the_working_directory(
        runs: Concurrently) -> None:
    """A decoy ``overlap_runtime/`` in the working directory: the forkserver (``python -c``, the
    current directory first on sys.path) used to import it; the ranks import the parent's."""
    runs.result("decoy")


def _decoy_in_the_working_directory(tmp_path: Path) -> None:
    real = Path(__file__).resolve().parents[1]
    cwd, scripts = tmp_path / "cwd", tmp_path / "scripts"
    (cwd / "overlap_runtime").mkdir(parents=True)
    marker = tmp_path / "decoy_imported"
    (cwd / "overlap_runtime" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\n__version__ = 'decoy'\n")
    scripts.mkdir()
    (scripts / "parent.py").write_text(_DECOY_PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(real)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("PYTHONSAFEPATH", None)
    proc = subprocess.run([sys.executable, str(scripts / "parent.py")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["parent"]).resolve() == real / "overlap_runtime" / "__init__.py"
    for init, launch, safe, path in out["ranks"]:
        assert Path(init).resolve() == real / "overlap_runtime" / "__init__.py", out
        assert Path(launch).resolve() == real / "overlap_runtime" / "launch.py", out
        assert safe is None and path == env["PYTHONPATH"], out  # the user's environment back
    assert not marker.exists(), "the decoy package was imported (by the forkserver or a rank)"


_KERNELS = "overlap_runtime.ops.gdn.triton"


def _modules_at_start(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {m: m in sys.modules for m in (*rank_start.FORKSERVER_PRELOAD_TORCH,
                                                           *rank_start.FORKSERVER_PRELOAD_OURS)}
    found["kernel modules"] = sorted(m for m in sys.modules if m.startswith(_KERNELS))
    return found


def _interpreted_kernel_runs(rank: int, world: int) -> dict[str, Any]:
    """A Triton kernel of ours and one of triton's own helpers (``tl.sum``) under this rank's
    ``TRITON_INTERPRET=1``: the l2norm forward on the CPU against torch."""
    fresh = "torch._dynamo" not in sys.modules  # not forked from the forkserver
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from overlap_runtime.ops.gdn.triton.l2norm import l2norm_forward

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    y, _ = l2norm_forward(x)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    return {"fresh": fresh,
            "helpers interpreted": isinstance(tl.sum, InterpretedFunction),
            "max error": float((y - want).abs().max())}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10: no preload of overlap_runtime")
def test_ranks_start_with_the_preloaded_modules_and_no_kernel_module() -> None:
    """The forkserver imported torch.distributed's DTensor, FSDP2, DCP, torch._dynamo and our
    stack once (a rank no longer pays ~2 s of imports), but no Triton kernel module."""
    for found in run_ranks(_modules_at_start, 2):
        assert found.pop("kernel modules") == [], "the forkserver imported a Triton kernel module"
        assert all(found.values()), f"not preloaded: {[m for m, ok in found.items() if not ok]}"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_spawn_setting_triton_interpret_gets_interpreted_kernels() -> None:
    """The forkserver imported the triton package (through torch._dynamo), whose own helpers were
    then decorated for compilation: a spawn whose env sets ``TRITON_INTERPRET`` starts fresh
    interpreters, where a kernel calling ``tl.sum`` runs interpreted and right."""
    assert rank_start.context_for({"TRITON_INTERPRET": "1"}).get_start_method() == "spawn"
    assert rank_start.context_for({"OMP_NUM_THREADS": "1"}) is rank_start.context()
    for got in run_ranks(_interpreted_kernel_runs, 2, env={"TRITON_INTERPRET": "1"}):
        assert got["fresh"] and got["helpers interpreted"], got
        assert got["max error"] <= 1e-6, got  # fp32 rounding of a 16-term sum and one sqrt


_PRELOAD_SCRIPT = """
import json
from overlap_runtime import rank_start
rank_start.preload_in_forkserver("xml.dom.minidom")
from overlap_runtime.launch import spawn
from tests.support.preload_probe import modules_at_start
ranks = spawn(modules_at_start, 2, args=(["xml.dom.minidom", "pytest"],), timeout_s=120)
try:
    rank_start.preload_in_forkserver("json")
    late = "no error"
except RuntimeError as exc:
    late = str(exc)
print(json.dumps({"ranks": ranks, "late": late}))
"""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10: no preload from the parent's path")
def test_preload_in_forkserver_gives_ranks_the_modules_and_refuses_once_started() -> None:
    """In a fresh interpreter: a module added with ``preload_in_forkserver`` is in every rank
    when its function starts (the function's own module imports nothing); one not added is not;
    adding after the first spawn raises, naming the rule."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _PRELOAD_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ranks"] == [{"xml.dom.minidom": True, "pytest": False}] * 2, out
    assert "already running" in out["late"] and "before the first spawn" in out["late"], out


def _never_runs(rank: int, world: int) -> None:
    raise AssertionError("the package check must stop the rank first")


def test_a_rank_with_another_package_than_the_parent_fails_naming_both(monkeypatch) -> None:
    import overlap_runtime

    real = os.path.dirname(os.path.realpath(overlap_runtime.__file__))
    monkeypatch.setattr(overlap_runtime, "__file__", "/elsewhere/overlap_runtime/__init__.py")
    with pytest.raises(RankFailedError) as info:
        spawn(_never_runs, 1, timeout_s=120)
    msg = str(info.value)
    assert msg.startswith("rank 0 of 1 raised ImportError: rank 0 imported overlap_runtime from "
                          f"{real}, but the process that spawned it imported overlap_runtime "
                          "from /elsewhere/overlap_runtime"), msg


def test_a_peer_loss_read_first_does_not_hide_the_rank_that_raised() -> None:
    """Rank 2 raises; rank 0's barrier fails on the closed connection and the parent may read
    rank 0's error first, even in the same wakeup (after_s equal): rank 2 is still the head."""
    from overlap_runtime.launch import RankFailure, _rank_failed

    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
            "peer [127.0.0.1]:1234")
    failures = {0: RankFailure(0, "RuntimeError", gloo, "tb0", after_s=0.0),
                2: RankFailure(2, "ValueError", "boom on purpose", "tb2", after_s=0.0),
                1: RankFailure(1, "RuntimeError", gloo, "tb1", after_s=0.01)}
    err = _rank_failed(failures, {}, 4, 0.0)
    assert err.rank == 2 and "rank 2 of 4 raised ValueError: boom on purpose" in str(err)
    # a peer loss long after the first failure does not jump ahead of it
    late = {0: RankFailure(0, "TrainStepError", "step 3 failed", "tb0", after_s=0.0),
            1: RankFailure(1, "RuntimeError", gloo, "tb1", after_s=0.2)}
    assert _rank_failed(late, {}, 4, 0.0).rank == 0
    # only peer losses: the first one is the head
    only = {3: RankFailure(3, "RuntimeError", gloo, after_s=0.0),
            1: RankFailure(1, "RuntimeError", gloo, after_s=0.1)}
    assert _rank_failed(only, {}, 4, 0.0).rank == 3


def test_concurrently_overlaps_the_waits_and_hands_each_its_result_or_error() -> None:
    def wait(s: float) -> float:
        time.sleep(s)
        return s

    def fails() -> None:
        raise KeyError("scenario b")

    t0 = time.monotonic()
    with Concurrently({"a": lambda: wait(0.5), "b": fails, "c": lambda: wait(0.5)},
                      max_workers=3, timeout_s=30) as runs:
        assert runs.result("a") == 0.5 and runs.result("c") == 0.5
        with pytest.raises(KeyError, match="scenario b"):
            runs.result("b")
        with pytest.raises(KeyError, match="no scenario 'd'"):
            runs.result("d")
    assert time.monotonic() - t0 < 0.9  # the two waits overlapped (one after the other: 1.0 s)
    # bounded waits: for a result, and for what still runs at close
    with pytest.raises(TimeoutError, match=r"scenarios \['slow'\] still running at close"):
        with Concurrently({"slow": lambda: wait(0.5)}, timeout_s=0.05) as runs:
            with pytest.raises(TimeoutError, match="'slow' still running after 0s"):
                runs.result("slow")
