"""Deadlock regression suite: every scenario ends in success or a clear error, never a hang.

Each scenario pairs a forward chunk (run by the caller) with the backward of an earlier chunk
(run by the worker) through CommComputeOverlap, plants a failure or a stall, and asserts what is
raised, in which thread, and that it came well before the test's own pytest timeout. Elapsed-time
bounds prove that failures wake the peer at once instead of letting it run into its timeout.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import overlap_runtime.coordinator.overlap as overlap_mod
from tests.support.coordinator_toy import Inject, Injected, chunk, layer, make_input, make_weights
from overlap_runtime.coordinator import (
    CommComputeOverlap,
    CoordinatorAborted,
    CoordinatorProtocolError,
    CoordinatorTimeout,
    HookCoordinator,
)
from overlap_runtime.schedules.overlap_order import comm_turns

pytestmark = pytest.mark.timeout(30)

FAIL_TIMEOUT_S = 5.0  # coordinator timeout in failure scenarios: a failure must beat it by far


def _pair(coord: HookCoordinator, ov: CommComputeOverlap, n_fwd: int = 2, n_bwd: int = 2,
          inj: Inject | None = None, mb: int = 1):
    """Build microbatch mb-1's graph outside the run, then overlap fwd(mb) with bwd(mb-1)."""
    w_f, w_b = make_weights(n_fwd, seed=1), make_weights(n_bwd, seed=2)
    bwd_inj = inj if inj is not None and inj.direction == "backward" else None
    fwd_inj = inj if inj is not None and inj.direction == "forward" else None
    loss_prev = chunk(make_input(mb - 1), w_b, coord, bwd_inj).square().sum()
    x = make_input(mb)
    return ov.run(lambda: chunk(x, w_f, coord, fwd_inj), lambda: loss_prev.backward())


def _clean_pair_works(coord: HookCoordinator, ov: CommComputeOverlap) -> None:
    out, _ = _pair(coord, ov)
    assert out.shape == (4, 8)
    assert coord.failure is None


SCENARIOS = [Inject(d, letter, when, layer=1 if d == "backward" else 0)
             for d in ("forward", "backward") for letter in "ABCD" for when in ("before", "after")]


@pytest.mark.parametrize("inj", SCENARIOS, ids=lambda i: f"{i.direction}-{i.when}-{i.letter}")
def test_exception_around_each_hook_stops_both_threads(inj: Inject) -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord) as ov:
        t0 = time.monotonic()
        with pytest.raises(Injected) as info:
            _pair(coord, ov, inj=inj)
        elapsed = time.monotonic() - t0
        assert elapsed < FAIL_TIMEOUT_S / 2, f"took {elapsed:.2f}s: the peer was not woken"
        err = info.value
        side = inj.direction
        assert any(f"raised in the {side} thread" in n for n in err.__notes__)
        frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
        assert "raise_injected" in frames  # the original traceback, not a re-wrapped one
        assert ov.last_errors[side] is err
        # Each chunk has two layers and the failure is planted in the first layer its side runs,
        # so the peer always has hooks left: it must be stopped at one of them, not finish.
        peer = "backward" if side == "forward" else "forward"
        peer_err = ov.last_errors.get(peer)
        assert isinstance(peer_err, CoordinatorAborted), \
            f"the {peer} side was not aborted: {peer_err!r}"
        assert peer_err.cause is err and f"{side} thread failed" in str(peer_err)
        assert peer_err.site.side == peer and peer_err.site.seq > 0
        assert peer_err.site.letter in ("A", "B", "C", "D", "D_LAST"), peer_err.site
        # reuse after a failure: the same coordinator and worker run a clean pair
        _clean_pair_works(coord, ov)


def test_forward_failure_before_first_hook_aborts_waiting_backward() -> None:
    """The backward hands over at C and waits for the forward's A, which never comes."""
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord) as ov:
        with pytest.raises(Injected):
            _pair(coord, ov, inj=Inject("forward", "A", "before"))
        aborted = ov.last_errors["backward"]
        assert isinstance(aborted, CoordinatorAborted)
        assert aborted.site.letter in ("D_LAST", "C") and aborted.site.layer == 1
        assert aborted.site.thread == ov.worker_thread.name


def test_backward_stalled_past_timeout_both_raise_timeout() -> None:
    coord = HookCoordinator(timeout_s=0.5)
    with CommComputeOverlap(coord, join_timeout_s=10) as ov:
        t0 = time.monotonic()
        with pytest.raises(CoordinatorTimeout) as info:
            _pair(coord, ov, inj=Inject("backward", "D", "before", layer=1, stall_s=1.5))
        assert time.monotonic() - t0 < 5
        fwd, bwd = info.value, ov.last_errors["backward"]
        assert ov.last_errors["forward"] is fwd
        # the forward waited at A for the comm token the stalled backward still held
        assert (fwd.site.side, fwd.letter, fwd.layer) == ("forward", "A", 0)
        assert fwd.thread == threading.current_thread().name and fwd.seq > 0
        assert "comm token" in str(fwd) and "last events" in str(fwd)
        assert any("arrive" in str(e) for e in fwd.events)
        assert isinstance(bwd, CoordinatorTimeout)
        assert (bwd.site.side, bwd.letter, bwd.layer) == ("backward", "D_LAST", 1)
        assert bwd.origin == fwd.site and "forward thread timed out" in str(bwd)
        _clean_pair_works(coord, ov)


def test_forward_stalled_past_timeout_backward_times_out_first() -> None:
    coord = HookCoordinator(timeout_s=0.5)
    with CommComputeOverlap(coord, join_timeout_s=10) as ov:
        with pytest.raises(CoordinatorTimeout) as info:
            _pair(coord, ov, inj=Inject("forward", "B", "before", stall_s=1.5))
        primary = info.value
        assert primary.site.side == "backward" and primary.thread == ov.worker_thread.name
        assert any("raised in the backward thread" in n for n in primary.__notes__)
        fwd = ov.last_errors["forward"]
        assert isinstance(fwd, CoordinatorTimeout) and fwd.letter == "B"
        _clean_pair_works(coord, ov)


def test_abandoned_backward_stops_at_its_next_hook() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord, join_timeout_s=0.3) as ov:
        w = make_weights(1)
        loss_prev = chunk(make_input(0), w, coord).sum()
        caught: list[BaseException] = []

        def stalled_then_hooks() -> None:
            time.sleep(0.8)  # before its first hook; the forward has long finished
            try:
                loss_prev.backward()
            except CoordinatorTimeout as e:
                caught.append(e)
                raise

        with pytest.raises(CoordinatorTimeout, match="to finish run"):
            ov.run(lambda: None, stalled_then_hooks)
        deadline = time.monotonic() + 5
        while not caught and time.monotonic() < deadline:
            time.sleep(0.05)
        assert caught and caught[0].site.side == "backward" and caught[0].letter == "D_LAST"
        time.sleep(0.1)
        _clean_pair_works(coord, ov)


def test_backward_stalled_past_join_timeout_then_recovers() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord, join_timeout_s=0.3) as ov:
        w = make_weights(1)
        loss_prev = chunk(make_input(0), w, coord).sum()

        def slow_backward() -> None:
            loss_prev.backward()
            time.sleep(1.2)  # after its last hook: nothing to wake it

        with pytest.raises(CoordinatorTimeout, match="to finish run"):
            ov.run(lambda: chunk(make_input(1), w, coord), slow_backward)
        with pytest.raises(CoordinatorTimeout, match="still executing"):
            ov.run(lambda: None, lambda: None)  # the worker is still busy: bounded, clear
        time.sleep(1.2)
        _clean_pair_works(coord, ov)


@pytest.mark.parametrize("n_fwd,n_bwd", [(2, 3), (3, 1), (0, 2), (2, 0)])
def test_mismatched_hook_counts_drain(n_fwd: int, n_bwd: int) -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S, debug=True)
    with CommComputeOverlap(coord) as ov:
        _pair(coord, ov, n_fwd=n_fwd, n_bwd=n_bwd)
        sides = [s for s, _, _ in coord.comm_order(coord.run_id)]
        # two comm regions per layer on each side, in the turns of the one launch-order rule
        assert sides == [s for s, _ in comm_turns(2 * n_bwd, 2 * n_fwd)]


def test_d_last_forward_only_hands_over() -> None:
    """With D_LAST the forward returns without waiting for the backward's next COMM hook."""
    for letter_is_last, expect_forward_first in ((True, True), (False, False)):
        coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
        with CommComputeOverlap(coord) as ov:
            w = make_weights(1)
            loss_prev = chunk(make_input(0), w, coord).sum()
            stamps: dict[str, float] = {}

            def fwd() -> None:
                chunk(make_input(1), w, coord, d_last=letter_is_last)
                stamps["fwd_done"] = time.monotonic()

            def bwd() -> None:
                loss_prev.backward()
                time.sleep(0.4)  # compute after the backward's last hook (A)
                stamps["bwd_done"] = time.monotonic()

            ov.run(fwd, bwd)
            assert (stamps["fwd_done"] < stamps["bwd_done"]) is expect_forward_first


def test_d_last_backward_never_waits_at_chunk_start() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S, debug=True)
    with CommComputeOverlap(coord) as ov:
        w = make_weights(1)
        loss_prev = chunk(make_input(0), w, coord).sum()
        def fwd() -> torch.Tensor:
            time.sleep(0.4)  # a slow attention before A
            return chunk(make_input(1), w, coord)

        t0 = time.monotonic()
        ov.run(fwd, loss_prev.backward)
        acquire = [e for e in coord.trace() if e.action == "acquire"]
        assert (acquire[0].side, acquire[0].letter) == ("backward", "D_LAST")
        arrive_fwd = [e for e in coord.trace() if e.side == "forward" and e.action == "arrive"]
        assert acquire[0].seq < arrive_fwd[0].seq  # before the forward even reached A
        assert time.monotonic() - t0 < 3


def test_back_to_back_runs() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S, debug=True)
    w = make_weights(2)
    with CommComputeOverlap(coord) as ov:
        loss_prev = chunk(make_input(0), w, coord).square().sum()
        for mb in range(1, 101):
            x = make_input(mb)
            out, _ = ov.run(lambda: chunk(x, w, coord), loss_prev.backward)
            loss_prev = out.square().sum()
            sides = [s for s, _, _ in coord.comm_order(coord.run_id)]
            assert sides == [s for s, _ in comm_turns(4, 4)]
        assert coord.run_id == 100 and ov.runs == 100


def test_disable_in_the_middle_of_a_run_releases_waiters() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord) as ov:
        w = make_weights(2)
        loss_prev = chunk(make_input(0), w, coord).sum()

        def stalled_backward() -> None:
            time.sleep(1.5)  # the forward waits at A for the token meanwhile
            loss_prev.backward()

        timer = threading.Timer(0.2, coord.disable)
        timer.start()
        t0 = time.monotonic()
        out, _ = ov.run(lambda: (chunk(make_input(1), w, coord), time.monotonic())[1],
                        stalled_backward)
        timer.join(5)
        assert out - t0 < 1.0  # the forward went on when disabled, not after the stall
        assert not coord.enabled
        coord.enable()
        _clean_pair_works(coord, ov)


def test_protocol_error_out_of_order_letters_is_loud() -> None:
    from overlap_runtime.coordinator import sync_hook

    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord) as ov:
        w = make_weights(1)
        loss_prev = chunk(make_input(0), w, coord).sum()

        def bad_forward() -> None:
            x = make_input(1)
            x = sync_hook(x, "A", coord, 0)
            sync_hook(x, "C", coord, 0)  # B is missing

        t0 = time.monotonic()
        expected = r"hook C out of order.*expected one of \['B'\]"
        with pytest.raises(CoordinatorProtocolError, match=expected):
            ov.run(bad_forward, loss_prev.backward)
        assert time.monotonic() - t0 < FAIL_TIMEOUT_S / 2
        _clean_pair_works(coord, ov)


def test_worker_thread_sets_its_device_before_every_job(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    real = overlap_mod.set_device

    def recording_set_device(device):  # calls through: the real set_device runs
        calls.append((threading.current_thread().name, str(device)))
        return real(device)

    monkeypatch.setattr(overlap_mod, "set_device", recording_set_device)
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord, "cpu") as ov:
        seen: list[str] = []
        for _ in range(3):
            ov.run(lambda: None, lambda: seen.append(threading.current_thread().name))
        worker = ov.worker_thread.name
        assert seen == [worker] * 3 and worker != threading.current_thread().name
        assert calls == [(worker, "cpu")] * 3
        assert ov.worker_device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices: with one, the worker's device is the caller's "
                           "and the test could not fail (the fake-CUDA test below covers CPU)")
def test_worker_thread_current_cuda_device() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord, "cuda:1") as ov:
        torch.cuda.set_device(0)
        seen = ov.run(torch.cuda.current_device, torch.cuda.current_device)
        # a new thread starts on device 0: only the worker's own set_device makes it 1
        assert seen == (0, 1)


def test_worker_thread_current_device_with_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check on a CPU machine: platform sees two fake CUDA devices whose current index is
    kept per thread (as torch does), so the real ``platform.set_device`` path runs and the
    worker's current device is what it set, while the caller's stays its own."""
    import overlap_runtime.platform as platform

    current = threading.local()
    monkeypatch.setattr(platform, "available_kinds", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(platform, "_device_count", lambda kind: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(
        current, "index", d if isinstance(d, int) else torch.device(d).index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord, "cuda:1") as ov:
        torch.cuda.set_device(0)
        for _ in range(2):
            seen = ov.run(torch.cuda.current_device, torch.cuda.current_device)
            assert seen == (0, 1)
        assert ov.worker_device == torch.device("cuda", 1)


def test_worker_device_error_is_reraised_from_backward_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_set_device(device):
        raise RuntimeError(f"cannot make {device} current")

    monkeypatch.setattr(overlap_mod, "set_device", broken_set_device)
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    with CommComputeOverlap(coord) as ov:
        w = make_weights(1)
        with pytest.raises(RuntimeError, match="cannot make cpu current") as info:
            ov.run(lambda: chunk(make_input(1), w, coord), lambda: None)
        assert any("backward thread" in n for n in info.value.__notes__)
        assert isinstance(ov.last_errors.get("forward"), (type(None), CoordinatorAborted))


def _checkpointed_chunk(x, weights, coord, reentrant: bool):
    n = len(weights)
    for i, (wa, we) in enumerate(weights):
        x = checkpoint(layer, x, wa, we, coord, i, i == n - 1, use_reentrant=reentrant)
    return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recompute_replay_bypasses_pairing_and_matches_serial(reentrant: bool) -> None:
    n_mb = 6

    def train(coord: HookCoordinator, overlapped: bool):
        w = make_weights(2, seed=7)
        outs = []
        with CommComputeOverlap(coord) as ov:
            loss_prev = None
            for mb in range(n_mb + 1):
                x = make_input(mb, seed=3) if mb < n_mb else None
                fwd = (lambda x=x: _checkpointed_chunk(x, w, coord, reentrant)) if x is not None \
                    else (lambda: None)
                bwd = loss_prev.backward if loss_prev is not None else (lambda: None)
                out, _ = ov.run(fwd, bwd) if overlapped else (fwd(), bwd())
                if out is not None:
                    outs.append(out.detach())
                    loss_prev = out.square().sum()
        return outs, [t.grad for pair in w for t in pair]

    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S, debug=True)
    outs, grads = train(coord, overlapped=True)
    ref_outs, ref_grads = train(HookCoordinator(timeout_s=FAIL_TIMEOUT_S), overlapped=False)
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    replays = [e for e in coord.trace() if e.action.startswith("replay")]
    assert replays and {e.side for e in replays} == {"backward"}
    for run in range(2, n_mb + 1):  # runs with both a forward and a backward chunk
        order = coord.comm_order(run)
        sides = [s for s, _, _ in order]
        real_bwd = [s for s, letter, _ in order if s == "backward" and ":" not in letter]
        assert len(real_bwd) == 4 and sides.count("forward") == 4
        # replays take turns of their own: strict alternation while both sides run
        assert sides[:8] == [s for s, _ in comm_turns(4, 4)] and set(sides[8:]) == {"backward"}, \
            order
        assert any(letter.startswith("replay:") for _, letter, _ in order)


def test_no_thread_leak_after_1000_runs() -> None:
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    w = make_weights(1, dim=4)
    with CommComputeOverlap(coord) as ov:
        ov.run(lambda: None, lambda: None)
        baseline = threading.active_count()
        loss_prev = chunk(make_input(0, dim=4), w, coord).sum()
        for mb in range(1, 1001):
            x = make_input(mb, dim=4)
            out, _ = ov.run(lambda: chunk(x, w, coord), loss_prev.backward)
            loss_prev = out.sum()
            if mb % 250 == 0:
                assert threading.active_count() == baseline
        assert threading.active_count() == baseline
    assert threading.active_count() == baseline - 1  # close() joined the worker


def test_overlaps_closed_or_dropped_leave_no_threads() -> None:
    before = threading.active_count()
    for _ in range(20):
        with CommComputeOverlap(HookCoordinator(timeout_s=FAIL_TIMEOUT_S)) as ov:
            ov.run(lambda: None, lambda: None)
    assert threading.active_count() == before
    ov = CommComputeOverlap(HookCoordinator(timeout_s=FAIL_TIMEOUT_S))
    ov.run(lambda: None, lambda: None)
    worker = ov.worker_thread
    del ov
    gc.collect()
    worker.join(3.0)  # the finalizer told it to stop; it exits at its next bounded wait
    assert not worker.is_alive()
    assert threading.active_count() == before


def _failing_step(coord: HookCoordinator) -> None:
    """A training step that makes an overlap, fails in its forward chunk and never closes it."""
    overlap = CommComputeOverlap(coord)
    w = make_weights(1, dim=4)
    loss_prev = chunk(make_input(0, dim=4), w, coord).sum()
    overlap.run(lambda: chunk(make_input(1, dim=4), w, coord,
                              Inject("forward", "B", "before")), loss_prev.backward)


def _threads_after(baseline: int, seconds: float) -> int:
    """Thread count once it is back to ``baseline`` or ``seconds`` have passed (GC allowed)."""
    deadline = time.monotonic() + seconds
    while threading.active_count() > baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return threading.active_count()


@pytest.mark.parametrize("shared", [False, True], ids=["own-coordinator", "shared-coordinator"])
def test_failed_overlaps_dropped_without_close_leave_no_threads(shared: bool) -> None:
    """50 steps whose forward fails, each dropping its overlap unclosed: no worker survives."""
    gc.collect()
    baseline = threading.active_count()
    coord = HookCoordinator(timeout_s=FAIL_TIMEOUT_S)
    for _ in range(50):
        with pytest.raises(Injected):
            _failing_step(coord if shared else HookCoordinator(timeout_s=FAIL_TIMEOUT_S))
    # a dropped overlap's worker exits at its next bounded idle wait (1 s)
    left = _threads_after(baseline, seconds=5.0)
    assert left == baseline, f"{left - baseline} worker threads outlived their dropped overlaps"
