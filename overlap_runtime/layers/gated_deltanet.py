"""Gated DeltaNet token mixer with the structure of Qwen3.5's linear-attention layer.

::

    hidden [B, T, hidden]
      |-- in_proj_qkv --> mixed_qkv [B, T, 2*H*K + HV*V] --causal depthwise conv (kernel 4) + SiLU
      |                     --> q [B, T, H, K], k [B, T, H, K], v [B, T, HV, V]
      |-- in_proj_z   --> z [B, T, HV, V]                 (output gate)
      |-- in_proj_b   --> beta = sigmoid(b)     [B, T, HV]
      |-- in_proj_a   --> g = -exp(A_log) * softplus(a + dt_bias)   [B, T, HV] fp32 (log decay)
      v
    o = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)       [B, T, HV, V]
    out = out_proj(RMSNormGated(o, z))                                     [B, T, hidden]

``H`` key heads serve ``HV`` value heads (grouped: value head ``j`` reads key head
``j // (HV // H)``; Qwen3.5 uses H=16, HV=32, K=V=128). The conv's channels are laid out
``[q heads | k heads | v heads]``, each head's ``K`` (or ``V``) channels contiguous.

The forward reads ``mask -> project -> sequence mixer -> finish``. Everything token-wise (the
input mask, the four projections, the gated norm and the out projection) is the layer's; the
causal conv and the GDN recurrence - the only steps that read other tokens - are one swappable
strategy, ``self.sequence_mixer`` (protocol, shapes and dtypes in ``layers.sequence_mixer``):
:class:`~overlap_runtime.layers.sequence_mixer.LocalGDNMixer` by default, a context-parallel
mixer after ``context_parallel.LinearAttentionContextParallel(...).apply(layer, cp_mesh)``. The
mixers drive the layer's stateless pieces - :meth:`~GatedDeltaNet.causal_conv`,
:meth:`~GatedDeltaNet.split_qkv`, :meth:`~GatedDeltaNet.gates`, :meth:`~GatedDeltaNet.core`,
:meth:`~GatedDeltaNet.conv_channels` - on slices (a halo of earlier tokens for the conv, a subset
of the heads). Everything a call needs is passed in; the layer and its mixer hold only
parameters and configuration.

Padding: ``attention_mask`` ``[B, T]`` (1 = real token, 0 = padding) turns padded positions into
exact no-ops: their hidden input is zeroed (so they add nothing to later tokens' conv windows,
the projections have no bias), their ``g`` and ``beta`` are set to 0 (the GDN step with
``beta = 0, g = 0`` leaves the state unchanged) and their output is zeroed. Padding may sit
anywhere (left, right, between documents of one row); a padded row gives the real tokens exactly
the output of the unpadded sequence.

Every mask is applied as a select (``torch.where(mask != 0, x, 0)``), never as a product: a
padded slot may hold anything, NaN or inf included (uninitialised buffers, a previous layer's
garbage in a pad), and ``NaN * 0 = NaN`` would reach every later token through the conv and the
state. With the select the output and every gradient are exactly those of the same sequence with
zeros in the padded slots.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from overlap_runtime.layers.elementwise import causal_conv_silu, gdn_gates
from overlap_runtime.layers.norm import RMSNormGated
from overlap_runtime.layers.sequence_mixer import GDNProjections, GDNSequenceMixer, LocalGDNMixer
from overlap_runtime.layers.shared_input import shared_input_linear
from overlap_runtime.ops.causal_conv.capability import MAX_KERNEL_SIZE
from overlap_runtime.ops.causal_conv.function import (causal_conv_silu_triton,
                                                      causal_conv_silu_triton_parts)
from overlap_runtime.ops.gdn import GDNKernelOptions, chunk_gated_delta_rule

#: The causal conv's implementations (``GatedDeltaNet(conv_backend=...)``, ``model.conv_backend``).
CONV_BACKENDS = ("torch", "triton")


def _keep(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` mask (any dtype, 0 = padding) -> ``[B, T, 1]`` bool, True at real tokens."""
    return (mask != 0).unsqueeze(-1)


class GatedDeltaNet(nn.Module):
    """Qwen3.5-style Gated DeltaNet layer (see the module docstring).

    Args:
        hidden_size: model width.
        num_key_heads: H (q/k heads), Qwen3.5: 16.
        num_value_heads: HV, a multiple of H, Qwen3.5: 32.
        head_k_dim: K, head_v_dim: V (Qwen3.5: 128 each).
        conv_kernel_size: causal depthwise conv width (4).
        norm_eps: epsilon of the gated RMSNorm.
        chunk_size: GDN chunk length (64).
        backend: GDN backend of the single-device mixer (``"eager"`` or ``"triton"``; a
            context-parallel mixer carries its own).
        conv_backend: the causal conv + SiLU: ``"torch"`` (``F.conv1d``, or the compiled
            shifted sum under ``layers.compile.compile_elementwise``) or ``"triton"`` (the
            kernels of ``ops.causal_conv``, whatever ``train.compile`` says; the CP halo conv
            uses them too). No automatic choice.
        kernel_options: tuning knobs of the GDN op (``ops.gdn.GDNKernelOptions``:
            ``block_chunks`` for eager, ``num_segments`` / ``recompute_w`` for triton), passed
            to every op call the layer makes (dense and packed) and, through
            ``LinearAttentionContextParallel.apply``, to the context-parallel mixers, which
            check them against their mode and backend. None: the backend's defaults. An option
            that does not apply to ``backend`` raises ``ValueError`` naming it. Results do not
            depend on them (speed and memory do).

    Attributes:
        sequence_mixer: the conv + GDN strategy (``layers.sequence_mixer``), default
            :class:`~overlap_runtime.layers.sequence_mixer.LocalGDNMixer`.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        num_key_heads: int = 16,
        num_value_heads: int = 32,
        head_k_dim: int = 128,
        head_v_dim: int = 128,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
        backend: str = "eager",
        conv_backend: str = "torch",
        kernel_options: GDNKernelOptions | None = None,
    ) -> None:
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(
                f"num_value_heads={num_value_heads} must be a multiple of "
                f"num_key_heads={num_key_heads} (each key head serves a group of value heads)"
            )
        if conv_backend not in CONV_BACKENDS:
            raise ValueError(f"conv_backend={conv_backend!r} is not one of {CONV_BACKENDS} "
                             "(no automatic choice)")
        if conv_kernel_size < 1:
            raise ValueError(f"conv_kernel_size={conv_kernel_size} must be >= 1")
        if conv_backend == "triton" and conv_kernel_size > MAX_KERNEL_SIZE:
            raise NotImplementedError(
                f"conv_kernel_size={conv_kernel_size} with conv_backend='triton': the kernels "
                f"take K <= {MAX_KERNEL_SIZE} (use conv_backend='torch')")
        if kernel_options is not None:
            if not isinstance(kernel_options, GDNKernelOptions):
                raise TypeError(f"kernel_options must be a GDNKernelOptions or None, got "
                                f"{type(kernel_options).__name__}")
            kernel_options.check_backend(backend)  # names the option and the backend
        self.hidden_size = hidden_size
        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_key_heads * head_k_dim
        self.value_dim = num_value_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.chunk_size = chunk_size
        self.backend = backend
        self.conv_backend = conv_backend
        self.kernel_options = kernel_options  # configuration, the same for every call

        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
            padding=conv_kernel_size - 1, bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads).uniform_(1.0, 16.0).log())
        self.norm = RMSNormGated(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.sequence_mixer: GDNSequenceMixer = LocalGDNMixer()
        # the elementwise pieces: eager functions, or their compiled form
        # (layers.elementwise.compile_elementwise; configuration, the same for every call)
        self.conv_fn: Callable[..., torch.Tensor] = (
            causal_conv_silu if conv_backend == "torch" else causal_conv_silu_triton)
        self.gates_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_gates
        # the conv writing q, k, v as separate contiguous tensors (causal_conv_qkv), or None:
        # one conv then split views (the eager F.conv1d, whose [B, C, T] output is transposed
        # anyway: the op's copy of the views is that transpose)
        self.conv_parts_fn: Callable[..., tuple[torch.Tensor, ...]] | None = (
            None if conv_backend == "torch"
            else causal_conv_silu_triton_parts)

    # -- geometry --------------------------------------------------------------------------
    @property
    def conv_halo(self) -> int:
        """Left context the causal conv needs: ``(kernel - 1) * dilation`` positions."""
        return (self.conv_kernel_size - 1) * self.conv1d.dilation[0]

    def conv_channels(self, key_heads: torch.Tensor, value_heads: torch.Tensor) -> torch.Tensor:
        """Conv channel indices ``[q of key_heads | k of key_heads | v of value_heads]`` (int64).

        ``key_heads`` may repeat a head (a replicated key head, see the Ulysses layout).
        """
        kd, vd = self.head_k_dim, self.head_v_dim
        ar_k = torch.arange(kd)
        ar_v = torch.arange(vd)
        q_ch = (key_heads[:, None] * kd + ar_k).reshape(-1)
        k_ch = self.key_dim + q_ch
        v_ch = 2 * self.key_dim + (value_heads[:, None] * vd + ar_v).reshape(-1)
        return torch.cat([q_ch, k_ch, v_ch])

    # -- the pieces ------------------------------------------------------------------------
    def project(self, hidden_states: torch.Tensor) -> GDNProjections:
        """Input projections of ``hidden_states`` ``[B, T, hidden]`` (see :class:`GDNProjections`)."""
        batch, seq_len, _ = hidden_states.shape
        mixed_qkv, z, b, a = shared_input_linear(hidden_states, self.in_proj_qkv, self.in_proj_z,
                                                 self.in_proj_b, self.in_proj_a)
        return GDNProjections(
            mixed_qkv=mixed_qkv,
            z=z.view(batch, seq_len, self.num_value_heads, self.head_v_dim),
            b=b,
            a=a,
        )

    def causal_conv(
        self,
        mixed_qkv: torch.Tensor,
        left_context: torch.Tensor | None = None,
        channels: torch.Tensor | None = None,
        doc_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv + SiLU over the sequence.

        Args:
            mixed_qkv: ``[B, T, C]`` conv input (C = conv_dim, or ``len(channels)``).
            left_context: ``[B, conv_halo, C]`` the positions just before this segment (a CP
                halo), or None for the zeros of causal padding.
            channels: int64 indices of the conv channels ``mixed_qkv`` holds (a head slice),
                or None for all channels.
            doc_positions: packed documents: ``[B, T]`` int position of each token in its
                document (``layers.segments.document_positions``); the taps reaching before a
                token's document start are dropped, so the conv restarts at every document
                start as the conv of the document alone does. None: one sequence per row.
                Either conv backend (torch: the shifted sum, eager or compiled; triton: the
                kernels' masked taps).

        Returns:
            ``[B, T, C]`` in mixed_qkv's dtype.
        """
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, kernel]
        if channels is not None:
            weight = weight.index_select(0, channels.to(weight.device))
        if doc_positions is None:
            return self.conv_fn(mixed_qkv, weight, left_context, self.conv1d.dilation[0])
        return self.conv_fn(mixed_qkv, weight, left_context, self.conv1d.dilation[0],
                            doc_positions.to(mixed_qkv.device))

    def causal_conv_qkv(
        self,
        mixed_qkv: torch.Tensor,
        channels: torch.Tensor | None = None,
        doc_positions: torch.Tensor | None = None,
        num_key_heads: int | None = None,
        num_value_heads: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`causal_conv` then :meth:`split_qkv`, with q, k, v written contiguous.

        Args: as :meth:`causal_conv` (no halo: the single-device and Ulysses convs) and
        :meth:`split_qkv` (``num_key_heads``/``num_value_heads``: a head slice's counts).

        Returns:
            ``q [B, T, h, K], k [B, T, h, K], v [B, T, hv, V]`` in mixed_qkv's dtype; with
            ``conv_parts_fn`` (the Triton conv, the compiled shifted sum) each one contiguous,
            so the GDN op copies nothing and no gradient concatenation runs outside the conv
            (``layers.elementwise.causal_conv_silu_parts``' contract;
            ``ops.causal_conv.causal_conv_silu_triton_parts`` writes each group's dx into one
            gradient); the eager ``F.conv1d`` gives views
            of its one output. The same values either way (a depthwise conv per channel).
        """
        if self.conv_parts_fn is None:
            return self.split_qkv(self.causal_conv(mixed_qkv, None, channels, doc_positions),
                                  num_key_heads, num_value_heads)
        h = self.num_key_heads if num_key_heads is None else num_key_heads
        hv = self.num_value_heads if num_value_heads is None else num_value_heads
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, kernel]
        if channels is not None:
            weight = weight.index_select(0, channels.to(weight.device))
        sizes = (h * self.head_k_dim, h * self.head_k_dim, hv * self.head_v_dim)
        positions = None if doc_positions is None else doc_positions.to(mixed_qkv.device)
        q, k, v = self.conv_parts_fn(mixed_qkv, weight, sizes, None, self.conv1d.dilation[0],
                                     positions)
        batch, seq_len, _ = mixed_qkv.shape
        return (q.view(batch, seq_len, h, self.head_k_dim),
                k.view(batch, seq_len, h, self.head_k_dim),
                v.view(batch, seq_len, hv, self.head_v_dim))

    def split_qkv(
        self, conv_out: torch.Tensor, num_key_heads: int | None = None,
        num_value_heads: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T, 2*h*K + hv*V] -> q [B, T, h, K], k [B, T, h, K], v [B, T, hv, V]``.

        ``h``/``hv`` default to all heads; a CP layer passes its per-rank counts.
        """
        h = self.num_key_heads if num_key_heads is None else num_key_heads
        hv = self.num_value_heads if num_value_heads is None else num_value_heads
        batch, seq_len, _ = conv_out.shape
        q, k, v = conv_out.split([h * self.head_k_dim, h * self.head_k_dim, hv * self.head_v_dim], -1)
        return (
            q.reshape(batch, seq_len, h, self.head_k_dim),
            k.reshape(batch, seq_len, h, self.head_k_dim),
            v.reshape(batch, seq_len, hv, self.head_v_dim),
        )

    def gates(
        self, a: torch.Tensor, b: torch.Tensor, value_heads: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)``.

        Args:
            a, b: ``[B, T, hv]`` logits of the heads ``value_heads`` (all heads when None).
            value_heads: int64 indices into A_log / dt_bias.
            mask: ``[B, T]`` 1 for real tokens, 0 for padding: padded positions get
                ``g = beta = 0`` (an identity GDN step), selected, so whatever the logits or
                parameters give there (NaN, inf) is replaced.

        Returns:
            ``(g [B, T, hv] fp32 (float64 for float64 a), beta [B, T, hv] in b's dtype)``.
        """
        a_log, dt_bias = self.A_log, self.dt_bias
        if value_heads is not None:
            idx = value_heads.to(a_log.device)
            a_log, dt_bias = a_log.index_select(0, idx), dt_bias.index_select(0, idx)
        g, beta = self.gates_fn(a, b, a_log, dt_bias)
        if mask is not None:  # select, never multiply: NaN * 0 = NaN (module docstring)
            keep = _keep(mask)
            g = torch.where(keep, g, 0.0)
            beta = torch.where(keep, beta, 0.0)
        return g, beta

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        backend: str | None = None,
        cu_seqlens: torch.Tensor | None = None,
        options: GDNKernelOptions | None = None,
    ) -> torch.Tensor:
        """The GDN recurrence with l2-normalised q, k: ``o [B, T, hv, V]`` in v's dtype.

        ``backend``: None for the layer's own, with ``self.kernel_options`` unless ``options``
        is given; a caller that names a backend passes that backend's ``options`` too (None:
        its defaults), as a context-parallel mixer passes its plan's (which
        ``LinearAttentionContextParallel.apply`` took from this layer and checked).

        ``cu_seqlens``: packed documents (``layers.segments``: offsets over the ``B * T``
        tokens of the rows flattened, every row start among them, already checked by the
        caller): the rows are flattened to ``[1, B * T, ...]`` and run as ONE varlen op call
        (``ops.gdn.chunk_gated_delta_rule(cu_seqlens=...)``, either backend), the state
        restarting from zero (or ``initial_state[n]``, ``[N, hv, K, V]``) at each document.
        """
        if backend is None:
            backend = self.backend
            options = self.kernel_options if options is None else options
        if cu_seqlens is None:
            o, _ = chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm=True,
                chunk_size=self.chunk_size, backend=backend, options=options,
            )
            return o
        batch, seq_len = v.shape[:2]
        flat = [x.reshape(1, batch * seq_len, *x.shape[2:]) for x in (q, k, v, g, beta)]
        o, _ = chunk_gated_delta_rule(
            *flat, initial_state=initial_state, use_qk_l2norm=True, chunk_size=self.chunk_size,
            backend=backend, cu_seqlens=cu_seqlens.to(v.device), options=options,
        )
        return o.reshape(batch, seq_len, *o.shape[2:])

    def finish(
        self, o: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gated norm and out projection: o, z ``[B, T, HV, V]`` -> ``[B, T, hidden]``.

        ``mask`` ``[B, T]`` zeroes padded positions of the result (a select: exact zeros even
        where ``o`` or ``z`` is NaN there).
        """
        batch, seq_len = o.shape[:2]
        out = self.out_proj(self.norm(o, z).reshape(batch, seq_len, self.value_dim))
        return out if mask is None else torch.where(_keep(mask), out, 0.0)

    @staticmethod
    def mask_input(hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Zero padded positions of ``[B, T, hidden]`` (``mask`` ``[B, T]``, 1 = real): a
        select, so a NaN or inf in a padded slot becomes an exact 0 (and gets gradient 0)."""
        if mask is None:
            return hidden_states
        return torch.where(_keep(mask), hidden_states, 0.0)

    # -- the layer --------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, T, hidden] -> [B, T, hidden]`` (input dtype): mask -> project -> mixer -> finish.

        Args:
            hidden_states: ``[B, T, hidden]``: the whole sequence, or under context parallelism
                this rank's contiguous shard (a tensor, or a DTensor the CP mixer accepts).
            attention_mask: ``[B, T]`` 1 = real token, 0 = padding (see the module docstring).
            cu_seqlens: packed documents (``layers.segments``): the conv and the recurrence
                restart at each document (zero conv context and a zero state at its start),
                exactly as if each were its own sequence; single device: one masked conv and
                one varlen GDN call (``LocalGDNMixer.forward_packed``). Global: over the
                ``B * T`` tokens of the whole rows, also under context parallelism (the
                mixer's ``forward_packed``; CP: ``context_parallel/gdn/varlen.py``).
        """
        mixer = self.sequence_mixer
        hidden, mask, restore = mixer.prepare_inputs(self, hidden_states, attention_mask)
        proj = self.project(self.mask_input(hidden, mask))
        if cu_seqlens is None:
            o = mixer(self, proj, mask)  # [B, T, HV, V]
        else:
            o = mixer.forward_packed(self, proj, mask, cu_seqlens)
        return restore(self.finish(o, proj.z, mask))
