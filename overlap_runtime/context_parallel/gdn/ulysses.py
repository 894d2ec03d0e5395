"""Ulysses GDN context parallelism: trade the sequence split for a head split around the GDN.

:class:`UlyssesGDNMixer` is the layer's sequence mixer in this mode::

    rank r: hidden [B, S/P, hidden]
      -> local projections (all heads; the layer's)      mixed_qkv, z, a, b
      -> ONE all-to-all (sequence shard -> head shard): q/k/v channels + a + b (+ mask) of the
         heads of rank j go to rank j                    [B, S, channels of rank r's heads]
      -> causal conv over the full sequence with rank r's slice of the conv weight
      -> g, beta with rank r's slice of A_log / dt_bias
      -> local GDN (eager or triton) over the full sequence, rank r's heads
      -> ONE inverse all-to-all (head shard -> sequence shard)       o [B, S/P, HV, V]
      -> gated norm (z stays local) + out projection (the layer's)

The conv runs *after* the all-to-all: it is depthwise, so a head's channels need only their own
full sequence - no halo. Parameters are never copied: the conv weight, A_log and dt_bias are
indexed per rank inside autograd, so each rank's parameter gradients hold its heads' share
(sum them over the CP group, as for every sequence-parallel parameter).

Heads: value heads split evenly (``HV % P == 0``). Key heads split evenly when ``H % P == 0``;
when ``P > H`` (``P % H == 0``) each key head is replicated to the ``P / H`` ranks whose value
heads read it (value head ``j`` reads key head ``j // (HV / H)``, and rank ``r``'s value heads
all read key head ``r // (P / H)``). Replicas' gradients are summed by autograd.
"""

from __future__ import annotations

import torch

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.layers.segments import document_positions
from overlap_runtime.ops import comm

from .common import ContextParallelGDNMixer
from .varlen import check_packed_call


class UlyssesHeadLayout:
    """Which key and value heads each CP rank owns in the head-sharded phase.

    Attributes:
        key_heads: ``key_heads[j]`` int64 key-head indices of rank j (length ``h``).
        value_heads: ``value_heads[j]`` int64 value-head indices of rank j (length ``hv``).
    """

    def __init__(self, key_heads: list[torch.Tensor], value_heads: list[torch.Tensor]) -> None:
        self.key_heads = key_heads
        self.value_heads = value_heads

    @property
    def local_key_heads(self) -> int:
        return int(self.key_heads[0].numel())

    @property
    def local_value_heads(self) -> int:
        return int(self.value_heads[0].numel())


def ulysses_head_layout(num_key_heads: int, num_value_heads: int, cp_size: int) -> UlyssesHeadLayout:
    """Head ownership for Ulysses; raises naming the head counts and ``cp_size`` when impossible."""
    p = cp_size
    if num_value_heads % p:
        raise ValueError(
            f"mode='ulysses' needs num_value_heads % cp == 0, got num_value_heads="
            f"{num_value_heads}, cp={p}; use mode='p2p' or 'all_gather', which keep all heads"
        )
    hv = num_value_heads // p
    if num_key_heads % p == 0:
        h = num_key_heads // p
        keys = [torch.arange(j * h, (j + 1) * h) for j in range(p)]
    elif p % num_key_heads == 0:
        rep = p // num_key_heads
        keys = [torch.tensor([j // rep]) for j in range(p)]
    else:
        raise ValueError(
            f"mode='ulysses' needs num_key_heads % cp == 0 or cp % num_key_heads == 0, got "
            f"num_key_heads={num_key_heads}, cp={p}"
        )
    values = [torch.arange(j * hv, (j + 1) * hv) for j in range(p)]
    return UlyssesHeadLayout(keys, values)


class UlyssesGDNMixer(ContextParallelGDNMixer):
    """Sequence mixer of ``mode="ulysses"`` (see the module docstring)."""

    def forward_packed(self, layer: GatedDeltaNet, proj: GDNProjections,
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed batch: after the all-to-all each rank holds whole rows, so its heads run the
        single-device packed path on them with the global ``cu_seqlens`` (one conv with the
        taps before each document start dropped, one varlen GDN call) -> ``o [B, S/P, HV, V]``."""
        check_packed_call(layer, self.plan, cu_seqlens, *proj.mixed_qkv.shape[:2])
        return self.forward(layer, proj, mask, cu_seqlens)

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """This rank's shard ``proj`` (``[B, S/P, ...]``) -> ``o [B, S/P, HV, V]``.

        ``mask`` ``[B, S/P]`` (1 = real token) rides in the all-to-all as one extra channel, so
        the head-sharded phase sees the full sequence's mask without another collective.
        """
        plan = self.plan
        p, rank = plan.cp_size, plan.rank
        layout = ulysses_head_layout(layer.num_key_heads, layer.num_value_heads, p)
        batch, local_len, _ = proj.mixed_qkv.shape
        dtype, device = proj.mixed_qkv.dtype, proj.mixed_qkv.device

        # Pack, per destination rank j: [conv channels of j's heads | a_j | b_j | mask].
        payloads = []
        for j in range(p):
            channels = layer.conv_channels(layout.key_heads[j], layout.value_heads[j])
            parts = [
                proj.mixed_qkv.index_select(-1, channels.to(device)),
                proj.a.index_select(-1, layout.value_heads[j].to(device)),
                proj.b.index_select(-1, layout.value_heads[j].to(device)),
            ]
            if mask is not None:
                parts.append(mask[..., None].to(dtype))
            payloads.append(torch.cat(parts, dim=-1))
        send = torch.stack(payloads, dim=0)  # [P, B, S/P, W]: row j goes to rank j
        recv = comm.all_to_all_single(send, group=plan.group, timeout_s=plan.timeout_s)
        # row i came from rank i and holds tokens [i*S/P, (i+1)*S/P): rank order = sequence order
        full = recv.permute(1, 0, 2, 3).reshape(batch, p * local_len, send.shape[-1])

        h, hv = layout.local_key_heads, layout.local_value_heads
        n_conv = 2 * h * layer.head_k_dim + hv * layer.head_v_dim
        mixed = full[..., :n_conv]
        a = full[..., n_conv : n_conv + hv]
        b = full[..., n_conv + hv : n_conv + 2 * hv]
        full_mask = full[..., n_conv + 2 * hv].detach() if mask is not None else None

        channels = layer.conv_channels(layout.key_heads[rank], layout.value_heads[rank])

        # whole rows here: packed documents as on one device (LocalGDNMixer.forward_packed)
        positions = (None if cu_seqlens is None
                     else document_positions(cu_seqlens, batch, p * local_len))
        q, k, v = layer.causal_conv_qkv(mixed, channels=channels, doc_positions=positions,
                                        num_key_heads=h, num_value_heads=hv)
        g, beta = layer.gates(a, b, layout.value_heads[rank], full_mask)
        o = layer.core(q, k, v, g, beta, backend=plan.backend, cu_seqlens=cu_seqlens,
                       options=plan.options)  # [B, S, hv, V]

        # Inverse: tokens of rank i go back to rank i; we receive every rank's heads of our
        # tokens.
        o_send = o.reshape(batch, p, local_len, hv * layer.head_v_dim).permute(1, 0, 2, 3)
        o_recv = comm.all_to_all_single(o_send.contiguous(), group=plan.group,
                                        timeout_s=plan.timeout_s)
        # row j holds value heads [j*hv, (j+1)*hv): head order = rank order
        return o_recv.permute(1, 2, 0, 3).reshape(
            batch, local_len, layer.num_value_heads, layer.head_v_dim
        )
