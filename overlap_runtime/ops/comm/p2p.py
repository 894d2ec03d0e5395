"""Point-to-point: ``isend``, ``irecv`` and one ring hop, each returning an :class:`AsyncHandle`.

Peers are ranks *in the group* (CP rank, PP rank); the conversion to global ranks happens in
:func:`ranks.global_rank` and nowhere else. Every handle waits with a bound and keeps its
buffers alive (``AsyncHandle.keep_alive``) until waited, so a caller may drop its own
references right after posting. Not differentiable: the algorithms that use them (ring
attention, the GDN state chain, the pipeline runtime) write their own backward.

Ordering: untagged messages between two ranks are matched in posting order, so both sides of
a pair must post the messages of one direction in the same program order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import step_record
from ..profile_range import profile_range
from .handle import AsyncHandle, resolve_timeout
from .ranks import check_device_backend, global_rank, group_rank, group_size


def _check_peer(peer: int, group: dist.ProcessGroup | None, op: str) -> int:
    me, world = group_rank(group), group_size(group)
    if not 0 <= peer < world:
        raise ValueError(f"{op}: peer {peer} is not a rank of the group (size {world})")
    if peer == me:
        raise ValueError(f"{op}: peer {peer} is this rank itself; point-to-point needs another rank")
    return global_rank(group, peer)


def isend(x: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, *, tag: int = 0,
          timeout_s: float | None = None, what: str = "isend") -> AsyncHandle:
    """Send ``x`` to rank ``dst`` of ``group`` asynchronously.

    Args:
        x: any shape and dtype on the group's device kind; sent as ``x.detach().contiguous()``
            (no copy when ``x`` is contiguous).
        dst: destination rank in ``group`` (not this rank).
        tag: message tag (gloo and the pipeline runtime use it to match; NCCL ignores it).
        what: names the message in errors: ``"{what} (send to group rank {dst})"``.

    Returns:
        A handle whose ``keep_alive`` holds the payload until ``wait`` returns; wait it before
        changing ``x`` in place.
    """
    description = f"{what} (send to group rank {dst})"
    check_device_backend(x, group, description)
    peer = _check_peer(dst, group, description)
    payload = x.detach().contiguous()
    step_record.note_comm("send", group, peer, payload.numel() * payload.element_size(), what)
    with profile_range(lambda: f"p2p.send {description}"):
        work = dist.isend(payload, peer, group=group, tag=tag)
    return AsyncHandle([work], description, resolve_timeout(timeout_s), device=payload.device,
                       keep_alive=(payload,))


def irecv(buf: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *, tag: int = 0,
          timeout_s: float | None = None, what: str = "irecv") -> AsyncHandle:
    """Receive into ``buf`` from rank ``src`` of ``group`` asynchronously.

    Args:
        buf: contiguous buffer of exactly the sent shape and dtype (the receiver knows the size
            by the same rule as the sender; nothing checks it on the wire).
        src: source rank in ``group`` (not this rank).
        what: names the message in errors: ``"{what} (recv from group rank {src})"``.

    Returns:
        A handle; ``buf`` holds the message once ``wait`` has returned.
    """
    description = f"{what} (recv from group rank {src})"
    if not buf.is_contiguous():
        raise ValueError(f"{description}: the receive buffer {tuple(buf.shape)} is not "
                         f"contiguous (a receive cannot write through a copy)")
    check_device_backend(buf, group, description)
    peer = _check_peer(src, group, description)
    step_record.note_comm("recv", group, peer, buf.numel() * buf.element_size(), what)
    with profile_range(lambda: f"p2p.recv {description}"):
        work = dist.irecv(buf, peer, group=group, tag=tag)
    return AsyncHandle([work], description, resolve_timeout(timeout_s), device=buf.device,
                       keep_alive=(buf,))


def ring_shift(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None = None, *,
               timeout_s: float | None = None, what: str = "ring shift") -> AsyncHandle:
    """One ring hop: ``send`` goes to rank ``me + 1``, ``recv`` is filled from rank ``me - 1``.

    Both transfers are posted at once and completed by one handle (like ``batch_isend_irecv``),
    which keeps both buffers alive until waited. ``send`` and ``recv`` may differ in shape (a
    ring may pass half messages); each receiver sizes ``recv`` by the rule its sender follows.

    Posting order: even ranks send then receive, odd ranks receive then send. With two ranks
    both peers are the same rank, and backends that serialise point-to-point per peer pair
    (NCCL's per-pair stream, or the main stream under eager init) would deadlock if both sides
    sent first. One order on both sides of every pair also keeps successive untagged hops
    matched in order.

    Args:
        send: contiguous tensor on the group's device kind (sent as is: no copy).
        recv: contiguous buffer for the previous rank's message.
        group: at least two ranks.
        what: names the hop in errors, with this rank and both peers.
    """
    me, world = group_rank(group), group_size(group)
    if world < 2:
        raise ValueError(f"{what}: ring_shift needs a group of at least 2 ranks, got {world}")
    nxt, prv = (me + 1) % world, (me - 1) % world
    description = f"{what} (rank {me}: send to {nxt}, receive from {prv})"
    for name, t in (("send", send), ("recv", recv)):
        if not t.is_contiguous():
            raise ValueError(f"{description}: the {name} tensor {tuple(t.shape)} is not contiguous")
    check_device_backend(recv, group, description)
    ops = [(dist.isend, send, global_rank(group, nxt)), (dist.irecv, recv, global_rank(group, prv))]
    # one launch, recorded as its send then its receive (whatever the posting order below)
    step_record.note_comm("send", group, ops[0][2], send.numel() * send.element_size(), what)
    step_record.note_comm("recv", group, ops[1][2], recv.numel() * recv.element_size(), what)
    if me % 2:
        ops.reverse()
    with profile_range(lambda: f"p2p.ring {description}"):
        works = [op(t, peer, group=group) for op, t, peer in ops]
    return AsyncHandle(works, description, resolve_timeout(timeout_s), device=recv.device,
                       keep_alive=(send, recv))
