"""Real all-to-alls on 2 and 4 gloo ranks inside overlapped forward/backward chunk pairs.

Each rank trains a toy 2-layer MoE-shaped chunk (A, dispatch all-to-all, B, expert matmul, C,
combine all-to-all, D/D_LAST) over 51 microbatches: first serially (coordinator disabled), then
overlapped (forward of microbatch k+1 in the caller with backward of microbatch k in the worker:
50 pairs). Asserts: outputs and gradients of the overlapped run equal the serial run
(rel-L2 <= 1e-6), every rank launched the same all-to-alls in the same order (checked in-band by
CommSerializer.check_launch_order and again here), and each pair interleaved the two threads'
all-to-alls in the order the coordinator's state machine prescribes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.support.coordinator_toy import layer, make_input, make_weights
from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
from overlap_runtime.schedules.overlap_order import comm_turns
from overlap_runtime.testing import rel_l2, run_ranks

pytestmark = pytest.mark.timeout(120)

TOL = 1e-6

# The launch order of one pair (2-layer forward chunk with 2-layer backward chunk): each side's
# comm regions in its program order, interleaved by the one launch-order rule (comm_turns:
# backward first, then alternating; tests/schedules/test_overlap_order.py writes it out).
_REGIONS = {"backward": ["L1.combine", "L1.dispatch", "L0.combine", "L0.dispatch"],
            "forward": ["L0.dispatch", "L0.combine", "L1.dispatch", "L1.combine"]}
PAIR_ORDER = [(_REGIONS[side][k], side) for side, k in comm_turns(4, 4)]


def _chunk(x, weights, coord, comm, ckpt: str):
    n = len(weights)
    for i, (wa, we) in enumerate(weights):
        f = functools.partial(layer, coord=coord, idx=i, last=i == n - 1, inj=None, comm=comm)
        if ckpt == "none":
            x = f(x, wa, we)
        else:
            x = checkpoint(f, x, wa, we, use_reentrant=ckpt == "reentrant")
    return x


def _train(rank: int, world: int, n_mb: int, overlapped: bool, ckpt: str):
    coord = HookCoordinator(timeout_s=60, debug=True)
    if not overlapped:
        coord.disable()

    def comm(t: torch.Tensor, tag: str) -> torch.Tensor:
        return coord.serializer.all_to_all_single(t, tag=tag)

    weights = make_weights(2, seed=100 + rank)
    outs = []
    with CommComputeOverlap(coord) as ov:
        loss_prev = None
        for mb in range(n_mb + 1):
            x = make_input(mb, rows=2 * world, seed=rank + 1) if mb < n_mb else None
            fwd = ((lambda x=x: _chunk(x, weights, coord, comm, ckpt)) if x is not None
                   else (lambda: None))
            bwd = loss_prev.backward if loss_prev is not None else (lambda: None)
            out, _ = ov.run(fwd, bwd)
            if out is not None:
                outs.append(out.detach())
                loss_prev = (out * out).sum()
    grads = [t.grad for pair in weights for t in pair]
    checked = coord.serializer.check_launch_order() if overlapped else -1
    log = [r.key() for r in coord.serializer.launch_log()]
    return outs, grads, log, checked


def _rank_main(rank: int, world: int, n_mb: int, ckpt: str):
    torch.set_num_threads(1)
    ref_outs, ref_grads, _, _ = _train(rank, world, n_mb, overlapped=False, ckpt=ckpt)
    outs, grads, log, checked = _train(rank, world, n_mb, overlapped=True, ckpt=ckpt)
    errs = [rel_l2(a, b) for a, b in zip(outs + grads, ref_outs + ref_grads)]
    assert len(errs) == n_mb + 4
    return max(errs), log, checked


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_pairs_match_serial_and_launch_order_is_identical(world: int) -> None:
    n_mb = 51  # 50 overlapped forward/backward pairs
    results = run_ranks(_rank_main, world, timeout_s=110, args=(n_mb, "none"))
    logs = [log for _, log, _ in results]
    for rank, (err, log, checked) in enumerate(results):
        assert err <= TOL, f"rank {rank}: rel-L2 {err:.2e}"
        assert checked == len(log) == 8 * n_mb
        assert log == logs[0], f"rank {rank} launched in another order"
    log = logs[0]
    # run 1: forward of microbatch 0 alone; runs 2..51: pairs; run 52: last backward alone
    for p in range(n_mb - 1):
        start = 4 + 8 * p
        assert log[start:start + 8] == PAIR_ORDER, f"pair {p}: {log[start:start + 8]}"


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_overlap_with_activation_checkpointing_on_real_ranks(ckpt: str) -> None:
    n_mb = 11
    results = run_ranks(_rank_main, 2, timeout_s=110, args=(n_mb, ckpt))
    logs = [log for _, log, _ in results]
    for rank, (err, log, checked) in enumerate(results):
        assert err <= TOL, f"rank {rank}: rel-L2 {err:.2e}"
        assert checked == len(log) and log == logs[0]
    replayed = [k for k in logs[0] if k[1] == "forward"]
    assert len(replayed) > 4 * n_mb  # the recompute re-launched forward all-to-alls
