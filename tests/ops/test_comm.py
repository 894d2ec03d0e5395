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
        lambda: comm.isend(x, 2),  # not a rank of a group of 2
        lambda: comm.irecv(x.t(), 1 - rank),  # a receive cannot write through a copy
        lambda: comm.all_gather(x, dim=3),
        lambda: comm.isend(x, rank, what="h_out"),  # to itself
        lambda: comm.AsyncHandle([], "x", timeout_s=0),
        lambda: comm.global_rank(None, -1),
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
    assert "peer 2" in msgs[5] and "size 2" in msgs[5]
    assert "not contiguous" in msgs[6] and "recv from group rank" in msgs[6]
    assert "dim 3" in msgs[7]
    assert "h_out" in msgs[8] and "itself" in msgs[8]
    assert "timeout_s" in msgs[9]
    assert "rank -1" in msgs[10] and "2 ranks" in msgs[10]


# --------------------------------------------------------------------------- point to point


def _p2p_subgroup_worker(rank: int, world: int) -> dict[str, object]:
    """isend/irecv inside the group of global ranks [1, 3]: group rank 1 is global rank 3."""
    members = [1, 3]
    group = dist.new_group(members)
    res: dict[str, object] = {}
    if rank not in members:
        return res
    me = members.index(rank)
    assert comm.group_rank(group) == me
    assert [comm.global_rank(group, r) for r in range(2)] == members
    if me == 0:
        x = _x(rank, 4, 3).t()  # not contiguous: sent as one contiguous copy
        handle = comm.isend(x, 1, group, what="probe", tag=7)
        (payload,) = handle.keep_alive
        assert payload.is_contiguous() and torch.equal(payload, x)
        assert "send to group rank 1" in handle.description
        handle.wait()
        res["keep_alive_after_wait"] = len(handle.keep_alive)
    else:
        buf = torch.empty(3, 4)
        handle = comm.irecv(buf, 0, group, what="probe", tag=7)
        handle.wait()
        handle.wait()  # idempotent
        res["err"] = rel_l2(buf, _x(1, 4, 3).t())
    return res


def test_isend_irecv_use_ranks_in_the_group() -> None:
    res = run_ranks(_p2p_subgroup_worker, 4)
    assert res[1]["keep_alive_after_wait"] == 0
    assert res[3]["err"] == 0.0


def _ring_shift_worker(rank: int, world: int) -> list[float]:
    send = torch.full((2, 3), float(rank))
    got = []
    for hop in range(world):  # full circle: every rank ends with its own tensor
        recv = torch.empty(2, 3)
        handle = comm.ring_shift(send, recv, what=f"hop {hop}")
        assert handle.keep_alive == (send, recv)
        handle.wait()
        assert handle.keep_alive == ()
        got.append(recv[0, 0].item())
        send = recv
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_shift_receives_from_the_previous_rank(world: int) -> None:
    got = run_ranks(_ring_shift_worker, world)
    for rank, seen in enumerate(got):
        assert seen == [float((rank - 1 - h) % world) for h in range(world)], (rank, seen)


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


def _attach_worker(rank: int, world: int) -> float:
    """Rank 0 reads nothing of the gather (as in GDN all_gather CP) and attaches it instead."""
    shape = (2, 3)
    xs = [_x(r, 2, 3).requires_grad_(True) for r in range(world)]
    full = torch.cat(xs)
    loss = (xs[0] * 2 * _weight(0, shape)).sum()
    loss = loss + sum((full * _weight(r, tuple(full.shape))).sum() for r in range(1, world))
    loss.backward()
    x = _x(rank, 2, 3).requires_grad_(True)
    gathered = comm.all_gather(x, timeout_s=10.0)
    if rank == 0:
        out = comm.attach(x * 2, gathered)
        assert torch.equal(out, x * 2)
        (out * _weight(0, shape)).sum().backward()
    else:
        (gathered * _weight(rank, tuple(gathered.shape))).sum().backward()
    err = rel_l2(x.grad, xs[rank].grad)
    assert err <= TOL, (rank, err)
    return err


def test_attach_keeps_an_unread_collective_in_the_backward() -> None:
    errs = run_ranks(_attach_worker, 3, timeout_s=60)
    assert max(errs) <= TOL


# --------------------------------------------------------------------------- timeouts


def _late_peer_worker(rank: int, world: int) -> str:
    if rank == 1:
        time.sleep(3.0)  # never joins the all-to-all within rank 0's timeout
        return "slept"
    x = torch.zeros(2, 1)
    handle, _ = comm.all_to_all_single(x, async_op=True, timeout_s=0.5)
    return _timeout_message(handle)


def _timeout_message(handle: comm.AsyncHandle) -> str:
    """The CommTimeoutError text of a wait bounded at 0.5 s (it must end well before 2.5 s)."""
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


def _recv_without_sender_worker(rank: int, world: int) -> str:
    if rank == 1:
        time.sleep(3.0)  # never sends
        return "slept"
    handle = comm.irecv(torch.empty(4), 1, what="h_in", timeout_s=0.5)
    return _timeout_message(handle)


def test_recv_without_sender_raises_comm_timeout_naming_the_op() -> None:
    msgs = run_ranks(_recv_without_sender_worker, 2, timeout_s=60)
    assert "h_in (recv from group rank 1)" in msgs[0] and "0.5s" in msgs[0], msgs[0]


def _peer_gone_worker(rank: int, world: int) -> str:
    if rank == 1:
        time.sleep(2.0)
        dist.destroy_process_group()  # closes the pair rank 0 is receiving on
        return "left"
    handle = comm.irecv(torch.empty(4), 1, what="h_in", timeout_s=30.0)
    t0 = time.monotonic()
    try:
        handle.wait()
    except comm.CommTimeoutError as exc:
        return f"timeout: {exc}"
    except comm.CommFailedError as exc:
        assert time.monotonic() - t0 < 25.0
        return f"failed: {exc}"
    return "no error"


def test_peer_gone_is_a_failure_not_a_timeout() -> None:
    """A wait that ends early with an error is CommFailedError, whatever the backend's text."""
    msgs = run_ranks(_peer_gone_worker, 2, timeout_s=60)
    assert msgs[0].startswith("failed: h_in (recv from group rank 1) failed after"), msgs[0]


def _agree_worker(rank: int, world: int) -> dict[str, str]:
    def outcome(fields: list) -> str:
        try:
            comm.check_ranks_agree("op", fields, group_name="pp")
        except ValueError as exc:
            return str(exc)
        return "agree"

    return {
        "equal": outcome([("n", 4), ("dtype", torch.float32), ("mode", "zigzag"),
                          ("shape", (1, 2)), ("none", None), ("flag", True)]),
        "one off": outcome([("n", 4), ("the count", 3 if rank == 1 else 8)]),
        "two off": outcome([("the dtype", torch.float64 if rank else torch.float32),
                            ("mode", None if rank == 2 else "zigzag"), ("same", 1)]),
    }


def test_check_ranks_agree_raises_the_same_named_error_on_every_rank() -> None:
    """Equal values pass; otherwise every rank raises naming the first differing field with
    every rank's value (ranks sharing one grouped), then the other differing fields."""
    for rank, res in enumerate(run_ranks(_agree_worker, 3)):
        assert res == {
            "equal": "agree",
            "one off": "op: ranks disagree on the count: ranks 0, 2 have 8, rank 1 has 3 "
                       "(pp group of 3)",
            "two off": "op: ranks disagree on the dtype: rank 0 has torch.float32, ranks 1, 2 "
                       "have torch.float64 (pp group of 3); also on mode",
        }, f"rank {rank}: {res}"


def _agree_one_rank_worker(rank: int, world: int) -> str:
    comm.check_ranks_agree("op", [("n", rank)])  # a group of one has nobody to disagree with
    return "ok"


def test_check_ranks_agree_on_one_rank_is_a_no_op() -> None:
    assert run_ranks(_agree_one_rank_worker, 1) == ["ok"]
