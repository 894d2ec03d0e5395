"""Differentiable collectives on real gloo ranks against a single-process computation.

Every rank builds every rank's input from a seed, so it can compute the single-process result of
the whole function (forward and gradients through torch autograd on the full data) and compare
its own part with what the collective produced.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from overlap_runtime.ops import comm
from overlap_runtime.testing import rel_l2, run_ranks

TOL = 1e-6  # fp32 moves and sums of at most 8 terms


def _x(rank: int, rows: int, cols: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(rows, cols, generator=g)


def _weight(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + rank)
    return torch.randn(*shape, generator=g)


def _split_matrix(world: int, pattern: str) -> list[list[int]]:
    """splits[src][dst] rows sent from src to dst."""
    if pattern == "equal":
        return [[2] * world for _ in range(world)]
    if pattern == "uneven":
        return [[(src * 3 + dst) % 4 for dst in range(world)] for src in range(world)]
    if pattern == "zeros":  # rank 0 receives nothing; last rank sends nothing
        return [[0 if dst == 0 or src == world - 1 else src + dst for dst in range(world)]
                for src in range(world)]
    raise ValueError(pattern)


def _a2a_reference(world: int, splits: list[list[int]], me: int):
    xs = [_x(r, sum(splits[r])).requires_grad_(True) for r in range(world)]
    outs = []
    for dst in range(world):
        pieces = []
        for src in range(world):
            start = sum(splits[src][:dst])
            pieces.append(xs[src][start:start + splits[src][dst]])
        outs.append(torch.cat(pieces))
    loss = sum((o * _weight(dst, tuple(o.shape))).sum() for dst, o in enumerate(outs))
    loss.backward()
    return outs[me].detach(), xs[me].grad


def _a2a_worker(rank: int, world: int, pattern: str, async_op: bool) -> float:
    splits = _split_matrix(world, pattern)
    in_splits = splits[rank]
    out_splits = [splits[src][rank] for src in range(world)]
    x = _x(rank, sum(in_splits)).requires_grad_(True)
    if async_op:
        handle, out = comm.all_to_all_single(x, out_splits, in_splits, async_op=True)
        # Overlap: unrelated work while the all-to-all is in flight.
        busy = torch.randn(64, 64) @ torch.randn(64, 64)
        handle.wait()
        handle.wait()  # idempotent
        assert handle.completed and busy.shape == (64, 64)
    else:
        out = comm.all_to_all_single(x, out_splits, in_splits)
    (out * _weight(rank, tuple(out.shape))).sum().backward()
    ref_out, ref_grad = _a2a_reference(world, splits, rank)
    assert out.shape == ref_out.shape, (out.shape, ref_out.shape)
    err = max(rel_l2(out.detach(), ref_out), rel_l2(x.grad, ref_grad))
    assert err <= TOL, f"rank {rank}: rel-L2 {err}"
    return err


@pytest.mark.parametrize(
    "world,pattern",
    [(2, "equal"), (2, "uneven"), (2, "zeros"), (4, "equal"), (4, "uneven"), (4, "zeros"),
     (8, "uneven")],
)
def test_all_to_all_matches_single_process(world: int, pattern: str) -> None:
    errs = run_ranks(_a2a_worker, world, args=(pattern, False))
    assert max(errs) <= TOL


@pytest.mark.parametrize("world", [2, 4])
def test_async_all_to_all_overlapped_equals_sync(world: int) -> None:
    errs = run_ranks(_a2a_worker, world, args=("uneven", True))
    assert max(errs) <= TOL


def _a2a_unwaited_worker(rank: int, world: int) -> str:
    x = _x(rank, 2 * world).requires_grad_(True)
    handle, out = comm.all_to_all_single(x, async_op=True)
    try:
        out.sum().backward()
    except RuntimeError as exc:
        handle.wait()
        return str(exc)
    return "no error"


def test_backward_before_wait_is_loud() -> None:
    msgs = run_ranks(_a2a_unwaited_worker, 2)
    assert all("never waited" in m for m in msgs), msgs


def _bad_input_worker(rank: int, world: int) -> list[str]:
    x = torch.zeros(5, 2)
    msgs = []
    cases = [
        lambda: comm.all_to_all_single(x, [2, 2], [2, 2]),  # input splits sum 4 != 5
        lambda: comm.all_to_all_single(x, [3, 2], [6, -1]),  # negative
        lambda: comm.all_to_all_single(x, [5], [5]),  # wrong count
        lambda: comm.all_to_all_single(x, [3, 2], None),  # one of two
        lambda: comm.all_to_all_single(torch.zeros(4, 2, device="meta"), [2, 2], [2, 2]),  # device
        lambda: comm.halo_exchange(x.view(1, 5, 2), 6, dim=1),  # wider than the shard
        lambda: comm.halo_exchange(x.view(1, 5, 2), -1, dim=1),
        lambda: comm.all_gather(x, dim=3),
        lambda: comm.recv_prev((2, -3), torch.float32),
        lambda: comm.AsyncHandle([], "x", timeout_s=0),
    ]
    for case in cases:
        try:
            case()
        except ValueError as exc:
            msgs.append(str(exc))
        else:
            msgs.append("NO ERROR")
    return msgs


def test_bad_inputs_raise_value_error_naming_values() -> None:
    msgs = run_ranks(_bad_input_worker, 2)[0]
    assert "NO ERROR" not in msgs, msgs
    assert "sums to 4" in msgs[0] and "is 5" in msgs[0]
    assert "negative" in msgs[1]
    assert "1 entries" in msgs[2] and "group size 2" in msgs[2]
    assert "both" in msgs[3]
    assert "meta" in msgs[4] and "gloo" in msgs[4]
    assert "width 6" in msgs[5] and "[0, 5]" in msgs[5]
    assert "width -1" in msgs[6]
    assert "dim 3" in msgs[7]
    assert "negative" in msgs[8]
    assert "timeout_s" in msgs[9]


# --------------------------------------------------------------------------- halo


def _halo_worker(rank: int, world: int, width: int) -> float:
    B, S, C = 2, 5, 3
    shards = [_x(r, B * S, C).view(B, S, C).requires_grad_(True) for r in range(world)]
    # single process: halo_r = shard_{r-1}[:, -w:], zeros for rank 0
    halos = [torch.zeros(B, width, C)] + [s[:, S - width:] for s in shards[:-1]]
    loss = sum((h * _weight(r, (B, width, C))).sum() for r, h in enumerate(halos))
    loss.backward()
    x = _x(rank, B * S, C).view(B, S, C).requires_grad_(True)
    halo = comm.halo_exchange(x, width, dim=1)
    (halo * _weight(rank, (B, width, C))).sum().backward()
    err_f = rel_l2(halo.detach(), halos[rank].detach()) if rank > 0 else halo.abs().sum().item()
    err_b = rel_l2(x.grad, shards[rank].grad) if rank < world - 1 else x.grad.abs().sum().item()
    assert err_f <= TOL and err_b <= TOL, (rank, err_f, err_b)
    return max(err_f, err_b)


@pytest.mark.parametrize("world,width", [(2, 3), (4, 1), (4, 5), (8, 2), (4, 0)])
def test_halo_exchange_matches_single_process(world: int, width: int) -> None:
    errs = run_ranks(_halo_worker, world, args=(width,))
    assert max(errs) <= TOL


# --------------------------------------------------------------------------- state chain


def _chain_step(h_in: torch.Tensor | None, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's segment: h_out = tanh(a * h_in + x), local output y = h_in * x (uses h_in)."""
    h0 = torch.zeros_like(x) if h_in is None else h_in
    h_out = torch.tanh(a * h0 + x)
    y = (h0 + 1.0) * x
    return h_out, y


def _chain_worker(rank: int, world: int, use_pending: bool) -> float:
    shape = (2, 4)
    xs = [_x(r, 2, 4).requires_grad_(True) for r in range(world)]
    a = torch.full(shape, 0.7)
    # single process
    h = None
    total = 0.0
    for r in range(world):
        h, y = _chain_step(h, xs[r], a)
        total = total + (y * _weight(r, shape)).sum() + (h * _weight(100 + r, shape)).sum()
    total.backward()
    # distributed
    pending: list[comm.AsyncHandle] = []
    x = _x(rank, 2, 4).requires_grad_(True)
    h_in = comm.recv_prev(shape, torch.float32, pending=pending if use_pending else None)
    h_out, y = _chain_step(h_in, x, a)
    handle, token = comm.send_next(h_out)
    local = (y * _weight(rank, shape)).sum() + (h_out * _weight(100 + rank, shape)).sum()
    local = comm.attach(local, token)
    local.backward()
    handle.wait()
    for p in pending:
        p.wait()
    err = rel_l2(x.grad, xs[rank].grad)
    assert err <= TOL, (rank, err)
    return err


@pytest.mark.parametrize("world", [2, 4, 8])
def test_state_chain_matches_sequential(world: int) -> None:
    errs = run_ranks(_chain_worker, world, args=(world == 4,))
    assert max(errs) <= TOL


# --------------------------------------------------------------------------- all-gather


def _gather_worker(rank: int, world: int, dim: int) -> float:
    shape = (2, 3, 4)
    xs = [_x(r, 6, 4).view(shape).requires_grad_(True) for r in range(world)]
    full = torch.cat(xs, dim=dim)
    # every rank uses the gathered tensor with its own weight
    loss = sum((full * _weight(r, tuple(full.shape))).sum() for r in range(world))
    loss.backward()
    x = _x(rank, 6, 4).view(shape).requires_grad_(True)
    out = comm.all_gather(x, dim=dim)
    (out * _weight(rank, tuple(out.shape))).sum().backward()
    err = max(rel_l2(out.detach(), full.detach()), rel_l2(x.grad, xs[rank].grad))
    assert err <= TOL, (rank, err)
    return err


@pytest.mark.parametrize("world,dim", [(2, 0), (4, 1), (8, 2)])
def test_all_gather_matches_single_process(world: int, dim: int) -> None:
    errs = run_ranks(_gather_worker, world, args=(dim,))
    assert max(errs) <= TOL


# --------------------------------------------------------------------------- timeouts


def _late_peer_worker(rank: int, world: int) -> str:
    if rank == 1:
        time.sleep(3.0)  # never joins the all-to-all within rank 0's timeout
        return "slept"
    x = torch.zeros(2, 1)
    handle, _ = comm.all_to_all_single(x, async_op=True, timeout_s=0.5)
    t0 = time.monotonic()
    try:
        handle.wait()
    except comm.CommTimeoutError as exc:
        assert time.monotonic() - t0 < 2.5
        return str(exc)
    return "no timeout"


def test_wait_past_timeout_raises_comm_timeout() -> None:
    msgs = run_ranks(_late_peer_worker, 2, timeout_s=60)
    assert "all_to_all_single" in msgs[0] and "0.5s" in msgs[0], msgs[0]
