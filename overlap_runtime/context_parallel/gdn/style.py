"""``LinearAttentionContextParallel``: context parallelism for Gated DeltaNet layers.

::

    LinearAttentionContextParallel(mode="p2p", backend="eager").apply(gdn_module, cp_mesh)

``mode`` picks the distributed algorithm, ``backend`` the local GDN implementation; they are
orthogonal (every mode runs on either backend):

===============  =========================================  ==========  =====================
mode             what crosses ranks                         eager       triton
===============  =========================================  ==========  =====================
``ulysses``      q/k/v/a/b (seq -> head a2a), o (inverse)   yes         yes (the Triton GDN op)
``p2p``          conv halo, fp32 state chain H / dH         yes         yes (Triton summaries)
``all_gather``   conv halo, every rank's summary (M, S)     yes         yes (eager summaries)
``prefix_scan``  conv halo, (M, S) or H in log2 P rounds    yes         yes (Triton summaries)
===============  =========================================  ==========  =====================

There is no ``auto`` and no fallback: an unsupported combination raises, naming the value and the
rule. With ``backend="triton"`` the local sequence must be a multiple of the chunk size 64 and the
Triton capability rules (device, dtypes, head dims) must hold; both are checked at the first
forward, before any communication, on every rank at the same point.

Kernel options: ``apply`` takes the layer's ``kernel_options`` (``ops.gdn.GDNKernelOptions``,
``model.gdn_kernel_options``) into the mode's plan and passes them to every local GDN op call
(:meth:`LinearAttentionContextParallel.check_kernel_options` has the rules, checked before the
layer is changed):

* ``block_chunks`` (eager) acts in every op call: ulysses and all_gather run the local GDN with
  it (forward and backward); p2p and prefix_scan in the backward's recompute of the local output
  (their forward runs every chunk at once, not in blocks); every packed call. Not in the
  summaries (``state_summary``, ``summarize``: a tree over all chunks).
* ``num_segments`` (triton) sets the op's state scan in every mode; the dense p2p chain and
  prefix scan run at least ``triton_min_segments`` = 2 segments per rank (their state link needs
  the segment summaries), so ``num_segments=1`` raises there.
* ``recompute_w`` (triton) acts in every mode (the p2p chain and the prefix scan pass it to the
  op's forward, whose backward forms w again).

Options of the other backend (the layer's ``backend`` may differ from this style's) raise too.

``apply`` installs the mode's sequence mixer as ``module.sequence_mixer`` (the strategy protocol
of ``overlap_runtime.layers.sequence_mixer``: :class:`~.ulysses.UlyssesGDNMixer`,
:class:`~.p2p.P2PGDNMixer`, :class:`~.all_gather.AllGatherGDNMixer`,
:class:`~.prefix_scan.PrefixScanGDNMixer`); the layer's own forward -
mask, projections, mixer, gated norm and out projection - is unchanged. After ``apply``,
``module(hidden_states, attention_mask=None, cu_seqlens=None)`` takes this rank's contiguous
sequence shard ``[B, S/P, hidden]`` (a tensor, or a DTensor on ``cp_mesh`` placed ``Shard(1)``)
and returns the shard of the output in the same form. Every rank must call
it with the same shapes and the same optional arguments. Parameter gradients are this rank's
share; sum them over the CP group (FSDP / DDP over the data x cp mesh does) to get the
single-process gradient.

Padding: ``attention_mask`` ``[B, S/P]`` (1 = real token, 0 = padding) is this rank's slice of
the global mask; padded positions are identity steps of the GDN and give exact zeros (see
``overlap_runtime.layers.gated_deltanet``). Pad the global sequence to a multiple of ``P`` (e.g.
to ``P * ceil(S / P)``); a partial last chunk needs no padding.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.config.cp_modes import (GDN_ALL_GATHER, GDN_P2P, GDN_PREFIX_SCAN, GDN_ULYSSES,
                                             cp_mode_names, get_cp_mode, kernel_option_problems)
from overlap_runtime.layers.sequence_mixer import LocalGDNMixer
from overlap_runtime.ops.gdn import SUPPORTED_BACKENDS, GDNKernelOptions

from .all_gather import AllGatherGDNMixer
from .common import ContextParallelGDNMixer, GDNCPPlan
from .p2p import P2PGDNMixer
from .prefix_scan import PrefixScanGDNMixer
from .ulysses import UlyssesGDNMixer, ulysses_head_layout

#: the built-in GDN CP modes (``config.cp_modes``); a registered mode joins
#: ``config.cp_modes.cp_mode_names("linear_attention")``
LINEAR_ATTENTION_CP_MODES: tuple[str, ...] = tuple(
    m.name for m in (GDN_ULYSSES, GDN_P2P, GDN_ALL_GATHER, GDN_PREFIX_SCAN))

# the built-in modes' strategies; a registered mode brings its own (``CPMode.strategy``)
_BUILTIN_MIXERS: dict[str, type[ContextParallelGDNMixer]] = {
    GDN_ULYSSES.name: UlyssesGDNMixer,
    GDN_P2P.name: P2PGDNMixer,
    GDN_ALL_GATHER.name: AllGatherGDNMixer,
    GDN_PREFIX_SCAN.name: PrefixScanGDNMixer,
}


def _mixer_of(mode: str) -> type[ContextParallelGDNMixer]:
    entry = get_cp_mode("linear_attention", mode)
    return entry.strategy if entry.strategy is not None else _BUILTIN_MIXERS[mode]  # type: ignore[return-value]

#: What the CP mixers read on the layer (``layers.GatedDeltaNet``'s parameters and pieces) and
#: the strategy slot ``apply`` fills.
REQUIRED_MEMBERS: tuple[str, ...] = (
    "in_proj_qkv", "conv1d", "A_log", "dt_bias", "causal_conv", "split_qkv", "gates", "core",
    "conv_channels", "conv_halo", "sequence_mixer",
)


class LinearAttentionContextParallel:
    """Context-parallel style for a GDN layer (see the module docstring).

    Args:
        mode: ``"ulysses"``, ``"p2p"``, ``"all_gather"`` or ``"prefix_scan"``.
        backend: local GDN backend, ``"eager"`` or ``"triton"`` (no ``auto``).
        tp_size: tensor-parallel degree of the layer; only 1 (no mode splits a GDN layer's
            heads over a tensor-parallel group as well as its sequence over the CP group).
        timeout_s: bound of every communication wait (None: ``comm.DEFAULT_TIMEOUT_S``).

    Raises:
        ValueError: unknown mode or backend.
        NotImplementedError: ``tp_size > 1``. (``triton`` with a local sequence that is not
            whole 64-token chunks raises at the first forward.)
    """

    def __init__(
        self,
        mode: str = GDN_ULYSSES.name,
        backend: str = "eager",
        tp_size: int = 1,
        timeout_s: float | None = None,
    ) -> None:
        if mode not in cp_mode_names("linear_attention"):
            raise ValueError(
                f"unknown linear-attention CP mode {mode!r}; supported modes: "
                f"{cp_mode_names('linear_attention')}"
            )
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"unknown GDN backend {backend!r}; supported backends: {SUPPORTED_BACKENDS} "
                "(there is no 'auto': choose one explicitly)"
            )
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} must be a positive int")
        if tp_size > 1:
            raise NotImplementedError(
                f"tp_size={tp_size}: linear-attention tensor parallelism combined with context "
                "parallelism is not supported; GDN CP needs tp_size == 1"
            )
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 or None")
        self.mode = mode
        self.backend = backend
        self.tp_size = tp_size
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"LinearAttentionContextParallel(mode={self.mode!r}, backend={self.backend!r})"

    def kernel_option_problems(self, options: GDNKernelOptions | None) -> list[str]:
        """Why a layer's kernel ``options`` cannot run in this mode and backend (empty: they
        can): an option of the other backend, or ``num_segments`` below the mode's
        ``triton_min_segments`` (it would be overridden). Each message names the option, the
        mode and the rule."""
        return kernel_option_problems(self.mode, self.backend, options)

    def check_kernel_options(self, options: GDNKernelOptions | None) -> None:
        """Raise ``ValueError`` (``TypeError`` for a non-options object) with
        :meth:`kernel_option_problems`' messages."""
        problems = self.kernel_option_problems(options)
        if problems:
            error = TypeError if not isinstance(options, GDNKernelOptions) else ValueError
            raise error("; ".join(problems))

    def apply(self, module: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
        """Make ``module`` run context-parallel over the 1-D ``cp_mesh``; returns ``module``.

        The parameters stay where they are (no copies); ``module.sequence_mixer`` becomes the
        CP mixer of ``self.mode`` bound to ``cp_mesh``'s group, with the module's
        ``kernel_options`` (:meth:`check_kernel_options` first: a refused option raises before
        anything changes). Applying twice raises.
        """
        missing = [name for name in REQUIRED_MEMBERS if not hasattr(module, name)]
        if missing:
            raise TypeError(
                f"LinearAttentionContextParallel.apply: {type(module).__name__} lacks {missing}; "
                "it needs GatedDeltaNet's parameters, pieces and sequence_mixer slot "
                "(overlap_runtime.layers.GatedDeltaNet)"
            )
        options = getattr(module, "kernel_options", None)
        self.check_kernel_options(options)
        mixer = module.sequence_mixer
        if isinstance(mixer, ContextParallelGDNMixer):
            raise RuntimeError(
                f"LinearAttentionContextParallel.apply: this {type(module).__name__} already runs "
                f"context-parallel ({mixer.mode!r}); apply once"
            )
        if not isinstance(mixer, LocalGDNMixer):
            raise TypeError(
                f"LinearAttentionContextParallel.apply: {type(module).__name__}.sequence_mixer is "
                f"{type(mixer).__name__}; apply replaces the single-device LocalGDNMixer only"
            )
        if not isinstance(cp_mesh, DeviceMesh):
            raise TypeError(f"cp_mesh must be a DeviceMesh, got {type(cp_mesh).__name__}")
        if cp_mesh.ndim != 1:
            raise ValueError(
                f"cp_mesh must be 1-D (the context-parallel dimension), got {cp_mesh.ndim}-D "
                f"mesh of shape {tuple(cp_mesh.shape)}; pass mesh['cp']"
            )
        cp_size = cp_mesh.size()
        if self.mode == GDN_ULYSSES.name:
            ulysses_head_layout(module.num_key_heads, module.num_value_heads, cp_size)
        plan = GDNCPPlan(
            mode=self.mode, backend=self.backend, group=cp_mesh.get_group(), cp_size=cp_size,
            mesh=cp_mesh, timeout_s=self.timeout_s, options=options,
        )
        module.sequence_mixer = _mixer_of(self.mode)(plan)
        return module
