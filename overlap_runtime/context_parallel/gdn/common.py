"""Shared pieces of GDN context parallelism: the plan, the CP mixers' base, point-to-point
helpers, the halo conv.

:class:`GDNCPPlan` is the immutable configuration one ``LinearAttentionContextParallel.apply``
binds to a layer (mode, backend, process group, timeouts); the sequence mixer ``apply`` installs
on the layer holds it (:class:`ContextParallelGDNMixer`, one subclass per mode, each an
implementation of the strategy protocol of ``overlap_runtime.layers.sequence_mixer``). Nothing per call is stored on the plan, the mixer or
the layer: ranks are read from the group at each call, tensors travel as arguments.

Sequence layout: contiguous. Rank ``r`` of ``P`` holds tokens ``[r*S/P, (r+1)*S/P)`` (the GDN
recurrence and the causal conv run left to right, so rank ``r``'s tokens directly follow rank
``r-1``'s; a zigzag layout is not supported by these modes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.layers.sequence_mixer import GDNSequenceMixer, MixerInputs, check_layer_inputs
from overlap_runtime.ops import comm
from overlap_runtime.ops.gdn import GDNKernelOptions

__all__ = [
    "GDNCPPlan",
    "ContextParallelGDNMixer",
    "post_recv",
    "post_send",
    "halo_conv_qkv",
    "local_core_inputs",
    "check_halo",
    "check_backend_before_comm",
    "check_ranks_agree_on_call",
    "TRITON_CHUNK",
]

#: The Triton backend's chunk length; with it every rank's shard must be whole chunks.
TRITON_CHUNK = 64


@dataclass(frozen=True)
class GDNCPPlan:
    """What ``LinearAttentionContextParallel.apply`` binds to a layer (never per-call data).

    Attributes:
        mode: ``"ulysses"``, ``"p2p"``, ``"all_gather"`` or ``"prefix_scan"``.
        backend: local GDN backend (``"eager"`` or ``"triton"``).
        group: the CP process group (``cp_mesh.get_group()``).
        cp_size: number of ranks in ``group``.
        mesh: the 1-D CP device mesh (to rebuild DTensor outputs).
        timeout_s: bound of every wait (None: ``comm.DEFAULT_TIMEOUT_S``).
        options: the layer's GDN kernel options (``GatedDeltaNet.kernel_options``), checked
            against mode and backend by ``apply`` and passed to every local op call of the
            mode (None: the backend's defaults).
    """

    mode: str
    backend: str
    group: dist.ProcessGroup
    cp_size: int
    mesh: DeviceMesh
    timeout_s: float | None = None
    options: GDNKernelOptions | None = None

    @property
    def rank(self) -> int:
        """This process's rank in the CP group (read from the group on every call)."""
        return dist.get_rank(self.group)


class ContextParallelGDNMixer(GDNSequenceMixer):
    """Base of the CP sequence mixers: the CP boundary and the checks before any communication.

    :meth:`prepare_inputs` takes this rank's contiguous shard ``[B, S/P, hidden]`` (a tensor, or
    a DTensor on the CP mesh placed ``Shard(1)``) and its mask slice ``[B, S/P]``, makes the
    ranks compare their calls (:func:`check_ranks_agree_on_call`, the first collective of every
    forward), checks the shapes and the backend's rules (:func:`check_backend_before_comm`) on
    every rank at the same point, and returns plain local tensors; ``restore`` gives the output the input's form. Each
    mode implements ``forward(layer, proj, mask) -> o [B, S/P, HV, V]``.

    Args:
        plan: the configuration ``LinearAttentionContextParallel.apply`` binds.
    """

    #: With ``backend="triton"``: the fewest scan segments per rank the mode's dense path
    #: runs the op with (its ``StateLink.min_segments``); a smaller ``num_segments`` option
    #: would be overridden, so ``apply`` refuses it.
    triton_min_segments: int = 1

    def __init__(self, plan: GDNCPPlan) -> None:
        super().__init__()
        self.plan = plan

    @property
    def mode(self) -> str:
        """The CP mode (``"ulysses"``, ``"p2p"``, ``"all_gather"`` or ``"prefix_scan"``)."""
        return self.plan.mode

    def extra_repr(self) -> str:
        return f"mode={self.plan.mode!r}, backend={self.plan.backend!r}, cp={self.plan.cp_size}"

    def prepare_inputs(self, layer: GatedDeltaNet, hidden_states: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> MixerInputs:
        local, was_dtensor = _to_local(hidden_states, self.plan, "hidden_states")
        mask = None
        if attention_mask is not None:
            mask, _ = _to_local(attention_mask, self.plan, "attention_mask")
        check_ranks_agree_on_call(layer, local, mask, self.plan)
        check_layer_inputs(layer, local, mask, seq="S/P", where=" (this rank's slice)")
        check_backend_before_comm(layer, local, self.plan)
        return MixerInputs(local, mask, self._as_dtensor if was_dtensor else _same_form)

    def _as_dtensor(self, out: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(out, self.plan.mesh, [Shard(1)], run_check=False)


def _same_form(out: torch.Tensor) -> torch.Tensor:
    return out


def _to_local(x: torch.Tensor, plan: GDNCPPlan, name: str) -> tuple[torch.Tensor, bool]:
    """A DTensor on the CP mesh placed ``Shard(1)`` -> its local shard; tensors pass through."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(x, DTensor):
        return x, False
    placements = tuple(x.placements)
    if placements != (Shard(1),):
        raise ValueError(
            f"{name} is a DTensor placed {placements}; GDN context parallelism needs the "
            "sequence dim sharded, placements (Shard(1),)"
        )
    if x.device_mesh != plan.mesh:
        raise ValueError(f"{name} lives on mesh {x.device_mesh}, not the CP mesh {plan.mesh}")
    return x.to_local(), True


def post_recv(buf: torch.Tensor, src: int, plan: GDNCPPlan, what: str) -> comm.AsyncHandle:
    """Post ``irecv(buf)`` from CP rank ``src``; the returned handle waits with a bound.

    P2P ordering (the invariant that keeps the chain hang-free, also under activation-checkpoint
    recompute): between two neighbours every message of one direction is posted in the same
    program order on both sides - forward ``halo`` then ``H`` (rank r -> r+1), backward ``dH``
    then ``halo grad`` (r+1 -> r) - so untagged gloo/NCCL/HCCL matching pairs them correctly.
    """
    return comm.irecv(buf, src, plan.group, timeout_s=plan.timeout_s, what=what)


def post_send(x: torch.Tensor, dst: int, plan: GDNCPPlan, what: str) -> comm.AsyncHandle:
    """Post ``isend(x)`` to CP rank ``dst``; the handle keeps the sent payload alive until waited."""
    return comm.isend(x, dst, plan.group, timeout_s=plan.timeout_s, what=what)


def check_ranks_agree_on_call(layer: GatedDeltaNet, hidden: torch.Tensor,
                              mask: torch.Tensor | None, plan: GDNCPPlan) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks of the CP group call the
    layer alike: batch size, local sequence length, hidden size, dtype, ``attention_mask``
    (None or its shape), then mode, backend and the layer's heads, head dims and conv kernel.

    Without it a rank with another shard length (Ulysses), batch or dtype (every mode: the halo,
    the state and the summaries have the batch in their shape) posts a message of another size
    and gloo aborts the process. One all-gather of 9 int64 on the CP group per forward
    (``comm.check_ranks_agree``); it runs before every other collective of the forward and
    before the local checks, which then see equal inputs on every rank.
    """
    if plan.cp_size == 1:
        return

    def dim(i: int) -> int | None:
        return int(hidden.shape[i]) if hidden.dim() > i else None

    fields = [
        ("the batch size", dim(0)),
        ("the local sequence length", dim(1)),
        ("the hidden size", dim(2)),
        ("the dtype", hidden.dtype),
        ("attention_mask", None if mask is None else tuple(mask.shape)),
        ("the hidden_states shape", tuple(hidden.shape)),
        ("mode and backend", (plan.mode, plan.backend)),
        ("the layer's heads (key, value) and head dims (K, V)",
         (layer.num_key_heads, layer.num_value_heads, layer.head_k_dim, layer.head_v_dim)),
        ("the conv halo", layer.conv_halo),
    ]
    comm.check_ranks_agree(f"GatedDeltaNet context parallelism (mode={plan.mode!r})", fields,
                           plan.group, device=hidden.device, group_name="cp",
                           timeout_s=plan.timeout_s)


def check_halo(layer: GatedDeltaNet, local_len: int, plan: GDNCPPlan) -> None:
    """Every rank's shard must hold the conv halo: ``local_len >= (kernel - 1) * dilation``."""
    halo = layer.conv_halo
    if local_len < halo:
        raise ValueError(
            f"local sequence {local_len} is shorter than the conv halo {halo} "
            f"((kernel {layer.conv_kernel_size} - 1) * dilation {layer.conv1d.dilation[0]}; "
            f"mode={plan.mode!r}, cp={plan.cp_size}): each rank must hold at least the halo"
        )


def check_backend_before_comm(layer: GatedDeltaNet, hidden: torch.Tensor, plan: GDNCPPlan) -> None:
    """The local GDN backend's rules, checked before any communication (same shapes on every
    rank, so every rank raises at the same point and no peer is left waiting).

    ``backend="triton"``: the local sequence must be whole 64-token chunks (the chunk grid of
    every rank then lines up with the unsplit sequence's, and the state handed across ranks sits
    on a chunk boundary), then the Triton capability rules (device, dtypes, head dims, chunk
    size; ``triton/capability.py``) on tensors of the layer's shapes. ``backend="eager"``: no
    extra rule. Raises ``NotImplementedError`` naming the value and the rule.

    Args:
        hidden: ``[B, T_local, hidden]`` this rank's shard (its dtype and device are the GDN
            inputs').
    """
    if plan.backend != "triton":
        return
    local_len = hidden.shape[1]
    if local_len % TRITON_CHUNK:
        raise NotImplementedError(
            f"local sequence {local_len} is not a multiple of chunk size {TRITON_CHUNK} "
            f"(backend='triton', mode={plan.mode!r}): pad the global sequence to a multiple of "
            f"{TRITON_CHUNK} * cp = "
            f"{TRITON_CHUNK * plan.cp_size}"
        )
    from overlap_runtime.ops.gdn.triton.capability import check_triton_inputs  # no triton import

    dtype, device = hidden.dtype, hidden.device
    gate_dtype = torch.promote_types(dtype, torch.float32)
    qk = torch.empty(1, 1, 1, layer.head_k_dim, dtype=dtype, device=device)
    v = torch.empty(1, 1, 1, layer.head_v_dim, dtype=dtype, device=device)
    gb = torch.empty(1, 1, 1, dtype=gate_dtype, device=device)
    beta = torch.empty(1, 1, 1, dtype=dtype, device=device)
    state = None
    if plan.mode in ("p2p", "all_gather", "prefix_scan"):  # H_in reaches the op as fp32
        state = torch.empty(1, 1, layer.head_k_dim, layer.head_v_dim, dtype=gate_dtype,
                            device=device)
    check_triton_inputs(qk, qk, v, gb, beta, state, layer.chunk_size)


def _post_halo(x: torch.Tensor, halo: int, plan: GDNCPPlan
               ) -> tuple[torch.Tensor | None, Any, Any]:
    """Post the halo exchange of a shard ``x [B, T, C]``: receive the previous rank's last
    ``halo`` rows into a new ``[B, halo, C]`` buffer (None on rank 0) and send ours to the next
    rank. Returns ``(buffer, recv, send)``; wait on ``recv`` before reading the buffer."""
    recv = buf = send = None
    if plan.rank > 0:
        buf = x.new_empty(x.shape[0], halo, x.shape[2])
        recv = post_recv(buf, plan.rank - 1, plan, "gdn halo conv forward (halo)")
    if plan.rank < plan.cp_size - 1:
        send = post_send(x[:, x.shape[1] - halo:].contiguous(), plan.rank + 1, plan,
                         "gdn halo conv forward (halo)")
    return buf, recv, send


def _post_halo_grad(grad_left: torch.Tensor | None, like: torch.Tensor, halo: int,
                    plan: GDNCPPlan) -> tuple[torch.Tensor | None, Any, Any]:
    """Post the backward halo exchange: send ``grad_left [B, halo, C]`` (the gradient of the
    rows received in forward) to the previous rank and receive the next rank's into a new
    ``[B, halo, C]`` buffer shaped after ``like [B, *, C]``. Returns ``(tail, recv, send)``."""
    send = recv = tail = None
    if plan.rank > 0:
        send = post_send(grad_left, plan.rank - 1, plan, "gdn halo conv backward (halo grad)")
    if plan.rank < plan.cp_size - 1:
        tail = like.new_empty(like.shape[0], halo, like.shape[-1])
        recv = post_recv(tail, plan.rank + 1, plan, "gdn halo conv backward (halo grad)")
    return tail, recv, send


def _finish_halo_grad(grad_x: torch.Tensor, tail: torch.Tensor | None, recv: Any, send: Any,
                      halo: int) -> None:
    """Add the next rank's halo gradient to the last ``halo`` rows of ``grad_x [B, T, C]`` in
    place, and wait for our own halo gradient to leave."""
    if recv is not None:
        recv.wait()
        grad_x[:, grad_x.shape[1] - halo:] += tail
    if send is not None:
        send.wait()


class _HaloCausalConv(torch.autograd.Function):
    """Depthwise causal conv (pre-activation) of a shard whose left context is the previous
    rank's last ``halo`` positions, exchanged point to point inside the op.

    Forward: the shard goes into the conv's padded layout once (``F.pad``, the copy the
    single-device conv makes too), the received halo fills the pad (rank 0: zeros, the causal
    padding). Backward: ``convolution_backward`` gives the padded input's gradient; its first
    ``halo`` positions go back to the previous rank, and the next rank's halo gradient is added
    in place to the last ``halo`` positions. No concatenation of the shard with its halo and no
    second full-size gradient to accumulate (a separate halo exchange followed by ``torch.cat``
    cost two full-shard passes each way, ~2 ms per layer at 16K tokens on an H200).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dilation: int, halo: int,
                plan: GDNCPPlan) -> torch.Tensor:
        channels = x.shape[2]
        buf, recv, send = _post_halo(x, halo, plan)
        xp = F.pad(x.transpose(1, 2), (halo, 0))  # [B, C, halo + T]
        if recv is not None:
            recv.wait()
            xp[:, :, :halo].copy_(buf.transpose(1, 2))
        out = F.conv1d(xp, weight, None, 1, 0, dilation, channels)
        if send is not None:
            send.wait()
        ctx.save_for_backward(xp, weight)
        ctx.dilation, ctx.halo, ctx.plan = dilation, halo, plan
        return out  # [B, C, T]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xp, weight = ctx.saved_tensors
        plan: GDNCPPlan = ctx.plan
        halo = ctx.halo
        grad_xp, grad_w, _ = torch.ops.aten.convolution_backward(
            grad_out.contiguous(), xp, weight, None, [1], [0], [ctx.dilation], False, [0],
            weight.shape[0], [True, ctx.needs_input_grad[1], False])
        tail, recv, send = _post_halo_grad(grad_xp[:, :, :halo].transpose(1, 2),
                                           grad_xp.transpose(1, 2), halo, plan)
        # [B, T, C] contiguous: the view starts ``halo`` elements in, and a misaligned strided
        # gradient sends the projection's backward GEMMs to align-1 kernels (2x slower on an
        # H200); the single-device conv's backward makes the same copy.
        grad_x = grad_xp[:, :, halo:].transpose(1, 2).contiguous()
        _finish_halo_grad(grad_x, tail, recv, send, halo)
        return grad_x, grad_w, None, None, None


class _HaloTritonConv(torch.autograd.Function):
    """:class:`_HaloCausalConv` for ``conv_backend="triton"``: the same halo messages, and the
    single-device Triton kernels (``ops.causal_conv``) with the received halo as ``left`` (rank
    0: None, the causal padding), SiLU fused. Backward: the kernels' ``d_left`` goes back to the
    previous rank and the next rank's halo gradient is added to the last ``halo`` rows of dx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dilation: int, halo: int,
                plan: GDNCPPlan) -> torch.Tensor:
        from overlap_runtime.ops.causal_conv import (causal_conv_silu_forward,
                                                     check_causal_conv_inputs)

        # the kernels' rules before any message: the same shapes on every rank, so every rank
        # raises here alike and no peer is left waiting
        check_causal_conv_inputs(x, weight, None, dilation)
        left, recv, send = _post_halo(x, halo, plan)
        if recv is not None:
            recv.wait()
        out = causal_conv_silu_forward(x, weight, left, dilation)
        if send is not None:
            send.wait()
        ctx.save_for_backward(x, weight, left)
        ctx.dilation, ctx.halo, ctx.plan = dilation, halo, plan
        return out  # [B, T, C], SiLU applied

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from overlap_runtime.ops.causal_conv import causal_conv_silu_backward

        x, weight, left = ctx.saved_tensors
        grad_x, grad_w, grad_left = causal_conv_silu_backward(
            grad_out, x, weight, left, ctx.dilation, need_weight=ctx.needs_input_grad[1],
            need_left=left is not None)
        _finish_halo_grad(grad_x, *_post_halo_grad(grad_left, grad_x, ctx.halo, ctx.plan),
                          ctx.halo)
        return grad_x, grad_w, None, None, None


def check_state_passing_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              g: torch.Tensor, beta: torch.Tensor, plan: GDNCPPlan,
                              chunk_size: int, mode: str) -> None:
    """The checks of a mode that hands GDN states between ranks (p2p chain, prefix scan),
    before any state message and on every rank alike (same shapes), so a refusal raises
    everywhere instead of leaving a peer waiting: the inputs, the backend's rules for an fp32
    incoming state (``H_in``'s dtype and layout), and a backend the mode knows (eager, triton).
    Raises, never falls back."""
    from overlap_runtime.ops.gdn import get_backend, validate_inputs

    validate_inputs(q, k, v, g, beta, None, chunk_size)
    state = q.new_empty((1, 1, q.shape[-1], v.shape[-1]),
                        dtype=torch.promote_types(q.dtype, torch.float32))
    get_backend(plan.backend).check(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
    if plan.backend not in ("eager", "triton"):  # pragma: no cover - the registry holds these
        raise NotImplementedError(
            f"mode={mode!r} with backend={plan.backend!r}: it knows the 'eager' and 'triton' "
            "local kernels only")


def halo_conv_qkv(
    layer: GatedDeltaNet, mixed_qkv: torch.Tensor, plan: GDNCPPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal conv of a sequence shard with the previous rank's halo, then split into q, k, v.

    Only the last ``conv_halo`` positions of each shard travel, to the next rank (point to
    point, inside :class:`_HaloCausalConv`, or :class:`_HaloTritonConv` for the layer's
    ``conv_backend="triton"``, the single-device kernels); rank 0 uses zeros, which equal the
    causal padding of the unsplit conv. Backward returns the halo's gradient to the previous rank.

    Args:
        mixed_qkv: ``[B, T_local, conv_dim]`` projections before the conv.

    Returns:
        q, k ``[B, T_local, H, K]``, v ``[B, T_local, HV, V]`` in mixed_qkv's dtype.
    """
    check_halo(layer, mixed_qkv.shape[1], plan)
    halo = layer.conv_halo
    if halo == 0 or plan.cp_size == 1:
        return layer.split_qkv(layer.causal_conv(mixed_qkv))
    if layer.conv_backend == "triton":  # the single-device kernels, the same arithmetic
        conv = _HaloTritonConv.apply(mixed_qkv, layer.conv1d.weight[:, 0, :],
                                     layer.conv1d.dilation[0], halo, plan)
        return layer.split_qkv(conv)
    pre = _HaloCausalConv.apply(mixed_qkv, layer.conv1d.weight, layer.conv1d.dilation[0],
                                halo, plan)
    return layer.split_qkv(F.silu(pre).transpose(1, 2))


def local_core_inputs(
    layer: GatedDeltaNet, plan: GDNCPPlan, proj: GDNProjections, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GDN core's inputs on a contiguous shard (p2p, all_gather, prefix_scan): halo conv,
    split, gates.

    Args:
        proj: the layer's projections of this rank's masked shard (``mixed_qkv``
            ``[B, T_local, conv_dim]``, ``a``, ``b`` ``[B, T_local, HV]``).
        mask: ``[B, T_local]`` (1 real, 0 pad) or None.

    Returns:
        ``(q, k [B, T_local, H, K], v [B, T_local, HV, V], g [B, T_local, HV] fp32,
        beta [B, T_local, HV])``.
    """
    q, k, v = halo_conv_qkv(layer, proj.mixed_qkv, plan)
    g, beta = layer.gates(proj.a, proj.b, mask=mask)
    return q, k, v, g, beta
