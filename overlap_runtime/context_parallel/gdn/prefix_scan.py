"""Prefix-scan GDN context parallelism: every rank's entering state in ``ceil(log2 P)`` rounds.

:class:`PrefixScanGDNMixer` is the layer's sequence mixer of ``mode="prefix_scan"``. Like the
p2p chain (``gdn/p2p.py``) every rank keeps all heads and its contiguous shard, the conv halo
goes to the next rank, and each rank summarises its shard as one affine map ``(M_r, S_r)``.
Instead of the chain (rank ``r`` waits for ``r - 1``'s ``H_out``: ``P - 1`` hops in sequence)
the ranks run an exclusive prefix over the maps in ``ceil(log2 P)`` rounds of point-to-point
messages (``gdn/scan_rounds.py``: Hillis-Steele, why not Blelloch, which messages carry a
pair and which a state)::

    forward of rank r
      post the scan's receives (every round)            before any local work
      prep  = prepare_chunks(...)                       WY factors, every chunk at once
      M, S  = summarize(prep)                           tree over chunks (r < P - 1)
      H_in  = exclusive prefix of (M_0, S_0) .. (M_(r-1), S_(r-1))    log2 P rounds
      o     = chunk_output(prep, H_in)
      wait the scan's sends

    backward of rank r (the reversed prefix over the transposed summaries)
      post the reverse scan's receives
      local backward of o from H_in -> input grads, dH_in_local = L_r      no message needed
      dH_out = exclusive prefix, in reverse rank order, of (M_j^T, L_j), j > r
               (dH_out_r = M_(r+1)^T dH_out_(r+1) + L_(r+1), dH_out_(P-1) = 0)
      summary backward with dM = dH_out H_in^T, dS = dH_out           (r < P - 1)
      wait the sends

Per rank and direction: at most ``ceil(log2 P)`` receives and sends of ``[B, HV, K, K + V]`` fp32
(a pair) or ``[B, HV, K, V]`` (a state), and one compose (a ``K x K x (K + V)`` product) per
round; the chain sends one state and does one ``K x K x V`` product, but its critical path is
``P - 1`` hops. docs/gdn_context_parallel.md has the latency model and when each wins.

``backend="triton"``: the Triton op hands the scan its own segment summaries through the
``StateLink`` hooks (``ops/gdn/state_link.py``: ``segment_maps`` in the forward,
``segment_state_grads`` in the backward, the op computes them even for one segment when the
link asks). The link composes the ``NS`` segment maps into the rank's ``(M_r, S_r)`` (and, in the
backward, the segment-local state gradients into ``(M_r^T, L_r)``) with a tree, runs the scan
where the op asks for its entering state (or the leaving state's gradient), and ignores the
leaving state (or the entering state's gradient): nobody waits for them. No summary is computed
outside the op and no forward is recomputed in the backward.

Packed batches (``cu_seqlens``, :class:`PackedPrefixScan`): the same rounds over the packed
chain's maps (``gdn/varlen.py``). Each rank's summary is its shard's tail map ``(M', S')``,
that of its LAST document piece (``M' = 0`` where that document starts inside the shard, so the
prefix composed past it forgets everything before; a shard that is the middle of one long
document passes its whole summary on). The exclusive prefix is then exactly the state the packed
chain would hand the rank, and it enters only a first piece that continues a document::

    forward of rank r (packed)
      post the scan's receives                          before any local work
      (M', S') = packed_tail_maps(...)                  last piece per row (r < P - 1)
      H_in     = exclusive prefix of the (M', S')       ceil(log2 P) rounds, as unpacked
      o        = packed_local_outputs(..., H_in)        one varlen call over all pieces
    backward: post the reverse scan's receives; packed_local_output_grads -> input grads and
      L_r = dH_in_local (zeros where no row continues); dH_out by the reverse scan over
      (M'^T, L); add_packed_tail_grads with dM' = dH_out H_in^T, dS' = dH_out    (r < P - 1)

Both backends: the pieces run as one varlen call of the plan's op (eager or Triton) and the
tail maps are the eager ``state_summary`` (as the packed chain: no ``StateLink``); the local
output and the tail maps are recomputed in the backward, as the packed chain does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.ops.gdn import (
    chunk_output,
    prepare_chunks,
    summarize,
    tree_compose,
)
from overlap_runtime.ops.gdn.state_link import StateLink
from overlap_runtime.ops.profile_range import profile_range

from .common import (ContextParallelGDNMixer, GDNCPPlan, check_state_passing_call,
                     local_core_inputs)
from .p2p import add_summary_grads, local_output_grads
from .scan_rounds import AffinePrefixRounds
from .varlen import (ShardPieces, add_packed_tail_grads, packed_local_output_grads,
                     packed_local_outputs, packed_shard_inputs, packed_tail_maps)

__all__ = ["GDNPrefixScan", "TritonPrefixScan", "PackedPrefixScan", "gdn_prefix_scan",
           "PrefixScanGDNMixer"]

_FWD = "gdn prefix_scan forward (M, S)"
_BWD = "gdn prefix_scan backward (M^T, dH)"
_PACKED_FWD = "gdn packed prefix_scan forward (M', S')"
_PACKED_BWD = "gdn packed prefix_scan backward (M'^T, dH)"


def _state_shape(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    return (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])


class GDNPrefixScan(torch.autograd.Function):
    """``apply(q, k, v, g, beta, plan, scale, chunk_size) -> o [B, T, HV, V]`` (v's dtype).

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV]`` fp32, beta ``[B, T, HV]``: this
    rank's contiguous shard (any length: a partial last chunk is masked). q and k are
    l2-normalised inside. The state entering the rank is the prefix of the earlier ranks'
    summaries (module docstring); states and maps are fp32 (float64 for float64 inputs).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, plan: GDNCPPlan, scale: float, chunk_size: int,
    ) -> torch.Tensor:
        rank, world = plan.rank, plan.cp_size
        state_dtype = torch.promote_types(q.dtype, torch.float32)
        scan = AffinePrefixRounds(plan, False, _state_shape(k, v), state_dtype, q.device, _FWD)
        with profile_range("gdn.prefix_scan fwd local prepare+summary"):
            prep = prepare_chunks(q, k, v, g, beta, scale, True, chunk_size)
            m = s = None
            if rank < world - 1:
                m, s = summarize(prep)
        with profile_range("gdn.prefix_scan fwd scan"):
            h_in = scan.run(m, s)
        with profile_range("gdn.prefix_scan fwd local output"):
            o, _ = chunk_output(prep, h_in)
        scan.finish()
        # M is kept where the backward's scan sends pairs (0 < r < P - 1); H_in where r > 0.
        ctx.save_for_backward(q, k, v, g, beta, h_in, m if 0 < rank < world - 1 else None)
        ctx.plan, ctx.scale, ctx.chunk_size = plan, scale, chunk_size
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, g, beta, h_in, m = ctx.saved_tensors
        plan: GDNCPPlan = ctx.plan
        rank, world = plan.rank, plan.cp_size
        state_dtype = torch.promote_types(q.dtype, torch.float32)
        scan = AffinePrefixRounds(plan, True, _state_shape(k, v), state_dtype, q.device, _BWD)
        needs = ctx.needs_input_grad[:5]
        with profile_range("gdn.prefix_scan bwd local output"):
            grads, dh_in_local, leaves = local_output_grads(
                (q, k, v, g, beta), needs, h_in, do, ctx.scale, ctx.chunk_size, plan.backend,
                plan.options)
        with profile_range("gdn.prefix_scan bwd scan"):
            m_t = None if m is None else m.transpose(-1, -2)
            dh_out = scan.run(m_t, dh_in_local)  # None on the last rank: nothing after it
        if dh_out is not None and rank < world - 1 and any(needs):
            with profile_range("gdn.prefix_scan bwd summary"):
                add_summary_grads(grads, leaves, needs, h_in, dh_out, ctx.scale, ctx.chunk_size)
        scan.finish()
        grads = [gr.to(x.dtype) if gr is not None else None
                 for gr, x in zip(grads, (q, k, v, g, beta))]
        return (*grads, None, None, None)


class _ScanLink(StateLink):
    """The Triton op's state hooks running the prefix scan, for one forward or backward.

    The scan's receives are posted at construction (before the op's local work). Forward:
    :meth:`segment_maps` composes the op's segment summaries into ``(M_r, S_r)``,
    :meth:`entering_state` runs the scan. Backward: :meth:`segment_state_grads` composes the
    transposed segment maps and the segment-local state gradients into ``(M_r^T, L_r)``,
    :meth:`leaving_state_grad` runs the reverse scan.
    """

    #: Two segments at least (as the chain's link): their summaries run in parallel, where one
    #: segment would cost a whole sequential summary walk before the scan (one chunk: one).
    min_segments = 2
    wants_segment_maps = True

    def __init__(self, plan: GDNCPPlan, state_shape: tuple[int, int, int, int],
                 device: torch.device, reverse: bool) -> None:
        self.plan, self.state_shape = plan, state_shape
        self.scan = AffinePrefixRounds(plan, reverse, state_shape, torch.float32, device,
                                       _BWD if reverse else _FWD)
        self.m: torch.Tensor | None = None
        self.s: torch.Tensor | None = None

    def _rank_map(self, m: torch.Tensor, s: torch.Tensor) -> None:
        batch, heads, key_dim, cols = self.state_shape
        m_r, s_r = tree_compose(m, s)  # [B*HV, NS, ...] in time order -> [B*HV, ...]
        self.m = m_r.reshape(batch, heads, key_dim, key_dim)
        self.s = s_r.reshape(batch, heads, key_dim, cols)

    # forward
    def segment_maps(self, m_seg: torch.Tensor, s_seg: torch.Tensor) -> None:
        rank, world = self.plan.rank, self.plan.cp_size
        if rank < world - 1:  # the last rank's map is never sent
            self._rank_map(m_seg, s_seg)

    def entering_state(self) -> torch.Tensor | None:
        return self.scan.run(self.m, self.s)

    def leaving_state(self, h_out: torch.Tensor) -> None:
        """Nobody waits for it: the scan gave every rank its entering state."""

    # backward: the reverse walk over segments is a walk in time order over the transposed maps
    def segment_state_grads(self, m_seg: torch.Tensor, local: torch.Tensor) -> None:
        if self.plan.rank > 0:  # rank 0 sends nothing in the reverse scan
            self._rank_map(m_seg.transpose(-1, -2).flip(-3), local.flip(-3))

    def leaving_state_grad(self) -> torch.Tensor | None:
        return self.scan.run(self.m, self.s)

    def entering_state_grad(self, dh_in: torch.Tensor) -> None:
        """Nobody waits for it: the reverse scan gave every rank its ``dH_out``."""


class TritonPrefixScan(torch.autograd.Function):
    """``apply(q, k, v, g, beta, plan, scale) -> o [B, T, HV, V]`` with the scan inside the
    Triton op's state hooks (module docstring). Shapes as :class:`GDNPrefixScan`;
    q/k/v/beta bf16/fp16/fp32, g fp32; ``T`` a multiple of 64."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, plan: GDNCPPlan, scale: float,
    ) -> torch.Tensor:
        from overlap_runtime.ops.gdn.triton.function import gdn_forward

        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        shape = _state_shape(k, v)
        link = _ScanLink(plan, shape, q.device, reverse=False)
        o, _, saved, meta = gdn_forward(q, k, v, g, beta, None, scale, True, link=link,
                                        **plan.triton_kwargs())
        link.scan.finish()
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.plan, ctx.state_shape = meta, plan, shape
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        from overlap_runtime.ops.gdn.triton.function import gdn_backward

        link = _ScanLink(ctx.plan, ctx.state_shape, do.device, reverse=True)
        dq, dk, dv, dg, dbeta, _ = gdn_backward(ctx.saved_tensors, ctx.meta, do, None,
                                                link=link)
        link.scan.finish()
        return dq, dk, dv, dg, dbeta, None, None


class PackedPrefixScan(torch.autograd.Function):
    """``apply(q, k, v, g, beta, pieces, plan, scale, chunk_size) -> o [B, L, HV, V]`` (v's
    dtype) on a packed shard (module docstring, "Packed batches").

    q, k ``[B, L, H, K]``, v ``[B, L, HV, V]``, g ``[B, L, HV]`` fp32, beta ``[B, L, HV]``: this
    rank's contiguous shard; ``pieces`` its document pieces (``varlen.shard_pieces``). States and
    maps are fp32 (float64 for float64 inputs); either backend (``plan.backend``) for the
    pieces' one varlen call.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, pieces: ShardPieces, plan: GDNCPPlan, scale: float,
                chunk_size: int) -> torch.Tensor:
        rank, world = plan.rank, plan.cp_size
        state_dtype = torch.promote_types(q.dtype, torch.float32)
        scan = AffinePrefixRounds(plan, False, _state_shape(k, v), state_dtype, q.device,
                                  _PACKED_FWD)
        m = s = None
        if rank < world - 1:  # the last rank's map is never sent
            with profile_range("gdn.prefix_scan packed fwd tail maps"):
                m, s = packed_tail_maps(q, k, v, g, beta, pieces, chunk_size)
        with profile_range("gdn.prefix_scan packed fwd scan"):
            h_in = scan.run(m, s)
        with profile_range("gdn.prefix_scan packed fwd local output"):
            o = packed_local_outputs(q, k, v, g, beta, h_in, pieces, scale, chunk_size,
                                     plan.backend, plan.options)
        scan.finish()
        # M' is kept where the backward's scan sends pairs (0 < r < P - 1); H_in where r > 0.
        ctx.save_for_backward(q, k, v, g, beta, h_in, m if 0 < rank < world - 1 else None)
        ctx.pieces, ctx.plan, ctx.scale, ctx.chunk_size = pieces, plan, scale, chunk_size
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, g, beta, h_in, m = ctx.saved_tensors
        plan: GDNCPPlan = ctx.plan
        rank, world = plan.rank, plan.cp_size
        state_dtype = torch.promote_types(q.dtype, torch.float32)
        scan = AffinePrefixRounds(plan, True, _state_shape(k, v), state_dtype, q.device,
                                  _PACKED_BWD)
        with profile_range("gdn.prefix_scan packed bwd local output"):
            grads, dh_local, leaves = packed_local_output_grads(
                (q, k, v, g, beta), h_in, do, ctx.pieces, ctx.scale, ctx.chunk_size,
                plan.backend, plan.options)
        with profile_range("gdn.prefix_scan packed bwd scan"):
            m_t = None if m is None else m.transpose(-1, -2)
            dh_out = scan.run(m_t, dh_local)  # None on the last rank: nothing after it
        if dh_out is not None and rank < world - 1:
            with profile_range("gdn.prefix_scan packed bwd tail maps"):
                grads = add_packed_tail_grads(grads, leaves, ctx.pieces, h_in, dh_out,
                                              ctx.chunk_size)
        scan.finish()
        grads = [gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta))]
        return (*grads, None, None, None, None)


def gdn_prefix_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    plan: GDNCPPlan, chunk_size: int = 64,
) -> torch.Tensor:
    """Validate, check the backend (raises, never falls back), then run the prefix scan.

    The checks run before any message, on every rank alike (same shapes), so a refusal raises
    everywhere instead of leaving a peer waiting.

    Returns:
        o ``[B, T_local, HV, V]`` in v's dtype.
    """
    check_state_passing_call(q, k, v, g, beta, plan, chunk_size, "prefix_scan")
    scale = q.shape[-1] ** -0.5
    if plan.backend == "triton":
        return TritonPrefixScan.apply(q, k, v, g, beta, plan, scale)
    return GDNPrefixScan.apply(q, k, v, g, beta, plan, scale, chunk_size)


class PrefixScanGDNMixer(ContextParallelGDNMixer):
    """Sequence mixer of ``mode="prefix_scan"`` (see the module docstring)."""

    triton_min_segments = _ScanLink.min_segments

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's shard ``proj`` (``[B, T_local, ...]``) -> ``o [B, T_local, HV, V]``."""
        q, k, v, g, beta = local_core_inputs(layer, self.plan, proj, mask)
        return gdn_prefix_scan(q, k, v, g, beta, self.plan, layer.chunk_size)

    def forward_packed(self, layer: GatedDeltaNet, proj: GDNProjections,
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed batch (global ``cu_seqlens``): the scan over the shards' tail maps
        (:class:`PackedPrefixScan`) -> ``o [B, T_local, HV, V]``."""
        pieces, (q, k, v, g, beta) = packed_shard_inputs(layer, self.plan, proj, mask,
                                                         cu_seqlens)
        return PackedPrefixScan.apply(q, k, v, g, beta, pieces, self.plan, q.shape[-1] ** -0.5,
                                      layer.chunk_size)
