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

Both backends run the one state-passing op (``state_passing.StatePassingGDN``) with
:class:`ScanLink` as its link; the eager backend hands it the shard's one summary as a single
segment. ``backend="triton"``: the Triton op hands the scan its own segment summaries through the
``StateLink`` hooks (``ops/gdn/state_link.py``: ``segment_maps`` in the forward,
``segment_state_grads`` in the backward, the op computes them even for one segment when the
link asks). The link composes the ``NS`` segment maps into the rank's ``(M_r, S_r)`` (and, in the
backward, the segment-local state gradients into ``(M_r^T, L_r)``) with a tree, runs the scan
where the op asks for its entering state (or the leaving state's gradient), and ignores the
leaving state (or the entering state's gradient): nobody waits for them. No summary is computed
outside the op and no forward is recomputed in the backward.

Packed batches (``cu_seqlens``, the shard's document table): the same rounds over the packed
chain's maps (``gdn/varlen.py``). Each rank's summary is its shard's tail map ``(M', S')``,
that of its LAST document piece (``M' = 0`` where that document starts inside the shard, so the
prefix composed past it forgets everything before; a shard that is the middle of one long
document passes its whole summary on). The exclusive prefix is then exactly the state the packed
chain would hand the rank, and it enters only a first piece that continues a document::

    forward of rank r (packed)
      post the scan's receives                          before any local work
      (M', S') = packed_tail_maps(...)                  last piece per row (r < P - 1)
      H_in     = exclusive prefix of the (M', S')       ceil(log2 P) rounds, as unpacked
      o        = packed_local_forward(..., H_in)        one varlen call over all pieces,
                                                        its graph kept for the backward
    backward: post the reverse scan's receives; packed_local_output_grads -> input grads and
      L_r = dH_in_local (zeros where no row continues); dH_out by the reverse scan over
      (M'^T, L); add_packed_tail_grads with dM' = dH_out H_in^T, dS' = dH_out    (r < P - 1)

Both backends: the pieces run as one varlen call of the plan's op (eager or Triton) and the
tail maps are the eager ``state_summary``, handed to :class:`ScanLink` as one segment; as in
the packed chain, the backward differentiates the pieces' graph the forward kept (recomputed
only where the forward kept none: ``state_passing.keeps_local_graph``) and recomputes the
tail maps.
"""

from __future__ import annotations

import torch

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.ops.gdn import tree_compose
from overlap_runtime.ops.gdn.state_link import StateLink

from .common import ContextParallelGDNMixer, GDNCPPlan
from .halo import local_core_inputs
from .scan_rounds import AffinePrefixRounds
from .state_passing import apply_state_passing, local_backend, state_passing_gdn
from .varlen import packed_shard_inputs

_FWD = "gdn prefix_scan forward (M, S)"
_BWD = "gdn prefix_scan backward (M^T, dH)"


class ScanLink(StateLink):
    """The state hooks running the prefix scan, for one forward or backward of one rank.

    The scan's receives are posted at construction (before the local work). Forward:
    :meth:`segment_maps` composes the backend's segment summaries (``[B*HV, NS, K, K]``,
    ``[B*HV, NS, K, V]``) into ``(M_r, S_r)``, :meth:`entering_state` runs the scan. Backward:
    :meth:`segment_state_grads` composes the transposed segment maps and the segment-local
    state gradients into ``(M_r^T, L_r)``, :meth:`leaving_state_grad` runs the reverse scan.
    Messages in ``dtype`` (fp32, float64 for float64 inputs).
    """

    #: Two segments at least (as the chain's link): their summaries run in parallel, where one
    #: segment would cost a whole sequential summary walk before the scan (one chunk: one).
    min_segments = 2
    profile_name = "gdn.prefix_scan"
    wants_segment_maps = True

    def __init__(self, plan: GDNCPPlan, state_shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device, reverse: bool) -> None:
        self.plan, self.state_shape = plan, state_shape
        rank, world = plan.rank, plan.cp_size
        # forward: every rank but the last sends its map; backward: every rank but the first
        self.leaves = rank > 0 if reverse else rank < world - 1
        self.scan = AffinePrefixRounds(plan, reverse, state_shape, dtype, device,
                                       _BWD if reverse else _FWD)
        self.m: torch.Tensor | None = None
        self.s: torch.Tensor | None = None

    def _rank_map(self, m: torch.Tensor | None, s: torch.Tensor) -> None:
        """``m [B*HV, NS, K, K]`` (None: one segment whose map no message carries: the scan's
        first position sends a state only), ``s [B*HV, NS, K, N]``, in time order."""
        batch, heads, key_dim, cols = self.state_shape
        if m is None:
            if s.shape[-3] != 1:
                raise ValueError(f"{self.scan.what}: segment maps are needed to compose "
                                 f"{s.shape[-3]} segments")
            m_r, s_r = None, s[..., 0, :, :]
        else:
            m_r, s_r = tree_compose(m, s)  # -> [B*HV, ...]
            m_r = m_r.reshape(batch, heads, key_dim, key_dim)
        self.m = m_r
        self.s = s_r.reshape(batch, heads, key_dim, cols)

    # forward
    def segment_maps(self, m_seg: torch.Tensor, s_seg: torch.Tensor) -> None:
        if self.leaves:  # the last rank's map is never sent
            self._rank_map(m_seg, s_seg)

    def entering_state(self) -> torch.Tensor | None:
        return self.scan.run(self.m, self.s)

    def leaving_state(self, h_out: torch.Tensor) -> None:
        """Nobody waits for it: the scan gave every rank its entering state."""

    # backward: the reverse walk over segments is a walk in time order over the transposed maps
    def segment_state_grads(self, m_seg: torch.Tensor | None, local: torch.Tensor) -> None:
        if self.leaves:  # rank 0 sends nothing in the reverse scan
            self._rank_map(None if m_seg is None else m_seg.transpose(-1, -2).flip(-3),
                           local.flip(-3))

    def leaving_state_grad(self) -> torch.Tensor | None:
        return self.scan.run(self.m, self.s)

    def entering_state_grad(self, dh_in: torch.Tensor) -> None:
        """Nobody waits for it: the reverse scan gave every rank its ``dH_out``."""

    def finish(self) -> None:
        """Wait every send of the scan (late: after the local work that followed it)."""
        self.scan.finish()


def gdn_prefix_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    plan: GDNCPPlan, chunk_size: int = 64,
) -> torch.Tensor:
    """The prefix scan on this rank's dense shard: q, k ``[B, L, H, K]``, v ``[B, L, HV, V]``,
    g ``[B, L, HV]`` fp32, beta ``[B, L, HV]`` -> o ``[B, L, HV, V]`` in v's dtype
    (``state_passing.state_passing_gdn`` with :class:`ScanLink`: checks first, raises, never
    falls back)."""
    return state_passing_gdn(q, k, v, g, beta, plan, ScanLink, chunk_size)


class PrefixScanGDNMixer(ContextParallelGDNMixer):
    """Sequence mixer of ``mode="prefix_scan"`` (see the module docstring)."""

    triton_min_segments = ScanLink.min_segments

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's shard ``proj`` (``[B, T_local, ...]``) -> ``o [B, T_local, HV, V]``."""
        q, k, v, g, beta = local_core_inputs(layer, self.plan, proj, mask)
        return gdn_prefix_scan(q, k, v, g, beta, self.plan, layer.chunk_size)

    def forward_packed(self, layer: GatedDeltaNet, proj: GDNProjections,
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed batch (global ``cu_seqlens``): the scan over the shards' tail maps (the
        shard's document table) -> ``o [B, T_local, HV, V]``."""
        plan = self.plan
        table, (q, k, v, g, beta) = packed_shard_inputs(layer, plan, proj, mask, cu_seqlens)
        scale = q.shape[-1] ** -0.5
        return apply_state_passing(q, k, v, g, beta,
                                   local_backend(plan, scale, layer.chunk_size), table, plan,
                                   ScanLink)
