"""Differentiable collectives with bounded waits.

Every operation here is an autograd Function over a real ``torch.distributed`` collective, and
every wait takes a timeout (``timeout_s``; default :data:`DEFAULT_TIMEOUT_S`, overridable with the
environment variable ``OVERLAP_RUNTIME_COMM_TIMEOUT_S``).

=====================  ===========================================  ==========================
op                     forward                                      backward
=====================  ===========================================  ==========================
all_to_all_single      all-to-all-v along dim 0                     the reverse all-to-all-v
halo_exchange          last ``w`` positions -> rank+1 (P2P)         halo grads -> rank-1
recv_prev / send_next  state chain: receive from rank-1, send to    gradient flows rank+1 ->
                       rank+1 asynchronously                        rank (the other way)
all_gather             gather equal shards along ``dim``            all-to-all + sum (a
                                                                    reduce-scatter gloo lacks)
=====================  ===========================================  ==========================

Waiting: on the CPU (gloo) ``AsyncHandle.wait`` blocks the calling thread at most ``timeout_s``
(``Work.wait`` with a timeout) and raises :class:`CommTimeoutError` naming the operation. For
tensors on cuda/npu (NCCL/HCCL) a wait is device-side: the current stream waits for the
collective and the CPU goes on; that wait is bounded by the process group's timeout, which the
NCCL/HCCL watchdog enforces (``init_from_env`` sets it). No collective here is ever issued as a
blocking call without a bound.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from overlap_runtime.platform import BACKEND_FOR_KIND

DEFAULT_TIMEOUT_S = float(os.environ.get("OVERLAP_RUNTIME_COMM_TIMEOUT_S", "300"))

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncHandle",
    "CommTimeoutError",
    "all_to_all_single",
    "halo_exchange",
    "recv_prev",
    "send_next",
    "attach",
    "all_gather",
    "group_rank",
    "group_size",
]


class CommTimeoutError(TimeoutError):
    """A collective or point-to-point wait passed its timeout."""


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group`` (the default group when None)."""
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the default group when None)."""
    return dist.get_world_size(group)


def _global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def _timeout(timeout_s: float | None) -> float:
    t = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if t <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return t


def _check_device_backend(x: torch.Tensor, group: dist.ProcessGroup | None, op: str) -> None:
    backend = str(dist.get_backend(group))
    expected = BACKEND_FOR_KIND.get(x.device.type)
    if backend == "gloo" and x.device.type != "cpu":
        raise ValueError(f"{op}: tensor on {x.device} but the group's backend is gloo, which "
                         f"this runtime only uses for cpu tensors")
    if backend in ("nccl", "hccl") and expected != backend:
        raise ValueError(f"{op}: tensor on {x.device} but the group's backend is {backend}, "
                         f"which needs {'cuda' if backend == 'nccl' else 'npu'} tensors")


def _device_side(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type in ("cuda", "npu")


def _wait_work(work: Any, timeout_s: float, what: str,
               device: torch.device | str | None = None) -> None:
    if work is None:
        return
    if _device_side(device):
        # NCCL/HCCL: ``wait()`` orders the current stream after the collective and returns; the
        # CPU does not block (a ``wait(timeout)`` would make it spin until completion, turning
        # every overlap into a host sync). The device-side wait is bounded by the process
        # group's timeout, enforced by the NCCL/HCCL watchdog (set at init_process_group).
        work.wait()
        return
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        msg = str(exc)
        if "imed out" in msg or "timeout" in msg.lower():
            raise CommTimeoutError(f"{what}: not complete after {timeout_s:.1f}s ({msg})") from exc
        raise RuntimeError(f"{what} failed: {msg}") from exc
    if ok is False:
        raise CommTimeoutError(f"{what}: not complete after {timeout_s:.1f}s")


class AsyncHandle:
    """One or more in-flight collectives; ``wait`` completes them (idempotent, bounded).

    ``on_complete`` callbacks run once, in the waiting thread, after the works finish (used to
    copy a received buffer into place). Thread-safe: two threads may call ``wait``.
    """

    def __init__(self, works: Sequence[Any], description: str, timeout_s: float | None = None,
                 on_complete: Callable[[], None] | None = None,
                 device: torch.device | str | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self.description = description
        self._device = device
        self._timeout_s = _timeout(timeout_s)
        self._on_complete = on_complete
        self._done = False
        self._lock = threading.Lock()

    @property
    def completed(self) -> bool:
        """True once ``wait`` has returned."""
        return self._done

    def is_completed(self) -> bool:
        """Poll without blocking: True when ``wait`` would not block."""
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: float | None = None) -> None:
        """Complete every work, at most ``timeout_s`` each; later calls return at once."""
        with self._lock:
            if self._done:
                return
            t = self._timeout_s if timeout_s is None else _timeout(timeout_s)
            for w in self._works:
                _wait_work(w, t, self.description, self._device)
            if self._on_complete is not None:
                self._on_complete()
            self._done = True

    def __repr__(self) -> str:
        return f"AsyncHandle({self.description!r}, completed={self._done})"


# --------------------------------------------------------------------------- all-to-all


def _check_splits(name: str, splits: Sequence[int] | None, world: int, dim0: int | None) -> list[int] | None:
    if splits is None:
        return None
    s = [int(v) for v in splits]
    if len(s) != world:
        raise ValueError(f"all_to_all_single: {name} has {len(s)} entries {s}, expected one per "
                         f"rank (group size {world})")
    if any(v < 0 for v in s):
        raise ValueError(f"all_to_all_single: {name} {s} has negative sizes")
    if dim0 is not None and sum(s) != dim0:
        raise ValueError(f"all_to_all_single: {name} {s} sums to {sum(s)} but dim 0 of the input "
                         f"is {dim0}")
    return s


def _raw_all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                    group: dist.ProcessGroup | None, async_op: bool) -> tuple[Any, torch.Tensor]:
    world = group_size(group)
    if out_splits is None:
        if x.shape[0] % world:
            raise ValueError(f"all_to_all_single: dim 0 ({x.shape[0]}) is not divisible by the "
                             f"group size {world} and no splits were given")
        n_out = x.shape[0]
    else:
        n_out = sum(out_splits)
    out = x.new_empty((n_out, *x.shape[1:]))
    x = x.contiguous()
    if world == 1:
        out.copy_(x)
        return None, out
    # Always launched async: even a "synchronous" call waits through _wait_work, with a timeout.
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    return work, out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, out_splits: list[int] | None,
                in_splits: list[int] | None, group: dist.ProcessGroup | None, timeout_s: float,
                handle_box: list[Any] | None) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.timeout_s = out_splits, in_splits, group, timeout_s
        async_op = handle_box is not None
        work, out = _raw_all_to_all(x, out_splits, in_splits, group, async_op)
        if async_op:
            handle = AsyncHandle([work], "all_to_all_single (forward)", timeout_s, device=x.device)
            handle_box.append(handle)
            ctx.handle = handle
        else:
            ctx.handle = None
            _wait_work(work, timeout_s, "all_to_all_single (forward)", x.device)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        if ctx.handle is not None and not ctx.handle.completed:
            raise RuntimeError(
                "all_to_all_single: backward reached an async all-to-all whose handle was never "
                "waited; call handle.wait() before using its output"
            )
        work, grad_in = _raw_all_to_all(grad_out, ctx.in_splits, ctx.out_splits, ctx.group, True)
        _wait_work(work, ctx.timeout_s, "all_to_all_single (backward)", grad_out.device)
        return grad_in, None, None, None, None, None


def all_to_all_single(
    x: torch.Tensor,
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    timeout_s: float | None = None,
) -> torch.Tensor | tuple[AsyncHandle, torch.Tensor]:
    """Differentiable all-to-all-v along dim 0.

    Args:
        x: ``[N, *rest]``; rows ``[sum(input_splits[:j]), +input_splits[j])`` go to rank j.
        output_splits: rows received from each rank (None: equal split of ``N``).
        input_splits: rows sent to each rank (None: equal split of ``N``).
        async_op: return ``(AsyncHandle, out)``; ``out`` must not be read before
            ``handle.wait()`` (the backward raises if the handle was never waited).

    Returns:
        ``[sum(output_splits), *rest]`` with x's dtype and device, or ``(handle, that)``.
        The backward is the reverse all-to-all (splits swapped), run synchronously.
    """
    world = group_size(group)
    _check_device_backend(x, group, "all_to_all_single")
    in_s = _check_splits("input_splits", input_splits, world, x.shape[0])
    out_s = _check_splits("output_splits", output_splits, world, None)
    if (in_s is None) != (out_s is None):
        raise ValueError("all_to_all_single: give both output_splits and input_splits, or neither")
    t = _timeout(timeout_s)
    box: list[Any] | None = [] if async_op else None
    out = _AllToAll.apply(x, out_s, in_s, group, t, box)
    if async_op:
        assert box is not None
        handle = box[0] if box else AsyncHandle([], "all_to_all_single (forward)", t)
        return handle, out
    return out


# --------------------------------------------------------------------------- point to point


def _p2p(ops: list[tuple[str, torch.Tensor, int]], group: dist.ProcessGroup | None) -> list[Any]:
    """Issue isend/irecv in the given order; ``peer`` is a rank inside ``group``."""
    works = []
    for kind, tensor, peer in ops:
        g_peer = _global_rank(group, peer)
        if kind == "send":
            works.append(dist.isend(tensor, g_peer, group=group))
        else:
            works.append(dist.irecv(tensor, g_peer, group=group))
    return works


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, width: int, dim: int,
                group: dist.ProcessGroup | None, timeout_s: float) -> torch.Tensor:
        rank, world = group_rank(group), group_size(group)
        ctx.width, ctx.dim, ctx.group, ctx.timeout_s = width, dim, group, timeout_s
        ctx.len_dim = x.shape[dim]
        tail = x.narrow(dim, x.shape[dim] - width, width).contiguous()
        shape = list(x.shape)
        shape[dim] = width
        halo = x.new_zeros(shape)
        ops: list[tuple[str, torch.Tensor, int]] = []
        if rank > 0:
            ops.append(("recv", halo, rank - 1))
        if rank < world - 1:
            ops.append(("send", tail, rank + 1))
        for w in _p2p(ops, group):
            _wait_work(w, timeout_s, f"halo_exchange (forward, rank {rank})", x.device)
        return halo

    @staticmethod
    def backward(ctx: Any, grad_halo: torch.Tensor) -> tuple[Any, ...]:
        group, width, dim = ctx.group, ctx.width, ctx.dim
        rank, world = group_rank(group), group_size(group)
        shape = list(grad_halo.shape)
        shape[dim] = ctx.len_dim
        grad_x = grad_halo.new_zeros(shape)
        grad_tail = grad_halo.new_zeros(grad_halo.shape)
        ops: list[tuple[str, torch.Tensor, int]] = []
        if rank > 0:
            ops.append(("send", grad_halo.contiguous(), rank - 1))
        if rank < world - 1:
            ops.append(("recv", grad_tail, rank + 1))
        for w in _p2p(ops, group):
            _wait_work(w, ctx.timeout_s, f"halo_exchange (backward, rank {rank})", grad_x.device)
        grad_x.narrow(dim, ctx.len_dim - width, width).copy_(grad_tail)
        return grad_x, None, None, None, None


def halo_exchange(x: torch.Tensor, width: int, dim: int = 1, group: dist.ProcessGroup | None = None,
                  timeout_s: float | None = None) -> torch.Tensor:
    """Receive the previous rank's last ``width`` positions along ``dim``.

    Each rank sends its last ``width`` positions to rank+1 and receives rank-1's; rank 0 receives
    zeros. Only the ``width`` positions cross the wire (point-to-point), never the whole shard.

    Args:
        x: local shard, e.g. ``[B, S_local, C]`` with ``dim=1``; any dtype.
        width: halo width, ``0 <= width <= x.shape[dim]`` (e.g. conv kernel - 1).

    Returns:
        ``x``'s shape with ``width`` along ``dim``. Backward: the halo's gradient goes back to
        rank-1 and is added to the gradient of its last ``width`` positions.
    """
    if not 0 <= dim < x.dim() and not -x.dim() <= dim < 0:
        raise ValueError(f"halo_exchange: dim {dim} out of range for a {x.dim()}-d tensor")
    dim = dim % x.dim()
    if width < 0 or width > x.shape[dim]:
        raise ValueError(f"halo_exchange: width {width} must be in [0, {x.shape[dim]}] (the local "
                         f"length along dim {dim})")
    _check_device_backend(x, group, "halo_exchange")
    return _HaloExchange.apply(x, int(width), dim, group, _timeout(timeout_s))


class _RecvPrev(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, anchor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, group: dist.ProcessGroup | None, timeout_s: float,
                pending: list[AsyncHandle] | None) -> torch.Tensor:
        rank = group_rank(group)
        ctx.group, ctx.timeout_s, ctx.pending = group, timeout_s, pending
        buf = torch.empty(shape, dtype=dtype, device=device)
        (work,) = _p2p([("recv", buf, rank - 1)], group)
        _wait_work(work, timeout_s, f"recv_prev (forward, rank {rank} from {rank - 1})", device)
        return buf

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rank = group_rank(ctx.group)
        grad = grad.contiguous()
        (work,) = _p2p([("send", grad, rank - 1)], ctx.group)
        handle = AsyncHandle([work], f"recv_prev (backward send, rank {rank} to {rank - 1})",
                             ctx.timeout_s, device=grad.device)
        if ctx.pending is not None:
            ctx.pending.append(handle)
        else:
            handle.wait()
        return None, None, None, None, None, None, None


def recv_prev(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
              group: dist.ProcessGroup | None = None, timeout_s: float | None = None,
              requires_grad: bool = True,
              pending: list[AsyncHandle] | None = None) -> torch.Tensor | None:
    """State chain, receive side: the tensor rank-1 sent with :func:`send_next`.

    Returns None on rank 0 (no predecessor). With ``requires_grad`` the result is a graph input
    whose gradient, in backward, is sent back to rank-1 (received there by ``send_next``'s
    backward). The backward send is waited at once unless ``pending`` is given, in which case its
    handle is appended there for the caller to wait later.
    """
    rank = group_rank(group)
    if any(int(s) < 0 for s in shape):
        raise ValueError(f"recv_prev: negative size in shape {tuple(shape)}")
    if rank == 0:
        return None
    dev = torch.device(device)
    anchor = torch.empty(0, requires_grad=requires_grad)
    probe = torch.empty(0, device=dev)
    _check_device_backend(probe, group, "recv_prev")
    return _RecvPrev.apply(anchor, tuple(int(s) for s in shape), dtype, dev, group, _timeout(timeout_s),
                           pending)


class _SendNext(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float,
                handle_box: list[Any]) -> torch.Tensor:
        rank = group_rank(group)
        ctx.group, ctx.timeout_s = group, timeout_s
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        payload = x.detach().contiguous()
        (work,) = _p2p([("send", payload, rank + 1)], group)
        # The handle keeps ``payload`` alive until the send completes.
        handle = AsyncHandle([work], f"send_next (forward, rank {rank} to {rank + 1})", timeout_s,
                             device=x.device)
        handle.payload = payload  # type: ignore[attr-defined]
        handle_box.append(handle)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad_token: torch.Tensor) -> tuple[Any, ...]:
        rank = group_rank(ctx.group)
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        (work,) = _p2p([("recv", grad, rank + 1)], ctx.group)
        _wait_work(work, ctx.timeout_s, f"send_next (backward recv, rank {rank} from {rank + 1})",
                   grad.device)
        return grad, None, None, None


def send_next(x: torch.Tensor, group: dist.ProcessGroup | None = None,
              timeout_s: float | None = None) -> tuple[AsyncHandle, torch.Tensor]:
    """State chain, send side: send ``x`` to rank+1 asynchronously.

    Returns ``(handle, token)``. Wait the handle before the process ends or ``x`` changes (as late
    as you like). ``token`` is a zero scalar tied to ``x`` in the graph: pass it to
    :func:`attach` on a tensor that reaches the loss, so that backward receives ``dx`` from
    rank+1. On the last rank nothing is sent, the handle is already complete and ``token`` is a
    plain zero.
    """
    rank, world = group_rank(group), group_size(group)
    t = _timeout(timeout_s)
    if rank == world - 1:
        return AsyncHandle([], "send_next (last rank: nothing to send)", t), x.new_zeros(())
    _check_device_backend(x, group, "send_next")
    box: list[Any] = []
    token = _SendNext.apply(x, group, t, box)
    return box[0], token


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, out: torch.Tensor, *tokens: torch.Tensor) -> torch.Tensor:
        ctx.token_meta = [(t.shape, t.dtype, t.device) for t in tokens]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (grad, *[torch.zeros(s, dtype=d, device=dv) for s, d, dv in ctx.token_meta])


def attach(out: torch.Tensor, *tokens: torch.Tensor) -> torch.Tensor:
    """Identity on ``out`` whose backward also runs the graphs behind ``tokens``.

    Values and ``out``'s gradient are unchanged; tokens get a zero gradient, which is enough for
    autograd to run the backward of whatever produced them (e.g. ``send_next``'s receive).
    """
    live = [t for t in tokens if t.requires_grad]
    if not live:
        return out
    return _Attach.apply(out, *live)


# --------------------------------------------------------------------------- all-gather


# torch >= 2.12 names it all_gather_single; older releases all_gather_into_tensor (same op).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                timeout_s: float) -> torch.Tensor:
        world = group_size(group)
        ctx.dim, ctx.group, ctx.timeout_s, ctx.world = dim, group, timeout_s, world
        x0 = x.movedim(dim, 0).contiguous()
        out = x0.new_empty((world * x0.shape[0], *x0.shape[1:]))
        if world == 1:
            out.copy_(x0)
        else:
            work = _all_gather_single(out, x0, group=group, async_op=True)
            _wait_work(work, timeout_s, "all_gather (forward)", x.device)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        world = ctx.world
        g0 = grad.movedim(ctx.dim, 0).contiguous()
        n = g0.shape[0] // world
        work, recv = _raw_all_to_all(g0, None, None, ctx.group, True)
        _wait_work(work, ctx.timeout_s, "all_gather (backward all-to-all)", grad.device)
        # Sum the ranks' slices in fp32 at least (bf16 partial sums lose bits), then cast back.
        acc = torch.promote_types(recv.dtype, torch.float32)
        gx = recv.view(world, n, *g0.shape[1:]).to(acc).sum(0).to(grad.dtype)
        return gx.movedim(0, ctx.dim), None, None, None


def all_gather(x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None,
               timeout_s: float | None = None) -> torch.Tensor:
    """Gather equal shards along ``dim`` in rank order; backward sums each rank's slice.

    Every rank must pass the same shape. Returns ``x``'s shape with ``dim`` multiplied by the
    group size.
    """
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"all_gather: dim {dim} out of range for a {x.dim()}-d tensor")
    _check_device_backend(x, group, "all_gather")
    return _AllGather.apply(x, dim % x.dim(), group, _timeout(timeout_s))
