"""``LinearAttentionContextParallel``: context parallelism for Gated DeltaNet layers.

::

    LinearAttentionContextParallel(mode="p2p", backend="eager").apply(gdn_module, cp_mesh)

``mode`` picks the distributed algorithm, ``backend`` the local GDN implementation; they are
orthogonal (seed 000, 5.4):

=============  =========================================  ==========  =====================
mode           what crosses ranks                         eager       triton
=============  =========================================  ==========  =====================
``ulysses``    q/k/v/a/b (seq -> head a2a), o (inverse)   yes         yes (the Triton GDN op)
``p2p``        conv halo, fp32 state chain H / dH         yes         yes (Triton summaries)
``all_gather`` conv halo, every rank's summary (M, S)     yes         refused (see below)
=============  =========================================  ==========  =====================

There is no ``auto`` and no fallback: an unsupported combination raises, naming the value and the
rule. With ``backend="triton"`` the local sequence must be a multiple of the chunk size 64 and the
Triton capability rules (device, dtypes, head dims) must hold; both are checked at the first
forward, before any communication, on every rank at the same point.

After ``apply``, ``module(hidden_states, attention_mask=None, cu_seqlens=None)`` takes this
rank's contiguous sequence shard ``[B, S/P, hidden]`` (a tensor, or a DTensor on ``cp_mesh``
placed ``Shard(1)``) and returns the shard of the output in the same form. Every rank must call
it with the same shapes and the same optional arguments. Parameter gradients are this rank's
share; sum them over the CP group (FSDP / DDP over the data x cp mesh does) to get the
single-process gradient.

Padding: ``attention_mask`` ``[B, S/P]`` (1 = real token, 0 = padding) is this rank's slice of
the global mask; padded positions are identity steps of the GDN and give exact zeros (see
``overlap_runtime.models.gated_deltanet``). Pad the global sequence to a multiple of ``P`` (e.g.
to ``P * ceil(S / P)``); a partial last chunk needs no padding.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.models.gated_deltanet import GatedDeltaNet
from overlap_runtime.ops.gdn import SUPPORTED_BACKENDS

from .gdn_cp_all_gather import all_gather_forward
from .gdn_cp_common import GDNCPPlan, check_backend_before_comm
from .gdn_cp_p2p import p2p_forward
from .gdn_cp_ulysses import ulysses_forward, ulysses_head_layout

__all__ = ["LinearAttentionContextParallel", "LINEAR_ATTENTION_CP_MODES"]

LINEAR_ATTENTION_CP_MODES: tuple[str, ...] = ("ulysses", "p2p", "all_gather")

_MODE_FORWARD: dict[str, Callable[..., torch.Tensor]] = {
    "ulysses": ulysses_forward,
    "p2p": p2p_forward,
    "all_gather": all_gather_forward,
}

#: What the CP layer replaces or reads on the module (GatedDeltaNet's pieces).
REQUIRED_MEMBERS: tuple[str, ...] = (
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
    "out_proj", "project", "causal_conv", "split_qkv", "gates", "core", "finish", "mask_input",
    "conv_channels",
)

_APPLIED_ATTR = "_gdn_context_parallel_plan"


class LinearAttentionContextParallel:
    """Context-parallel style for a GDN layer (see the module docstring).

    Args:
        mode: ``"ulysses"``, ``"p2p"`` or ``"all_gather"``.
        backend: local GDN backend, ``"eager"`` or ``"triton"`` (no ``auto``).
        tp_size: tensor-parallel degree of the layer; only 1 (linear-attention TP + CP is out
            of scope, seed 000 3.2).
        timeout_s: bound of every communication wait (None: ``comm.DEFAULT_TIMEOUT_S``).

    Raises:
        ValueError: unknown mode or backend.
        NotImplementedError: ``all_gather`` with ``triton``; ``tp_size > 1``. (``triton`` with
            a local sequence that is not whole 64-token chunks raises at the first forward.)
    """

    def __init__(
        self,
        mode: str = "ulysses",
        backend: str = "eager",
        tp_size: int = 1,
        timeout_s: float | None = None,
    ) -> None:
        if mode not in LINEAR_ATTENTION_CP_MODES:
            raise ValueError(
                f"unknown linear-attention CP mode {mode!r}; supported modes: "
                f"{LINEAR_ATTENTION_CP_MODES}"
            )
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"unknown GDN backend {backend!r}; supported backends: {SUPPORTED_BACKENDS} "
                "(there is no 'auto': choose one explicitly)"
            )
        if mode == "all_gather" and backend != "eager":
            # all_gather differentiates *through* the gathered summaries: the prefix compose
            # sends an arbitrary dM (not dH_out H_in^T) back to every rank, and the Triton
            # summary kernels are forward-only (no summary backward). p2p needs only dH_out,
            # which the Triton chunk op's own backward covers.
            raise NotImplementedError(
                f"mode='all_gather' with backend={backend!r} is not supported: all_gather is the "
                "eager comparison path (every rank gathers and re-composes all P summaries and "
                "autograd runs through them, but the Triton summary kernels are forward-only); "
                "use mode='p2p' or 'ulysses' for the Triton backend, or backend='eager'"
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

    def apply(self, module: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
        """Make ``module`` run context-parallel over the 1-D ``cp_mesh``; returns ``module``.

        The parameters stay where they are (no copies); the module's ``forward`` is replaced by
        the CP forward of ``self.mode``. Applying twice raises.
        """
        missing = [name for name in REQUIRED_MEMBERS if not hasattr(module, name)]
        if missing:
            raise TypeError(
                f"LinearAttentionContextParallel.apply: {type(module).__name__} lacks {missing}; "
                "it needs GatedDeltaNet's submodules and pieces (overlap_runtime.models."
                "GatedDeltaNet)"
            )
        if getattr(module, _APPLIED_ATTR, None) is not None:
            raise RuntimeError(
                f"LinearAttentionContextParallel.apply: this {type(module).__name__} already runs "
                f"context-parallel ({getattr(module, _APPLIED_ATTR).mode!r}); apply once"
            )
        if not isinstance(cp_mesh, DeviceMesh):
            raise TypeError(f"cp_mesh must be a DeviceMesh, got {type(cp_mesh).__name__}")
        if cp_mesh.ndim != 1:
            raise ValueError(
                f"cp_mesh must be 1-D (the context-parallel dimension), got {cp_mesh.ndim}-D "
                f"mesh of shape {tuple(cp_mesh.shape)}; pass mesh['cp']"
            )
        cp_size = cp_mesh.size()
        if self.mode == "ulysses":
            ulysses_head_layout(module.num_key_heads, module.num_value_heads, cp_size)
        plan = GDNCPPlan(
            mode=self.mode, backend=self.backend, group=cp_mesh.get_group(), cp_size=cp_size,
            mesh=cp_mesh, timeout_s=self.timeout_s,
        )
        setattr(module, _APPLIED_ATTR, plan)
        module.forward = functools.partial(context_parallel_forward, module, plan)  # type: ignore[method-assign]
        return module


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


def context_parallel_forward(
    module: GatedDeltaNet,
    plan: GDNCPPlan,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """CP forward bound by :meth:`LinearAttentionContextParallel.apply`.

    Args:
        hidden_states: ``[B, S/P, hidden]`` this rank's shard (tensor or DTensor ``Shard(1)``).
        attention_mask: ``[B, S/P]`` 1 = real token, 0 = padding, or None.
        cu_seqlens: packed/varlen input: NotImplementedError.

    Returns:
        ``[B, S/P, hidden]`` in hidden_states' dtype (a DTensor ``Shard(1)`` if the input was).
    """
    if cu_seqlens is not None:
        raise NotImplementedError(
            f"packed/varlen input (cu_seqlens) is not supported by GDN context parallelism "
            f"(mode={plan.mode!r}); pad the sequences and pass attention_mask"
        )
    local, was_dtensor = _to_local(hidden_states, plan, "hidden_states")
    if local.dim() != 3 or local.shape[-1] != module.hidden_size:
        raise ValueError(
            f"hidden_states must be [B, S/P, hidden={module.hidden_size}], got "
            f"{list(local.shape)}"
        )
    mask = None
    if attention_mask is not None:
        mask, _ = _to_local(attention_mask, plan, "attention_mask")
        if tuple(mask.shape) != tuple(local.shape[:2]):
            raise ValueError(
                f"attention_mask must be [B, S/P] = {list(local.shape[:2])} (this rank's slice), "
                f"got {list(mask.shape)}"
            )
    check_backend_before_comm(module, local, plan)
    out = _MODE_FORWARD[plan.mode](module, plan, local, mask)
    if was_dtensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(out, plan.mesh, [Shard(1)], run_check=False)
    return out
