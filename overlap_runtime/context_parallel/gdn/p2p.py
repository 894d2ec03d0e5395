"""State-P2P GDN context parallelism: conv halo, affine summaries, a short state chain.

:class:`P2PGDNMixer` is the layer's sequence mixer in this mode. Every rank keeps all heads and its contiguous sequence shard. Only two things cross ranks: the
conv halo (``(kernel - 1) * dilation`` positions, to the next rank) and the fp32 GDN state
``[B, HV, K, V]`` (forward ``H`` to the next rank, backward ``dH`` to the previous one).

Forward of rank ``r`` (P ranks)::

    post irecv H_in (r > 0)
    prep  = prepare_chunks(q, k, v, g, beta)          WY factors, every chunk at once
    M, S  = summarize(prep)                           tree over chunks (r < P-1 only)
    wait H_in                                         <- the only wait on the chain
    H_out = M @ H_in + S  -> isend to r+1             one K x K x V product, sent at once
    o     = chunk_output(prep, H_in)                  scan + outputs, off the chain
    wait the send                                     after the local output

    time -->
    rank 0 | prep+sum |send H1| output                 |
    rank 1 | prep+sum |  wait |A|send H2| output       |
    rank 2 | prep+sum |  wait    |A|send H3| output    |
    rank 3 | prep     |  wait       | output           |    (the last rank needs no summary)

Backward of rank ``r`` (the mirror, with transposed maps)::

    post irecv dH_out (r < P-1)
    local: o = GDN(q, k, v, g, beta; H_in) again, autograd.grad(o, inputs + H_in, dO)
           -> input grads of the local output and dH_in_local       (before dH_out is needed)
    wait dH_out
    dH_in = M^T dH_out + dH_in_local -> isend to r-1    (r > 0)
    summary: grads of (M, S) with dM = dH_out H_in^T, dS = dH_out    (r < P-1)
    wait the send

So the backward chain also costs P x (one ``K x K x V`` product + one send): rank ``r``'s local
backward runs in parallel with every other rank's, before ``dH_out`` arrives.

What is saved for backward: the inputs (q, k, v, g, beta), ``H_in`` and ``M`` (one
``[B, HV, K, K]`` fp32); no chunk-level graph survives the forward (the local output backward goes
through the memory-lean ``chunk_gated_delta_rule``).

``backend="triton"`` puts the chain inside the Triton op itself (:class:`TritonStateChain`).
The op already splits a sequence into segments whose affine summaries it builds in parallel and
chains (``ops/gdn/triton/function.py``); across ranks the chain simply continues::

    forward   prepare, segment summaries (M_s, S_s)             no H_in needed
              wait H_in; chain H_in through the NS segment maps -> H_out, isend at once
              per-segment scans from their true states, outputs   (H_out travelling)
    backward  post irecv dH_out; dv_local, segment-local reverse scans (no dH_out)
              wait dH_out; reverse chain through the M_s^T -> dH_in, isend at once
              per-chunk reverse scan, every input-gradient kernel (dH_in travelling)

No rank computes anything a single GPU would not (the op's own summaries are the chain's
summaries; at least two segments per rank so that they exist), no forward is recomputed in the
backward (the op's saved tensors are kept), and each hop of the chain costs ``NS`` products of
``K x K x V`` plus one state send.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.ops.gdn.state_link import StateLink
from overlap_runtime.ops.profile_range import profile_range
from overlap_runtime.ops.gdn import (
    GDNKernelOptions,
    apply_summary,
    apply_summary_backward,
    chunk_gated_delta_rule,
    chunk_output,
    prepare_chunks,
    summarize,
)

from .common import (
    check_state_passing_call,
    ContextParallelGDNMixer,
    GDNCPPlan,
    local_core_inputs,
    post_recv,
    post_send,
)

__all__ = ["GDNStateChain", "TritonStateChain", "gdn_state_chain", "P2PGDNMixer",
           "local_output_grads", "add_summary_grads"]


class GDNStateChain(torch.autograd.Function):
    """``apply(q, k, v, g, beta, plan, scale, chunk_size) -> o [B, T, HV, V]`` (v's dtype).

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV]`` fp32, beta ``[B, T, HV]``: this
    rank's contiguous shard. The entering state comes from the previous CP rank (zeros on rank
    0); q and k are l2-normalised inside. See the module docstring for the schedule.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        plan: GDNCPPlan,
        scale: float,
        chunk_size: int,
    ) -> torch.Tensor:
        rank, world = plan.rank, plan.cp_size
        batch, _, _, key_dim = q.shape
        heads, value_dim = v.shape[2], v.shape[3]
        state_dtype = torch.promote_types(q.dtype, torch.float32)
        recv = h_in = None
        if rank > 0:  # posted before the local work, so H_in lands while we prepare
            h_in = torch.empty(batch, heads, key_dim, value_dim, dtype=state_dtype, device=q.device)
            recv = post_recv(h_in, rank - 1, plan, "gdn p2p forward H_in")
        with profile_range("gdn.p2p fwd local prepare+summary"):
            prep = prepare_chunks(q, k, v, g, beta, scale, True, chunk_size)
            m = s = None
            if rank < world - 1:
                m, s = summarize(prep)
        if recv is not None:
            recv.wait()
        send = None
        if rank < world - 1:
            with profile_range("gdn.p2p fwd chain H_out = M H_in + S"):
                h_out = s if h_in is None else apply_summary(m, s, h_in)
                send = post_send(h_out, rank + 1, plan, "gdn p2p forward H_out")
        with profile_range("gdn.p2p fwd local output"):
            o, _ = chunk_output(prep, h_in)
        if send is not None:
            send.wait()  # late: the local output ran while the state travelled
        ctx.save_for_backward(q, k, v, g, beta, h_in, m)
        ctx.plan, ctx.scale, ctx.chunk_size = plan, scale, chunk_size
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, g, beta, h_in, m = ctx.saved_tensors
        plan: GDNCPPlan = ctx.plan
        rank, world = plan.rank, plan.cp_size
        recv = dh_out = None
        if rank < world - 1:  # posted first; the local backward below does not need it
            dh_out = m.new_empty((v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]))
            recv = post_recv(dh_out, rank + 1, plan, "gdn p2p backward dH_out")
        needs = ctx.needs_input_grad[:5]
        with profile_range("gdn.p2p bwd local output"):
            grads, dh_in_local, leaves = local_output_grads(
                (q, k, v, g, beta), needs, h_in, do, ctx.scale, ctx.chunk_size, plan.backend,
                plan.options)

        send = None
        if recv is not None:
            recv.wait()
        if rank > 0:
            with profile_range("gdn.p2p bwd chain dH_in = M^T dH_out + dH_local"):
                if dh_out is None:  # last rank: nothing after it
                    dh_in = dh_in_local
                else:
                    dh_in = apply_summary_backward(m, dh_out, dh_in_local)
                send = post_send(dh_in, rank - 1, plan, "gdn p2p backward dH_in")

        if dh_out is not None and any(needs):
            with profile_range("gdn.p2p bwd summary"):
                add_summary_grads(grads, leaves, needs, h_in, dh_out, ctx.scale, ctx.chunk_size)
        if send is not None:
            send.wait()
        grads = [
            gr.to(x.dtype) if gr is not None else None for gr, x in zip(grads, (q, k, v, g, beta))
        ]
        return (*grads, None, None, None)


def local_output_grads(
    inputs: tuple[torch.Tensor, ...], needs: tuple[bool, ...], h_in: torch.Tensor | None,
    do: torch.Tensor, scale: float, chunk_size: int, backend: str,
    options: GDNKernelOptions | None = None,
) -> tuple[list[torch.Tensor | None], torch.Tensor | None, list[torch.Tensor]]:
    """Backward of a rank's local output ``o = GDN(q, k, v, g, beta; H_in)`` alone (recomputed).

    Args:
        inputs: ``(q, k, v, g, beta)`` as saved by the forward; needs: which need a gradient.
        h_in: ``[B, HV, K, V]`` the state that entered the rank (None: zeros, rank 0).
        do: ``[B, T, HV, V]`` gradient of the output.
        backend, options: the op's backend and kernel options (the plan's).

    Returns:
        ``(grads, dH_in_local, leaves)``: the five input gradients of the local output (None
        where not needed), ``dH_in_local [B, HV, K, V]`` (None when ``h_in`` is None) and the
        detached leaves (for :func:`add_summary_grads`).
    """
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(need) for x, need in zip(inputs, needs)]
        h_leaf = None if h_in is None else h_in.detach().requires_grad_(True)
        o, _ = chunk_gated_delta_rule(
            *leaves, scale=scale, initial_state=h_leaf, use_qk_l2norm=True,
            chunk_size=chunk_size, backend=backend, options=options,
        )
        wanted = [x for x in leaves if x.requires_grad] + ([h_leaf] if h_leaf is not None else [])
        local = list(torch.autograd.grad(o, wanted, do, allow_unused=True))
    dh_in_local = local.pop() if h_leaf is not None else None
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    it = iter(local)
    for i, need in enumerate(needs):
        if need:
            grads[i] = next(it)
    return grads, dh_in_local, leaves


def add_summary_grads(
    grads: list[torch.Tensor | None], leaves: list[torch.Tensor], needs: tuple[bool, ...],
    h_in: torch.Tensor | None, dh_out: torch.Tensor, scale: float, chunk_size: int,
) -> None:
    """Add (in ``grads``, in place) the gradient through the rank's summary ``(M, S)`` that
    produced ``H_out = M H_in + S``, given ``dH_out [B, HV, K, V]``: ``dM = dH_out H_in^T``,
    ``dS = dH_out`` (``M`` is skipped when ``h_in`` is None: it multiplied zeros)."""
    with torch.enable_grad():
        prep = prepare_chunks(*leaves, scale, True, chunk_size)
        m2, s2 = summarize(prep)
        outs, gouts = [s2], [dh_out.to(s2.dtype)]
        if h_in is not None:
            outs.append(m2)
            gouts.append(dh_out.to(m2.dtype) @ h_in.to(m2.dtype).transpose(-1, -2))
        targets = [x for x in leaves if x.requires_grad]
        extra = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
    it = iter(extra)
    for i, need in enumerate(needs):
        if need:
            e = next(it)
            if e is not None:
                grads[i] = e if grads[i] is None else grads[i] + e


class _ChainLink(StateLink):
    """The Triton op's state hooks wired to the CP neighbours, for one forward or backward.

    ``recv_from`` (a CP rank or None) gets its receive posted at construction, before the local
    work: the forward's ``H_in`` from ``r - 1``, the backward's ``dH_out`` from ``r + 1``.
    """

    min_segments = 2

    def __init__(self, plan: GDNCPPlan, state_shape: tuple[int, ...], device: torch.device,
                 recv_from: int | None, what: str) -> None:
        self.plan, self.rank, self.world = plan, plan.rank, plan.cp_size
        self.recv: Any = None
        self.buf: torch.Tensor | None = None
        self.send: Any = None
        if recv_from is not None:
            self.buf = torch.empty(state_shape, dtype=torch.float32, device=device)
            self.recv = post_recv(self.buf, recv_from, plan, what)

    def _take(self) -> torch.Tensor | None:
        if self.recv is None:
            return None
        self.recv.wait()
        self.recv = None
        return self.buf

    # forward: H from rank - 1, H_out to rank + 1
    def entering_state(self) -> torch.Tensor | None:
        return self._take()

    def leaving_state(self, h_out: torch.Tensor) -> None:
        if self.rank < self.world - 1:
            self.send = post_send(h_out, self.rank + 1, self.plan, "gdn p2p forward H_out")

    # backward: dH_out from rank + 1, dH_in to rank - 1
    def leaving_state_grad(self) -> torch.Tensor | None:
        return self._take()

    def entering_state_grad(self, dh_in: torch.Tensor) -> None:
        if self.rank > 0:
            self.send = post_send(dh_in, self.rank - 1, self.plan, "gdn p2p backward dH_in")

    def finish(self) -> None:
        """Wait the send (late: after the local work that followed it)."""
        if self.send is not None:
            self.send.wait()
            self.send = None


class TritonStateChain(torch.autograd.Function):
    """``apply(q, k, v, g, beta, plan, scale) -> o [B, T, HV, V]`` with the Triton op's chain
    continued across ranks (module docstring, ``backend="triton"``). Shapes as
    :class:`GDNStateChain`; q/k/v/beta bf16/fp16/fp32, g fp32; ``T`` a multiple of 64."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, plan: GDNCPPlan, scale: float,
    ) -> torch.Tensor:
        from overlap_runtime.ops.gdn.triton.function import gdn_forward

        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        shape = (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
        rank = plan.rank  # H_in is posted before the local work, so it lands while we prepare
        link = _ChainLink(plan, shape, q.device, rank - 1 if rank > 0 else None,
                          "gdn p2p forward H_in")
        o, _, saved, meta = gdn_forward(q, k, v, g, beta, None, scale, True, link=link,
                                        **plan.triton_kwargs())
        link.finish()
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.plan, ctx.state_shape = meta, plan, shape
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        from overlap_runtime.ops.gdn.triton.function import gdn_backward

        plan: GDNCPPlan = ctx.plan
        rank = plan.rank  # dH_out is posted first; the local work before it needs none
        link = _ChainLink(plan, ctx.state_shape, do.device,
                          rank + 1 if rank < plan.cp_size - 1 else None,
                          "gdn p2p backward dH_out")
        dq, dk, dv, dg, dbeta, _ = gdn_backward(ctx.saved_tensors, ctx.meta, do, None,
                                                link=link)
        link.finish()
        return dq, dk, dv, dg, dbeta, None, None


def gdn_state_chain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: GDNCPPlan,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Validate, check the backend (raises, never falls back), then run :class:`GDNStateChain`.

    The checks run before any state message, on every rank alike (same shapes), so a refusal
    raises everywhere instead of leaving a peer waiting.

    Returns:
        o ``[B, T_local, HV, V]`` in v's dtype.
    """
    check_state_passing_call(q, k, v, g, beta, plan, chunk_size, "p2p")
    scale = q.shape[-1] ** -0.5
    if plan.backend == "triton":
        return TritonStateChain.apply(q, k, v, g, beta, plan, scale)
    return GDNStateChain.apply(q, k, v, g, beta, plan, scale, chunk_size)


class P2PGDNMixer(ContextParallelGDNMixer):
    """Sequence mixer of ``mode="p2p"`` (see the module docstring)."""

    triton_min_segments = _ChainLink.min_segments

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's shard ``proj`` (``[B, T_local, ...]``) -> ``o [B, T_local, HV, V]``."""
        q, k, v, g, beta = local_core_inputs(layer, self.plan, proj, mask)
        return gdn_state_chain(q, k, v, g, beta, self.plan, layer.chunk_size)

    def forward_packed(self, layer: GatedDeltaNet, proj: GDNProjections,
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed batch (global ``cu_seqlens``): the chain with per-document maps
        (``gdn/varlen.py``) -> ``o [B, T_local, HV, V]``."""
        from .varlen import PackedStateChain, packed_shard_inputs

        plan = self.plan
        pieces, (q, k, v, g, beta) = packed_shard_inputs(layer, plan, proj, mask, cu_seqlens)
        return PackedStateChain.apply(q, k, v, g, beta, pieces, plan, q.shape[-1] ** -0.5,
                                      layer.chunk_size)
