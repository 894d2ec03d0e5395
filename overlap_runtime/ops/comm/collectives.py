"""Differentiable collectives: ``all_to_all_single`` and ``all_gather``, with bounded waits.

=====================  ===========================================  ==========================
op                     forward                                      backward
=====================  ===========================================  ==========================
all_to_all_single      all-to-all-v along dim 0                     the reverse all-to-all-v
all_gather             gather equal shards along ``dim``            all-to-all + sum (a
                                                                    reduce-scatter gloo lacks)
attach                 identity on ``out``, ties ``tokens`` in      runs the tokens' backward
=====================  ===========================================  ==========================

Each is an autograd Function over a real ``torch.distributed`` collective, always launched
async and completed through :func:`handle.wait_work` with a timeout, even when the caller asked
for a synchronous call.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from .. import step_record
from ..profile_range import profile_range
from .handle import AsyncHandle, resolve_timeout, wait_work
from .ranks import check_device_backend, group_size


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
                    group: dist.ProcessGroup | None, async_op: bool,
                    what: str = "all_to_all") -> tuple[Any, torch.Tensor]:
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
    step_record.note_comm("collective", group, None, x.numel() * x.element_size(), what,
                          "all_to_all")
    # Always launched async: even a "synchronous" call waits through wait_work, with a timeout.
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    return work, out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, out_splits: list[int] | None,
                in_splits: list[int] | None, group: dist.ProcessGroup | None, timeout_s: float,
                handle_box: list[Any] | None, what: str) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.timeout_s = out_splits, in_splits, group, timeout_s
        ctx.what = what
        async_op = handle_box is not None
        with profile_range(lambda: f"a2a {what} fwd"):
            work, out = _raw_all_to_all(x, out_splits, in_splits, group, async_op, what)
            if async_op:
                handle = AsyncHandle([work], f"{what} (forward)", timeout_s, device=x.device)
                handle_box.append(handle)
                ctx.handle = handle
            else:
                ctx.handle = None
                wait_work(work, timeout_s, f"{what} (forward)", x.device)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        if ctx.handle is not None and not ctx.handle.completed:
            raise RuntimeError(
                "all_to_all_single: backward reached an async all-to-all whose handle was never "
                "waited; call handle.wait() before using its output"
            )
        with profile_range(lambda: f"a2a {ctx.what} bwd"):
            work, grad_in = _raw_all_to_all(grad_out, ctx.in_splits, ctx.out_splits, ctx.group,
                                            True, ctx.what)
            wait_work(work, ctx.timeout_s, f"{ctx.what} (backward)", grad_out.device)
        return grad_in, None, None, None, None, None, None


def all_to_all_single(
    x: torch.Tensor,
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    timeout_s: float | None = None,
    what: str = "all_to_all_single",
) -> torch.Tensor | tuple[AsyncHandle, torch.Tensor]:
    """Differentiable all-to-all-v along dim 0.

    Args:
        x: ``[N, *rest]``; rows ``[sum(input_splits[:j]), +input_splits[j])`` go to rank j.
        output_splits: rows received from each rank (None: equal split of ``N``).
        input_splits: rows sent to each rank (None: equal split of ``N``).
        async_op: return ``(AsyncHandle, out)``; ``out`` must not be read before
            ``handle.wait()`` (the backward raises if the handle was never waited).
        what: names the collective in errors and in the profiler ranges ``a2a {what} fwd`` /
            ``a2a {what} bwd`` (e.g. the MoE dispatcher's ``S1.L0.dispatch``).

    Returns:
        ``[sum(output_splits), *rest]`` with x's dtype and device, or ``(handle, that)``.
        The backward is the reverse all-to-all (splits swapped), run synchronously.
    """
    world = group_size(group)
    check_device_backend(x, group, "all_to_all_single")
    in_s = _check_splits("input_splits", input_splits, world, x.shape[0])
    out_s = _check_splits("output_splits", output_splits, world, None)
    if (in_s is None) != (out_s is None):
        raise ValueError("all_to_all_single: give both output_splits and input_splits, or neither")
    t = resolve_timeout(timeout_s)
    box: list[Any] | None = [] if async_op else None
    out = _AllToAll.apply(x, out_s, in_s, group, t, box, what)
    if async_op:
        assert box is not None
        handle = box[0] if box else AsyncHandle([], f"{what} (forward)", t)
        return handle, out
    return out


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
            step_record.note_comm("collective", group, None, x0.numel() * x0.element_size(),
                                  "all_gather", "all_gather")
            work = _all_gather_single(out, x0, group=group, async_op=True)
            wait_work(work, timeout_s, "all_gather (forward)", x.device)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        world = ctx.world
        g0 = grad.movedim(ctx.dim, 0).contiguous()
        n = g0.shape[0] // world
        work, recv = _raw_all_to_all(g0, None, None, ctx.group, True, "all_gather (backward)")
        wait_work(work, ctx.timeout_s, "all_gather (backward all-to-all)", grad.device)
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
    check_device_backend(x, group, "all_gather")
    return _AllGather.apply(x, dim % x.dim(), group, resolve_timeout(timeout_s))


# --------------------------------------------------------------------------- attach


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
    autograd to run the backward of whatever produced them. Use: a rank that reads nothing of a
    collective's output (GDN all_gather CP, rank 0) attaches it to its own output so that the
    collective's backward runs on every rank, not on some only (which would hang the others).
    """
    live = [t for t in tokens if t.requires_grad]
    if not live:
        return out
    return _Attach.apply(out, *live)
