"""CommSerializer: one all-to-all in flight per group, launch logs, the cross-rank order check.

The exclusion and order tests run real all-to-alls on 2 gloo ranks; the log comparison is also
checked as a pure function. The two timeout runs (a peer sleeping 3 s) start together
(``Concurrently``, a module fixture); each test asserts on its own.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest
import torch

from overlap_runtime.coordinator import (
    CommSerializer,
    CoordinatorProtocolError,
    CoordinatorTimeout,
    HookCoordinator,
    LaunchOrderMismatch,
)
from overlap_runtime.coordinator.serializer import LaunchRecord, compare_launch_logs
from overlap_runtime.ops.comm import CommTimeoutError
from overlap_runtime.testing import Concurrently, run_ranks

pytestmark = pytest.mark.timeout(60)


def test_compare_launch_logs_names_first_difference() -> None:
    same = [("L0.dispatch", "forward"), ("L0.dispatch", "backward")]
    assert compare_launch_logs({0: same, 1: list(same)}) == 2
    rec = [LaunchRecord(0, "L0.dispatch", "forward", "forward", "MainThread")]
    assert compare_launch_logs({0: rec, 1: [("L0.dispatch", "forward")]}) == 1
    with pytest.raises(LaunchOrderMismatch) as info:
        compare_launch_logs({0: same, 1: [same[0], ("L0.combine", "forward")]}, "ep")
    assert info.value.index == 1 and info.value.group == "ep"
    assert "launch #1" in str(info.value) and "L0.combine" in str(info.value)
    with pytest.raises(LaunchOrderMismatch, match="no launch") as info:
        compare_launch_logs({0: same, 1: same[:1], 2: same})
    assert info.value.entries[1] is None


def test_launch_log_needs_debug() -> None:
    with pytest.raises(CoordinatorProtocolError, match="debug"):
        CommSerializer(1.0).launch_log()


def _exclusion_main(rank: int, world: int):
    torch.set_num_threads(1)
    coord = HookCoordinator(timeout_s=20, debug=True)
    ser = coord.serializer
    x = torch.arange(4.0 * world).view(2 * world, 2) + 100 * rank
    # 1. thread T1 launches async; T2's launch waits for T1's handle, then goes (same on all ranks)
    handle, out1 = ser.all_to_all_single(x, tag="t1", async_op=True)
    done = threading.Event()
    box = {}

    def second() -> None:
        box["out"] = ser.all_to_all_single(x * 2, tag="t2")
        done.set()

    t2 = threading.Thread(target=second)
    t2.start()
    time.sleep(0.3)
    blocked_while_in_flight = not done.is_set() and "t1" in (ser.in_flight() or "")
    handle.wait()
    t2.join(20)
    finished_after = done.is_set() and ser.in_flight() is None
    # 2. a second launch from the thread that still has one in flight is misuse, and loud
    h, _ = ser.all_to_all_single(x, tag="t3", async_op=True)
    with pytest.raises(CoordinatorProtocolError, match="still has 't3'"):
        ser.all_to_all_single(x, tag="t4")
    h.wait()
    # 3. another thread waiting on a lock that is never released gets a clear timeout
    small = HookCoordinator(timeout_s=0.3, debug=True)
    h5, _ = small.serializer.all_to_all_single(x, tag="held", async_op=True)
    errs = {}

    def starved() -> None:
        try:
            small.serializer.all_to_all_single(x, tag="starved")
        except CoordinatorTimeout as e:
            errs["e"] = e

    t = threading.Thread(target=starved)
    t.start()
    t.join(10)
    h5.wait()
    timeout_msg = str(errs.get("e", ""))
    # 4. backward all-to-alls go through the lock and the log too
    y = x.clone().requires_grad_(True)
    ser.all_to_all_single(y, tag="t6").sum().backward()
    log = [r.key() for r in ser.launch_log()]
    count = ser.check_launch_order()
    # 5. a rank that tags its launches differently is caught by the check on every rank
    ser.clear_log()
    ser.all_to_all_single(x, tag="same")
    ser.all_to_all_single(x, tag=f"differs-on-rank-{rank}")
    try:
        ser.check_launch_order()
        mismatch = None
    except LaunchOrderMismatch as e:
        mismatch = (e.index, str(e))
    return (blocked_while_in_flight, finished_after, torch.equal(box["out"], 2 * out1),
            timeout_msg, log, count, mismatch)


def test_serializer_on_two_ranks() -> None:
    for rank, res in enumerate(run_ranks(_exclusion_main, 2, timeout_s=60)):
        blocked, finished, same_values, timeout_msg, log, count, mismatch = res
        assert blocked, "the second all-to-all launched while the first was in flight"
        assert finished and same_values
        assert "coordinator timeout" in timeout_msg and "launch lock" in timeout_msg
        assert "'held'" in timeout_msg and "'starved'" in timeout_msg
        assert log == [("t1", "forward"), ("t2", "forward"), ("t3", "forward"),
                       ("t6", "forward"), ("t6", "backward")]
        assert count == 5
        assert mismatch is not None and mismatch[0] == 1
        assert "differs-on-rank-0" in mismatch[1] and "differs-on-rank-1" in mismatch[1]


def _late_peer_serialized(rank: int, world: int, async_op: bool) -> str:
    if rank == 1:
        time.sleep(3.0)  # never joins the all-to-all within rank 0's timeout
        return "slept"
    ser = CommSerializer(timeout_s=20)
    x = torch.zeros(2, 1)
    try:
        if async_op:
            handle, _ = ser.all_to_all_single(x, tag="L3.dispatch", async_op=True, timeout_s=0.5)
            handle.wait()
        else:
            ser.all_to_all_single(x, tag="L3.dispatch", timeout_s=0.5)
    except CommTimeoutError as exc:
        assert ser.in_flight() is None  # the lock is given back
        return str(exc)
    return "no timeout"


@pytest.fixture(scope="module")
def late_peer_runs() -> Iterator[Concurrently]:
    with Concurrently({f"async_op={a}": (lambda a=a: run_ranks(_late_peer_serialized, 2,
                                                               args=(a,), timeout_s=60))
                       for a in (False, True)}) as runs:
        yield runs


@pytest.mark.parametrize("async_op", [False, True])
def test_a_serialized_all_to_all_timeout_names_its_tag(async_op: bool,
                                                       late_peer_runs: Concurrently) -> None:
    msg = late_peer_runs.result(f"async_op={async_op}")[0]
    assert "all-to-all 'L3.dispatch' (forward) on group 'default'" in msg, msg
    assert "global ranks [0, 1]" in msg and "0.5s" in msg, msg
