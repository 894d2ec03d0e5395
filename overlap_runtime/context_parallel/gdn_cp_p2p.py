"""State-P2P GDN context parallelism: conv halo, affine summaries, a short state chain.

Every rank keeps all heads and its contiguous sequence shard. Only two things cross ranks: the
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

``backend="triton"`` runs the same chain with the Triton kernels
(``overlap_runtime.ops.gdn.triton``; the summaries there are forward-only, so the backward is
arranged around the chunk op's own backward)::

    forward   M, S  = triton.state_summary(q, k, v, g, beta)        (r < P-1), fp32
              H_out = triton.apply_summary(M, S, H_in) -> isend
              o     = chunk_gated_delta_rule(..., initial_state=H_in, backend="triton")  no graph
    backward  post irecv dH_out (r < P-1)
              dH_in_local = triton.output_state_grad(q, k, v, g, beta, dO)   (r > 0, no dH_out)
              wait dH_out
              dH_in = triton.apply_summary_backward(M, dH_out, dH_in_local) -> isend   (r > 0)
              o, H_out = chunk_gated_delta_rule(..., initial_state=H_in, backend="triton")
              autograd.grad((o, H_out), inputs, (dO, dH_out))     every input gradient at once

The last step is exact: ``H_out = M H_in + S`` is the op's final state, so its gradient with
``dH_out`` is the summary's gradient with ``dM = dH_out H_in^T, dS = dH_out``; the op's backward
(fp32 state gradients) sums it with the local output's. Cost against one device on the same local
length: forward + one summary; backward + ``output_state_grad`` (prepare + one reverse state walk)
+ one recomputed forward (the op's graph is not kept from the forward, as in eager). Only the
summary / ``output_state_grad`` and the P applies sit before the chain's sends.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_runtime.models.gated_deltanet import GatedDeltaNet
from overlap_runtime.ops.gdn import (
    apply_summary,
    apply_summary_backward,
    chunk_gated_delta_rule,
    chunk_output,
    get_backend,
    prepare_chunks,
    summarize,
    validate_inputs,
)

from .gdn_cp_common import GDNCPPlan, halo_conv_qkv, post_recv, post_send

__all__ = ["GDNStateChain", "gdn_state_chain", "p2p_forward"]


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
        fused = plan.backend == "triton"
        prep = None if fused else prepare_chunks(q, k, v, g, beta, scale, True, chunk_size)
        m = s = None
        if rank < world - 1:
            if fused:
                m, s = _triton().state_summary(q, k, v, g, beta, True, chunk_size)
            else:
                m, s = summarize(prep)
        if recv is not None:
            recv.wait()
        send = None
        if rank < world - 1:
            if h_in is None:
                h_out = s
            elif fused:
                h_out = _triton().apply_summary(m, s, h_in)
            else:
                h_out = apply_summary(m, s, h_in)
            send = post_send(h_out, rank + 1, plan, "gdn p2p forward H_out")
        if fused:  # grad mode is off in forward: no graph is kept
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h_in,
                                          use_qk_l2norm=True, chunk_size=chunk_size,
                                          backend=plan.backend)
        else:
            o, _ = chunk_output(prep, h_in)
        if send is not None:
            send.wait()  # late: the local output ran while the state travelled
        ctx.save_for_backward(q, k, v, g, beta, h_in, m)
        ctx.plan, ctx.scale, ctx.chunk_size = plan, scale, chunk_size
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.plan.backend == "triton":
            return _triton_backward(ctx, do)
        q, k, v, g, beta, h_in, m = ctx.saved_tensors
        plan: GDNCPPlan = ctx.plan
        rank, world = plan.rank, plan.cp_size
        recv = dh_out = None
        if rank < world - 1:  # posted first; the local backward below does not need it
            dh_out = m.new_empty((v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]))
            recv = post_recv(dh_out, rank + 1, plan, "gdn p2p backward dH_out")
        needs = ctx.needs_input_grad[:5]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(need) for x, need in zip((q, k, v, g, beta), needs)]
            h_leaf = None if h_in is None else h_in.detach().requires_grad_(True)
            o, _ = chunk_gated_delta_rule(
                *leaves, scale=ctx.scale, initial_state=h_leaf, use_qk_l2norm=True,
                chunk_size=ctx.chunk_size, backend=plan.backend,
            )
            wanted = [x for x in leaves if x.requires_grad] + ([h_leaf] if h_leaf is not None else [])
            local = list(torch.autograd.grad(o, wanted, do, allow_unused=True))
        dh_in_local = local.pop() if h_leaf is not None else None
        grads: list[torch.Tensor | None] = [None] * 5
        it = iter(local)
        for i, need in enumerate(needs):
            if need:
                grads[i] = next(it)

        send = None
        if recv is not None:
            recv.wait()
        if rank > 0:
            if dh_out is None:  # last rank: nothing after it
                dh_in = dh_in_local
            else:
                dh_in = apply_summary_backward(m, dh_out, dh_in_local)
            send = post_send(dh_in, rank - 1, plan, "gdn p2p backward dH_in")

        if dh_out is not None and any(needs):
            # Gradient through the summary (M, S) that produced H_out.
            with torch.enable_grad():
                prep = prepare_chunks(*leaves, ctx.scale, True, ctx.chunk_size)
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
        if send is not None:
            send.wait()
        grads = [
            gr.to(x.dtype) if gr is not None else None for gr, x in zip(grads, (q, k, v, g, beta))
        ]
        return (*grads, None, None, None)


def _triton() -> Any:
    """``overlap_runtime.ops.gdn.triton`` (its names import triton on first use only)."""
    from overlap_runtime.ops.gdn import triton as fused

    return fused


def _triton_backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Backward of the chain with the Triton kernels (module docstring, ``backend="triton"``).

    The Triton summaries are forward-only, so the summary's gradient is not taken through them:
    it is the gradient of the chunk op's final state (``M H_in + S``) given ``dH_out``, which the
    op's backward returns together with the local output's gradients in one pass.
    """
    q, k, v, g, beta, h_in, m = ctx.saved_tensors
    plan: GDNCPPlan = ctx.plan
    rank, world = plan.rank, plan.cp_size
    fused = _triton()
    recv = dh_out = None
    if rank < world - 1:  # posted first, as in the eager backward
        dh_out = m.new_empty((v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]))
        recv = post_recv(dh_out, rank + 1, plan, "gdn p2p backward dH_out")
    dh_in_local = None
    if rank > 0:  # needs no dH_out: runs while the chain's later ranks work
        dh_in_local = fused.output_state_grad(q, k, v, g, beta, do, ctx.scale, True,
                                              ctx.chunk_size)
    if recv is not None:
        recv.wait()
    send = None
    if rank > 0:
        dh_in = (dh_in_local if dh_out is None
                 else fused.apply_summary_backward(m, dh_out, dh_in_local))
        send = post_send(dh_in, rank - 1, plan, "gdn p2p backward dH_in")

    needs = ctx.needs_input_grad[:5]
    grads: list[torch.Tensor | None] = [None] * 5
    if any(needs):
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(need) for x, need in zip((q, k, v, g, beta), needs)]
            o, h_out = chunk_gated_delta_rule(
                *leaves, scale=ctx.scale, initial_state=h_in, output_final_state=True,
                use_qk_l2norm=True, chunk_size=ctx.chunk_size, backend=plan.backend,
            )
            outs, gouts = [o], [do]
            if dh_out is not None:  # the summary's part: d<dH_out, M H_in + S>
                outs.append(h_out)
                gouts.append(dh_out)
            wanted = [x for x in leaves if x.requires_grad]
            local = iter(torch.autograd.grad(outs, wanted, gouts, allow_unused=True))
        for i, need in enumerate(needs):
            if need:
                grads[i] = next(local)
    if send is not None:
        send.wait()
    grads = [
        gr.to(x.dtype) if gr is not None else None for gr, x in zip(grads, (q, k, v, g, beta))
    ]
    return (*grads, None, None, None)


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
    validate_inputs(q, k, v, g, beta, None, chunk_size)
    impl = get_backend(plan.backend)
    state = q.new_empty((1, 1, q.shape[-1], v.shape[-1]), dtype=torch.promote_types(
        q.dtype, torch.float32))  # H_in's dtype and layout, for the backend's rules
    impl.check(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
    if plan.backend not in ("eager", "triton"):  # pragma: no cover - the registry holds these two
        raise NotImplementedError(
            f"mode='p2p' with backend={plan.backend!r}: the state chain knows the 'eager' and "
            "'triton' local kernels only"
        )
    scale = q.shape[-1] ** -0.5
    return GDNStateChain.apply(q, k, v, g, beta, plan, scale, chunk_size)


def p2p_forward(
    module: GatedDeltaNet, plan: GDNCPPlan, hidden: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The whole layer on a local shard ``[B, T_local, hidden] -> [B, T_local, hidden]``."""
    hidden = module.mask_input(hidden, mask)
    proj = module.project(hidden)
    q, k, v = halo_conv_qkv(module, proj.mixed_qkv, plan)
    g, beta = module.gates(proj.a, proj.b, mask=mask)
    o = gdn_state_chain(q, k, v, g, beta, plan, module.chunk_size)
    return module.finish(o, proj.z, mask)
