"""The conv halo of GDN context parallelism: one autograd Function over three local convs.

The layer's depthwise causal conv (kernel ``k``, dilation ``d``) reads ``halo = (k - 1) * d``
positions before each token. On a contiguous shard the first ``halo`` tokens' windows reach
into the previous rank, so that rank's last ``halo`` rows of ``mixed_qkv`` travel point to
point, ``r -> r + 1``, inside :class:`HaloConv` (rank 0 uses zeros, which equal the causal
padding of the unsplit conv); in the backward their gradient goes back ``r + 1 -> r`` and is
added in place to the last ``halo`` rows of the previous rank's input gradient.

The conv itself is a local backend, picked by the layer and the shard's layout:

* :class:`TorchConv` (``conv_backend="torch"``, whole rows): the shard goes into the conv's
  padded layout once (``F.pad``, the copy the single-device conv makes too) while the halo
  travels, the received halo fills the pad; backward through ``convolution_backward``, whose
  padded-input gradient holds the halo's. No concatenation of the shard with its halo and no
  second full-size gradient to accumulate (a separate exchange followed by ``torch.cat`` cost
  two full-shard passes each way, ~2 ms per layer at 16K tokens on an H200). Its output is the
  pre-activation ``[B, C, L]``; SiLU follows in autograd.
* :class:`TritonConv` (``conv_backend="triton"``, whole rows): the single-device kernels
  (``ops.causal_conv``) with the received halo as ``left``, SiLU fused; their ``d_left`` is the
  halo's gradient.
* :class:`DocumentConv` (document pieces, either conv backend): the conv tap by tap, each tap
  kept only where its token is in the output token's document (:func:`document_causal_conv`),
  so no window crosses a document start, inside the shard or across the rank boundary; its
  backward recomputes the taps under autograd.

Message order (the invariant of ``common.post_recv``): the halo is the first message of a
forward between two neighbours (before the state chain's ``H``) and its gradient the last of
the backward (autograd reaches the conv after the state-passing op).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections

from .common import GDNCPPlan, check_halo, post_recv, post_send

LeftFn = Callable[[], "torch.Tensor | None"]


def _post_halo(x: torch.Tensor, halo: int, plan: GDNCPPlan
               ) -> tuple[torch.Tensor | None, Any, Any]:
    """Post the halo exchange of a shard ``x [B, L, C]``: receive the previous rank's last
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


class TorchConv:
    """``F.conv1d`` on the padded shard (module docstring); output ``[B, C, L]`` before SiLU.

    Args:
        dilation: the conv's dilation; halo: ``(kernel - 1) * dilation``.
    """

    def __init__(self, dilation: int, halo: int) -> None:
        self.dilation, self.halo = dilation, halo

    def check(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """No rule beyond the layer's."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, left: LeftFn
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """x ``[B, L, C]``, weight ``[C, 1, k]``, ``left()`` the halo ``[B, halo, C]`` or None
        -> (pre-activation ``[B, C, L]``, saved)."""
        halo = self.halo
        xp = F.pad(x.transpose(1, 2), (halo, 0))  # [B, C, halo + L], while the halo travels
        buf = left()
        if buf is not None:
            xp[:, :, :halo].copy_(buf.transpose(1, 2))
        out = F.conv1d(xp, weight, None, 1, 0, self.dilation, x.shape[2])
        return out, (xp, weight)

    def backward(self, saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor,
                 need_weight: bool, need_left: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``grad_out [B, C, L]`` -> (grad_x ``[B, L, C]`` (a view: the caller makes it
        contiguous after posting the halo's gradient), grad_weight, grad_left ``[B, halo, C]``)."""
        xp, weight = saved
        halo = self.halo
        grad_xp, grad_w, _ = torch.ops.aten.convolution_backward(
            grad_out.contiguous(), xp, weight, None, [1], [0], [self.dilation], False, [0],
            weight.shape[0], [True, need_weight, False])
        grad_left = grad_xp[:, :, :halo].transpose(1, 2) if need_left else None
        return grad_xp[:, :, halo:].transpose(1, 2), grad_w, grad_left


class TritonConv(TorchConv):
    """The single-device Triton kernels with the halo as ``left``; output ``[B, L, C]``,
    SiLU applied. The weight enters as ``[C, 1, k]`` (its gradient too)."""

    def check(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """The kernels' rules, before any message: the same shapes on every rank, so every
        rank raises here alike and no peer is left waiting."""
        from overlap_runtime.ops.causal_conv import check_causal_conv_inputs

        check_causal_conv_inputs(x, weight[:, 0, :], None, self.dilation)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, left: LeftFn
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        from overlap_runtime.ops.causal_conv import causal_conv_silu_forward

        buf = left()
        return causal_conv_silu_forward(x, weight[:, 0, :], buf, self.dilation), (x, weight, buf)

    def backward(self, saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor,
                 need_weight: bool, need_left: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        from overlap_runtime.ops.causal_conv import causal_conv_silu_backward

        x, weight, buf = saved
        grad_x, grad_w, grad_left = causal_conv_silu_backward(
            grad_out, x, weight[:, 0, :], buf, self.dilation, need_weight=need_weight,
            need_left=need_left and buf is not None)
        return grad_x, None if grad_w is None else grad_w.unsqueeze(1), grad_left


class DocumentConv(TorchConv):
    """The conv kept inside documents (:func:`document_causal_conv`); output ``[B, L, C]``,
    SiLU applied.

    Args:
        doc_ids: ``[B, halo + L]`` int64 document of the halo positions and the shard's tokens
            (``varlen.ShardTable.doc_ids``).
    """

    def __init__(self, dilation: int, halo: int, doc_ids: torch.Tensor) -> None:
        super().__init__(dilation, halo)
        self.doc_ids = doc_ids

    def forward(self, x: torch.Tensor, weight: torch.Tensor, left: LeftFn
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        buf = left()
        if buf is None:  # rank 0: nothing before; the taps there are outside every document
            buf = x.new_zeros(x.shape[0], self.halo, x.shape[2])
        out = document_causal_conv(x, weight[:, 0, :], buf, self.doc_ids, self.dilation)
        return out, (x, weight, buf)

    def backward(self, saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor,
                 need_weight: bool, need_left: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x, weight, buf = saved
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True), weight.detach().requires_grad_(need_weight),
                      buf.detach().requires_grad_(need_left)]
            out = document_causal_conv(leaves[0], leaves[1][:, 0, :], leaves[2], self.doc_ids,
                                       self.dilation)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        grad_x = next(grads)
        grad_w = next(grads) if need_weight else None
        grad_left = next(grads) if need_left else None
        return grad_x, grad_w, grad_left


class HaloConv(torch.autograd.Function):
    """``apply(x, weight, conv, plan) -> y``: the local ``conv`` of this rank's shard ``x [B, L,
    C]`` (``weight [C, 1, k]``) with the previous rank's last ``halo`` rows as its left context,
    exchanged point to point inside the op (module docstring). ``y`` is ``conv``'s output
    (:class:`TorchConv`: ``[B, C, L]`` before SiLU; the others ``[B, L, C]`` after it), in x's
    dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, conv: TorchConv,
                plan: GDNCPPlan) -> torch.Tensor:
        conv.check(x, weight)
        buf, recv, send = _post_halo(x, conv.halo, plan)

        def left() -> torch.Tensor | None:
            if recv is not None:
                recv.wait()
            return buf

        out, saved = conv.forward(x, weight, left)
        if send is not None:
            send.wait()
        ctx.save_for_backward(*saved)
        ctx.conv, ctx.plan = conv, plan
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: GDNCPPlan = ctx.plan
        conv: TorchConv = ctx.conv
        halo = conv.halo
        grad_x, grad_w, grad_left = conv.backward(ctx.saved_tensors, grad_out,
                                                  ctx.needs_input_grad[1], plan.rank > 0)
        send = recv = tail = None
        if grad_left is not None:  # the halo's gradient goes back to the previous rank
            send = post_send(grad_left, plan.rank - 1, plan, "gdn halo conv backward (halo grad)")
        if plan.rank < plan.cp_size - 1:  # and ours comes from the next one
            tail = grad_x.new_empty(grad_x.shape[0], halo, grad_x.shape[-1])
            recv = post_recv(tail, plan.rank + 1, plan, "gdn halo conv backward (halo grad)")
        # [B, L, C] contiguous: a strided gradient starting ``halo`` elements in sends the
        # projection's backward GEMMs to align-1 kernels (2x slower on an H200); the
        # single-device conv's backward makes the same copy.
        grad_x = grad_x.contiguous()
        if recv is not None:
            recv.wait()
            grad_x[:, grad_x.shape[1] - halo:] += tail
        if send is not None:
            send.wait()
        return grad_x, grad_w, None, None


def document_causal_conv(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor,
                         doc_ids: torch.Tensor, dilation: int) -> torch.Tensor:
    """Causal depthwise conv + SiLU whose windows stop at document starts.

    Args:
        x: ``[B, L, C]``; weight: ``[C, k]``; left: ``[B, halo, C]`` positions before x
            (``halo = (k - 1) * dilation``).
        doc_ids: ``[B, halo + L]`` document of every position of ``[left | x]``.

    Returns:
        ``[B, L, C]`` in x's dtype: tap ``j`` (lag ``halo - j * dilation``) adds
        ``w[:, j] * x[t - lag]`` only where ``x[t - lag]`` is in ``t``'s document.
    """
    length = x.shape[1]
    halo = left.shape[1]
    xp = torch.cat([left, x], dim=1)  # [B, halo + L, C]
    own = doc_ids[:, halo:]  # [B, L]
    out = None
    for j in range(weight.shape[1]):
        off = j * dilation
        x_tap = xp[:, off:off + length]
        same = (doc_ids[:, off:off + length] == own).to(xp.device)[..., None]
        term = torch.where(same, x_tap, 0.0) * weight[:, j]
        out = term if out is None else out + term
    return F.silu(out)


def _halo_conv_qkv(layer: GatedDeltaNet, mixed_qkv: torch.Tensor, plan: GDNCPPlan,
                  doc_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal conv of a sequence shard with the previous rank's halo, then split into q, k, v.

    Args:
        mixed_qkv: ``[B, L, conv_dim]`` projections before the conv.
        doc_ids: ``[B, halo + L]`` the shard's document ids (``ShardTable.doc_ids``; the conv
            stays inside documents), or None for whole rows.

    Returns:
        q, k ``[B, L, H, K]``, v ``[B, L, HV, V]`` in mixed_qkv's dtype.
    """
    check_halo(layer, mixed_qkv.shape[1], plan)
    halo, dilation = layer.conv_halo, layer.conv1d.dilation[0]
    weight = layer.conv1d.weight  # [C, 1, k]
    if doc_ids is not None:
        conv: TorchConv = DocumentConv(dilation, halo, doc_ids)
        if halo == 0 or plan.cp_size == 1:  # no message: the conv alone, in autograd
            left = mixed_qkv.new_zeros(mixed_qkv.shape[0], halo, mixed_qkv.shape[2])
            return layer.split_qkv(document_causal_conv(mixed_qkv, weight[:, 0, :], left,
                                                        doc_ids, dilation))
        return layer.split_qkv(HaloConv.apply(mixed_qkv, weight, conv, plan))
    if halo == 0 or plan.cp_size == 1:
        return layer.split_qkv(layer.causal_conv(mixed_qkv))
    if layer.conv_backend == "triton":  # the single-device kernels, the same arithmetic
        return layer.split_qkv(HaloConv.apply(mixed_qkv, weight, TritonConv(dilation, halo),
                                              plan))
    pre = HaloConv.apply(mixed_qkv, weight, TorchConv(dilation, halo), plan)
    return layer.split_qkv(F.silu(pre).transpose(1, 2))


def local_core_inputs(
    layer: GatedDeltaNet, plan: GDNCPPlan, proj: GDNProjections, mask: torch.Tensor | None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GDN core's inputs on a contiguous shard (p2p, all_gather, prefix_scan): halo conv,
    split, gates.

    Args:
        proj: the layer's projections of this rank's masked shard (``mixed_qkv``
            ``[B, L, conv_dim]``, ``a``, ``b`` ``[B, L, HV]``).
        mask: ``[B, L]`` (1 real, 0 pad) or None.
        doc_ids: the shard's document ids for a packed batch (None: whole rows).

    Returns:
        ``(q, k [B, L, H, K], v [B, L, HV, V], g [B, L, HV] fp32, beta [B, L, HV])``.
    """
    q, k, v = _halo_conv_qkv(layer, proj.mixed_qkv, plan, doc_ids)
    g, beta = layer.gates(proj.a, proj.b, mask=mask)
    return q, k, v, g, beta
