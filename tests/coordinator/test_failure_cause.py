"""Which error ``CommComputeOverlap.run`` raises when both sides fail: the cause.

A side that runs out of time waiting for the comm token waited for the other side; when that
side failed on its own (a receive or an all-to-all that timed out, a peer that died), its error
is the cause and ``run`` raises it, even when the token wait's deadline passed first. The
induced errors stay in ``last_errors`` and are named in a note.
"""

from __future__ import annotations

import time

import pytest

from overlap_runtime.coordinator import CommComputeOverlap, CoordinatorTimeout, HookCoordinator, Side
from overlap_runtime.ops.comm import CommTimeoutError


def _stuck_then_fail(stuck_s: float) -> None:
    time.sleep(stuck_s)  # e.g. a bounded receive from a peer that never answers
    raise CommTimeoutError("2RECV_B0 (recv from group rank 1): not complete after 0.9s")


def test_a_token_timeout_yields_to_the_token_holders_own_failure() -> None:
    coord = HookCoordinator(timeout_s=0.5)
    with CommComputeOverlap(coord, join_timeout_s=10) as ov:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            # the forward's first comm hook waits for the token, which the backward holds from
            # the start of the run while it is stuck; the forward's wait runs out first
            ov.run(lambda: coord.hook(Side.FORWARD, "A", 0), lambda: _stuck_then_fail(0.9))
        assert time.monotonic() - t0 < 5
        fwd = ov.last_errors["forward"]
        assert isinstance(fwd, CoordinatorTimeout) and "comm token" in str(fwd)
        notes = "\n".join(info.value.__notes__)
        assert "raised in the backward thread" in notes
        assert "the forward thread also raised CoordinatorTimeout" in notes


def test_the_first_coordinator_timeout_stays_primary_when_the_other_side_only_timed_out() -> None:
    coord = HookCoordinator(timeout_s=0.5)

    def backward() -> None:
        time.sleep(0.9)
        coord.hook(Side.BACKWARD, "D_LAST", 1)  # raises the forward's timeout here

    with CommComputeOverlap(coord, join_timeout_s=10) as ov:
        with pytest.raises(CoordinatorTimeout) as info:
            ov.run(lambda: coord.hook(Side.FORWARD, "A", 0), backward)
        assert info.value is ov.last_errors["forward"]
