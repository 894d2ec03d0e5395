"""sync_hook and the coordinator's role tables, validation and bypass rules (one thread)."""

from __future__ import annotations

import pytest
import torch

from tests.support.coordinator_toy import chunk, make_input, make_weights
from overlap_runtime.coordinator import (
    CommComputeOverlap,
    CoordinatorProtocolError,
    HookCoordinator,
    Side,
    sync_hook,
)
from overlap_runtime.coordinator.coordinator import BACKWARD_ROLES, FORWARD_ROLES, Role

pytestmark = pytest.mark.timeout(30)


def test_role_tables_follow_the_seed() -> None:
    C, P = Role.COMM, Role.COMPUTE
    assert dict(FORWARD_ROLES) == {"A": C, "B": P, "C": C, "D": P, "D_LAST": P}
    assert dict(BACKWARD_ROLES) == {"D": C, "D_LAST": C, "C": P, "B": C, "A": P}
    with pytest.raises(TypeError):
        FORWARD_ROLES["A"] = P  # type: ignore[index]


@pytest.mark.parametrize("letter", ["A", "B", "C", "D", "D_LAST"])
def test_sync_hook_is_identity_on_values_and_gradients(letter: str) -> None:
    coord = HookCoordinator(timeout_s=1.0)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = sync_hook(x, letter, coord, 2)
    assert torch.equal(y, x) and y.dtype == x.dtype
    g = torch.randn(3, 5, dtype=torch.float64)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)
    assert sync_hook(x, letter, None, 0) is x


def test_sync_hook_rejects_bad_arguments() -> None:
    coord = HookCoordinator(timeout_s=1.0)
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="'E' is not one of"):
        sync_hook(x, "E", coord, 0)
    with pytest.raises(ValueError, match="non-negative int"):
        sync_hook(x, "A", coord, -1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        HookCoordinator(timeout_s=0)


def test_hooks_are_identities_outside_a_run_and_when_disabled() -> None:
    coord = HookCoordinator(timeout_s=0.2, debug=True)
    w = make_weights(2)
    out = chunk(make_input(0), w, coord)  # no run: nothing to pair with, nothing waits
    out.sum().backward()
    coord.disable()
    with CommComputeOverlap(coord) as ov:
        import threading
        fwd, bwd = ov.run(lambda: threading.get_ident(), lambda: threading.get_ident())
        assert fwd == bwd == threading.get_ident()  # disabled: the serial baseline, in the caller
        assert ov.worker_thread is None
    assert [e.action for e in coord.trace()] == ["disable"]


def test_backward_hook_in_the_forward_thread_is_misuse() -> None:
    coord = HookCoordinator(timeout_s=2.0)
    w = make_weights(1)
    with CommComputeOverlap(coord) as ov:
        def fwd_with_backward() -> None:
            chunk(make_input(0), w, coord).sum().backward()

        with pytest.raises(CoordinatorProtocolError, match="backward hook ran in the forward"):
            ov.run(fwd_with_backward, lambda: None)


def test_start_run_twice_is_misuse_and_run_after_close_too() -> None:
    coord = HookCoordinator(timeout_s=1.0)
    coord.start_run()
    with pytest.raises(CoordinatorProtocolError, match="still active"):
        coord.start_run()
    coord.end_run()
    ov = CommComputeOverlap(coord)
    ov.close()
    with pytest.raises(CoordinatorProtocolError, match="after close"):
        ov.run(lambda: None, lambda: None)


def test_ring_buffer_is_bounded() -> None:
    coord = HookCoordinator(timeout_s=1.0, events_kept=5)
    w = make_weights(2)
    with CommComputeOverlap(coord) as ov:
        loss = chunk(make_input(0), w, coord).sum()
        ov.run(lambda: chunk(make_input(1), w, coord), loss.backward)
    events = coord.recent_events()
    assert len(events) == 5 and events[-1].action == "end-run"


def test_a_failed_run_does_not_poison_later_serial_use() -> None:
    coord = HookCoordinator(timeout_s=1.0)
    coord.start_run()
    coord.fail(Side.FORWARD, RuntimeError("boom"))
    coord.end_run()
    # outside a run the recorded failure stops nobody: hooks and the serializer's lock wait
    w = make_weights(1)
    chunk(make_input(0), w, coord).sum().backward()
    site = coord.current_site()
    with coord.condition:
        coord.raise_if_failed(site)
