"""Summary-AllGather GDN context parallelism (eager comparison mode).

:class:`AllGatherGDNMixer` is the layer's sequence mixer in this mode::

    all ranks: halo conv -> prepare -> local summary (M_r, S_r)       parallel, differentiable
      -> pack [M_r | S_r]  [B, HV, K, K + V] fp32
      -> differentiable all_gather over the CP group                  [P, B, HV, K, K + V]
      -> rank r: H_in = S of (summary_(r-1) o ... o summary_0)        prefix compose, rank order
      -> local GDN from H_in (eager / triton backend)                 o [B, S/P, HV, V]

No rank waits on a chain of receives; instead every rank holds all ``P`` summaries and composes
its prefix (a tree over ``r`` entries). Backward is plain autograd: the gradient of ``H_in``
flows through the compose into the gathered summaries, the all_gather's backward (all-to-all +
sum) returns each rank the gradient of its own (M, S), and autograd continues through
``summarize``. The summary keeps a chunk-level graph until backward (more memory than p2p);
this mode exists to compare the mathematics and the communication pattern. The summaries are
always the eager :func:`state_summary` (plain PyTorch autograd: the prefix compose sends an
arbitrary ``dM`` back to every rank, which the forward-only Triton summary kernels could not
take); ``backend`` picks the local GDN op that runs from ``H_in`` (``"triton"``: the fused op,
whose backward returns ``dH_in``), so ``all_gather`` + ``triton`` runs the Triton kernels for
the outputs and eager PyTorch for the summaries.
"""

from __future__ import annotations

import torch

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.ops import comm
from overlap_runtime.ops.gdn import state_summary, tree_compose

from .common import ContextParallelGDNMixer, GDNCPPlan
from .halo import local_core_inputs
from .varlen import packed_local_outputs, packed_shard_inputs, packed_tail_maps


def _gathered_initial_state(
    m: torch.Tensor, s: torch.Tensor, plan: GDNCPPlan
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """All-gather every rank's summary and compose the prefix before this rank.

    Args:
        m: ``[B, HV, K, K]``, s: ``[B, HV, K, V]`` this rank's summary (fp32).

    Returns:
        ``(H_in [B, HV, K, V] or None on rank 0, gathered [P, B, HV, K, K + V])``. ``gathered``
        must reach the loss on every rank (rank 0 attaches it to its output), or the
        all_gather's backward collective would run on some ranks only.
    """
    key_dim = m.shape[-1]
    packed = torch.cat([m, s], dim=-1).unsqueeze(0)
    gathered = comm.all_gather(packed, dim=0, group=plan.group, timeout_s=plan.timeout_s)
    rank = plan.rank
    if rank == 0:
        return None, gathered
    prefix = gathered[:rank].movedim(0, 2)  # [B, HV, r, K, K + V], rank order
    _, h_in = tree_compose(prefix[..., :key_dim], prefix[..., key_dim:])  # zero start: H = S
    return h_in, gathered


class AllGatherGDNMixer(ContextParallelGDNMixer):
    """Sequence mixer of ``mode="all_gather"`` (see the module docstring)."""

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's shard ``proj`` (``[B, S/P, ...]``) -> ``o [B, S/P, HV, V]``."""
        plan = self.plan
        q, k, v, g, beta = local_core_inputs(layer, plan, proj, mask)
        m, s = state_summary(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=layer.chunk_size)
        h_in, gathered = _gathered_initial_state(m, s, plan)
        o = layer.core(q, k, v, g, beta, initial_state=h_in, backend=plan.backend,
                       options=plan.options)
        if h_in is None:  # rank 0 reads no summary; keep the collective in its graph
            o = comm.attach(o, gathered)
        return o

    def forward_packed(self, layer: GatedDeltaNet, proj: GDNProjections,
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed batch: each rank's summary is its last document's tail map
        (``gdn/varlen.py``); the gathered prefix enters only a first piece that continues a
        document."""
        plan = self.plan
        table, (q, k, v, g, beta) = packed_shard_inputs(layer, plan, proj, mask, cu_seqlens)
        m, s = packed_tail_maps(q, k, v, g, beta, table, layer.chunk_size)
        h_in, gathered = _gathered_initial_state(m, s, plan)
        o = packed_local_outputs(q, k, v, g, beta, h_in, table, q.shape[-1] ** -0.5,
                                 layer.chunk_size, plan.backend, plan.options)
        # Always attached: a rank whose rows all start a document at its first token reads no
        # summary either, and the gather's backward collective must run on every rank.
        return comm.attach(o, gathered)
