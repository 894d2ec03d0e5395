"""The GDN sequence-mixer strategy: the part of a Gated DeltaNet layer that reads other tokens.

A :class:`~overlap_runtime.layers.gated_deltanet.GatedDeltaNet` layer's forward is::

    hidden, mask, restore = mixer.prepare_inputs(layer, hidden_states, attention_mask)
    proj = layer.project(layer.mask_input(hidden, mask))     token-wise     GDNProjections
    o    = mixer(layer, proj, mask)                           along the sequence   [B, T, HV, V]
    out  = restore(layer.finish(o, proj.z, mask))             token-wise     [B, T, hidden]

with ``mixer = layer.sequence_mixer``. The causal conv and the GDN recurrence are the only steps
that read other tokens, so they, and only they, are the strategy: :class:`LocalGDNMixer` (the
default) runs them on one device; ``context_parallel.LinearAttentionContextParallel.apply``
swaps in a mixer of one CP mode (ulysses, p2p, all_gather) that runs them across the ranks of a
CP group, the way ``ContextParallel.apply`` swaps an attention layer's ``core_attention``.

The protocol (:class:`GDNSequenceMixer`)
----------------------------------------
``prepare_inputs(layer, hidden_states, attention_mask) -> MixerInputs``
    Called first, before anything runs. Checks the call (shapes; a CP mixer also its backend's
    rules, on every rank at the same point, so no peer is left waiting) and returns the plain
    tensors the layer computes on - ``hidden_states`` ``[B, T, hidden]``, ``attention_mask``
    ``[B, T]`` (1 = real token, 0 = padding) or None - and ``restore``, which gives the layer's
    output ``[B, T, hidden]`` the caller's form (identity here; a CP mixer rewraps a DTensor).
    ``T`` is the tokens this device holds: the whole sequence, or a CP rank's shard.

``forward(layer, proj, mask) -> o``
    ``proj`` is the layer's :class:`~overlap_runtime.layers.gated_deltanet.GDNProjections` of
    the masked input (``mixed_qkv`` ``[B, T, 2*H*K + HV*V]``, ``a``, ``b`` ``[B, T, HV]``, all
    in the input dtype; ``z`` is the layer's own and stays with it), ``mask`` as returned by
    ``prepare_inputs``. Returns ``o`` ``[B, T, HV, V]`` in ``proj.mixed_qkv``'s dtype: the
    causal conv + SiLU, the gates (``g`` fp32, padded positions identity steps) and the GDN
    recurrence with l2-normalised q, k. The mixer reads the layer's parameters through its
    pieces - ``causal_conv``, ``split_qkv``, ``causal_conv_qkv``, ``gates``, ``core``, ``conv_channels``,
    ``conv_halo`` - and never copies them, so their gradients land on the layer.

``forward_packed(layer, proj, mask, cu_seqlens) -> o``
    The same for a packed batch (``layers.segments``): conv and recurrence restart at every
    document start. ``cu_seqlens`` is global (over the ``B * T_global`` tokens of the whole
    rows, the same on every CP rank). :class:`LocalGDNMixer`: one conv over the rows with the
    taps before each document start dropped, the gates once, and one varlen GDN call over the
    rows flattened (either backend); the CP mixers override it
    (``context_parallel/gdn/varlen.py``). The base class's default runs ``forward`` on each
    document alone (``apply_per_segment``), for a mixer without a varlen path.

A mixer holds configuration only (immutable after construction). Everything one call needs
travels as arguments and return values, so two microbatches may be in flight through one layer
(pipeline schedules, the comm/compute overlap threads, activation-checkpoint recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
from torch import nn

from overlap_runtime.layers.segments import apply_per_segment, document_positions

if TYPE_CHECKING:
    from overlap_runtime.layers.gated_deltanet import GatedDeltaNet


@dataclass(frozen=True)
class GDNProjections:
    """Per-call output of :meth:`GatedDeltaNet.project` (all in the input dtype).

    Attributes:
        mixed_qkv: ``[B, T, 2*H*K + HV*V]`` q, k, v channels before the conv.
        z: ``[B, T, HV, V]`` output gate.
        b: ``[B, T, HV]`` beta logits.
        a: ``[B, T, HV]`` decay logits.
    """

    mixed_qkv: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor


class MixerInputs(NamedTuple):
    """What :meth:`GDNSequenceMixer.prepare_inputs` hands the layer (per call, never stored).

    Attributes:
        hidden_states: ``[B, T, hidden]`` plain tensor of this device's tokens.
        attention_mask: ``[B, T]`` (1 = real token, 0 = padding) or None.
        restore: layer output ``[B, T, hidden]`` -> the form the caller passed (e.g. a DTensor).
    """

    hidden_states: torch.Tensor
    attention_mask: torch.Tensor | None
    restore: Callable[[torch.Tensor], torch.Tensor]


def _same_form(out: torch.Tensor) -> torch.Tensor:
    return out


def check_layer_inputs(layer: "GatedDeltaNet", hidden_states: torch.Tensor,
                       attention_mask: torch.Tensor | None, seq: str = "T",
                       where: str = "") -> None:
    """``hidden_states`` must be ``[B, <seq>, hidden]``, ``attention_mask`` ``[B, <seq>]``.

    ``seq`` names the sequence dim in the message (``"S/P"`` for a CP shard), ``where`` is
    appended to the mask rule (e.g. ``" (this rank's slice)"``).
    """
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != layer.hidden_size:
        raise ValueError(
            f"hidden_states must be [B, {seq}, hidden={layer.hidden_size}], got "
            f"{list(hidden_states.shape)}"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask must be [B, {seq}] = {list(hidden_states.shape[:2])}{where}, got "
            f"{list(attention_mask.shape)}"
        )


class GDNSequenceMixer(nn.Module):
    """Base of the GDN sequence-mixer strategies (the protocol is in the module docstring).

    A submodule of the layer (``layer.sequence_mixer``) without parameters or buffers: swapping
    it changes neither ``state_dict`` nor the parameters FSDP shards.
    """

    def prepare_inputs(self, layer: "GatedDeltaNet", hidden_states: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> MixerInputs:
        """Check the call's shapes; the inputs pass through unchanged."""
        check_layer_inputs(layer, hidden_states, attention_mask)
        return MixerInputs(hidden_states, attention_mask, _same_form)

    def forward(self, layer: "GatedDeltaNet", proj: "GDNProjections",
                mask: torch.Tensor | None) -> torch.Tensor:
        """``o [B, T, HV, V]`` from the layer's projections (see the module docstring)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement forward(layer, proj, mask) -> o [B, T, HV, V]"
        )

    def forward_packed(self, layer: "GatedDeltaNet", proj: "GDNProjections",
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``o [B, T, HV, V]`` of a packed batch: :meth:`forward` on each document alone."""
        return apply_per_segment(
            lambda qkv, z, b, a, m: self(layer, GDNProjections(qkv, z, b, a), m),
            (proj.mixed_qkv, proj.z, proj.b, proj.a, mask), cu_seqlens)


class LocalGDNMixer(GDNSequenceMixer):
    """Single device: causal conv + SiLU, gates, then the chunked GDN op of ``layer.backend``."""

    def forward(self, layer: "GatedDeltaNet", proj: "GDNProjections",
                mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = layer.causal_conv_qkv(proj.mixed_qkv)
        g, beta = layer.gates(proj.a, proj.b, mask=mask)
        return layer.core(q, k, v, g, beta)

    def forward_packed(self, layer: "GatedDeltaNet", proj: "GDNProjections",
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``o [B, T, HV, V]`` of a packed batch in one pass: the conv over the whole rows with
        the taps before each token's document start dropped (``doc_positions``), the gates,
        and ONE varlen GDN call with ``cu_seqlens`` over the rows flattened to ``B = 1``
        (``layer.core``; the eager or Triton backend, conv torch or triton). Equal to
        ``forward`` on each document alone. Raises ``ValueError`` for an invalid
        ``cu_seqlens`` (``layers.segments.segments_of``)."""
        batch, seq_len = proj.mixed_qkv.shape[:2]
        positions = document_positions(cu_seqlens, batch, seq_len)  # checks cu_seqlens
        q, k, v = layer.causal_conv_qkv(proj.mixed_qkv, doc_positions=positions)
        g, beta = layer.gates(proj.a, proj.b, mask=mask)
        return layer.core(q, k, v, g, beta, cu_seqlens=cu_seqlens)
