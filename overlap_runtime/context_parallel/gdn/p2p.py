"""State-P2P GDN context parallelism: conv halo, affine summaries, a short state chain.

:class:`P2PGDNMixer` is the layer's sequence mixer in this mode. Every rank keeps all heads and its contiguous sequence shard. Only two things cross ranks: the
conv halo (``(kernel - 1) * dilation`` positions, to the next rank) and the fp32 GDN state
``[B, HV, K, V]`` (forward ``H`` to the next rank, backward ``dH`` to the previous one).

Forward of rank ``r`` (P ranks)::

    post irecv H_in (r > 0)
    prep  = prepare_chunks(q, k, v, g, beta)          WY factors, every chunk at once
    M, S  = summarize(prep)                           tree over chunks (r < P-1 only)
    wait H_in                                         <- the only wait on the chain
    H_out = M @ H_in + S  -> isend to r+1             one K x K x V product, sent at once
    o     = chunk_output(prep, H_in)                  scan + outputs, off the chain
    wait the send                                     after the local output

    time -->
    rank 0 | prep+sum |send H1| output                 |
    rank 1 | prep+sum |  wait |A|send H2| output       |
    rank 2 | prep+sum |  wait    |A|send H3| output    |
    rank 3 | prep     |  wait       | output           |    (the last rank needs no summary)

Backward of rank ``r`` (the mirror, with transposed maps)::

    post irecv dH_out (r < P-1)
    local: o = GDN(q, k, v, g, beta; H_in) again, autograd.grad(o, inputs + H_in, dO)
           -> input grads of the local output and dH_in_local       (before dH_out is needed)
    wait dH_out
    dH_in = M^T dH_out + dH_in_local -> isend to r-1    (r > 0)
    summary: grads of (M, S) with dM = dH_out H_in^T, dS = dH_out    (r < P-1)
    wait the send

So the backward chain also costs P x (one ``K x K x V`` product + one send): rank ``r``'s local
backward runs in parallel with every other rank's, before ``dH_out`` arrives.

What is saved for backward: the inputs (q, k, v, g, beta), ``H_in`` and ``M`` (one
``[B, HV, K, K]`` fp32); no chunk-level graph survives the forward (the local output backward goes
through the memory-lean ``chunk_gated_delta_rule``).

Both backends run the one state-passing op (``state_passing.StatePassingGDN``) with
:class:`ChainLink` as its link: the eager backend calls the link's hooks where the schedule above
has them; ``backend="triton"`` puts the chain inside the Triton op itself.
The op already splits a sequence into segments whose affine summaries it builds in parallel and
chains (``ops/gdn/triton/function.py``); across ranks the chain simply continues::

    forward   prepare, segment summaries (M_s, S_s)             no H_in needed
              wait H_in; chain H_in through the NS segment maps -> H_out, isend at once
              per-segment scans from their true states, outputs   (H_out travelling)
    backward  post irecv dH_out; dv_local, segment-local reverse scans (no dH_out)
              wait dH_out; reverse chain through the M_s^T -> dH_in, isend at once
              per-chunk reverse scan, every input-gradient kernel (dH_in travelling)

No rank computes anything a single GPU would not (the op's own summaries are the chain's
summaries; at least two segments per rank so that they exist), no forward is recomputed in the
backward (the op's saved tensors are kept), and each hop of the chain costs ``NS`` products of
``K x K x V`` plus one state send.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.ops.gdn.state_link import StateLink

from .common import ContextParallelGDNMixer, GDNCPPlan, post_recv, post_send
from .halo import local_core_inputs
from .state_passing import apply_state_passing, local_backend, state_passing_gdn
from .varlen import packed_shard_inputs


class ChainLink(StateLink):
    """The state hooks wired to the CP neighbours, for one forward or backward of one rank.

    Forward (``reverse=False``): ``H_in [B, HV, K, V]`` from ``r - 1`` (its receive posted at
    construction, before the local work), ``H_out`` to ``r + 1``. Backward (``reverse=True``):
    ``dH_out`` from ``r + 1``, ``dH_in`` to ``r - 1``. Messages in ``dtype`` (fp32, float64 for
    float64 inputs).
    """

    min_segments = 2
    profile_name = "gdn.p2p"

    def __init__(self, plan: GDNCPPlan, state_shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device, reverse: bool) -> None:
        self.plan, self.reverse = plan, reverse
        rank, world = plan.rank, plan.cp_size
        recv_from = (rank + 1 if rank < world - 1 else None) if reverse else (
            rank - 1 if rank > 0 else None)
        self.send_to = (rank - 1 if rank > 0 else None) if reverse else (
            rank + 1 if rank < world - 1 else None)
        self.leaves = self.send_to is not None
        self.recv: Any = None
        self.buf: torch.Tensor | None = None
        self.send: Any = None
        if recv_from is not None:
            self.buf = torch.empty(state_shape, dtype=dtype, device=device)
            self.recv = post_recv(self.buf, recv_from, plan, "gdn p2p backward dH_out"
                                  if reverse else "gdn p2p forward H_in")

    def _take(self) -> torch.Tensor | None:
        if self.recv is None:
            return None
        self.recv.wait()
        self.recv = None
        return self.buf

    def _send(self, x: torch.Tensor, what: str) -> None:
        if self.send_to is not None:
            self.send = post_send(x, self.send_to, self.plan, what)

    # forward: H from rank - 1, H_out to rank + 1
    def entering_state(self) -> torch.Tensor | None:
        return self._take()

    def leaving_state(self, h_out: torch.Tensor) -> None:
        self._send(h_out, "gdn p2p forward H_out")

    # backward: dH_out from rank + 1, dH_in to rank - 1
    def leaving_state_grad(self) -> torch.Tensor | None:
        return self._take()

    def entering_state_grad(self, dh_in: torch.Tensor) -> None:
        self._send(dh_in, "gdn p2p backward dH_in")

    def finish(self) -> None:
        """Wait the send (late: after the local work that followed it)."""
        if self.send is not None:
            self.send.wait()
            self.send = None


def gdn_state_chain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: GDNCPPlan,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The p2p chain on this rank's dense shard: q, k ``[B, L, H, K]``, v ``[B, L, HV, V]``, g
    ``[B, L, HV]`` fp32, beta ``[B, L, HV]`` -> o ``[B, L, HV, V]`` in v's dtype
    (``state_passing.state_passing_gdn`` with :class:`ChainLink`: checks first, raises, never
    falls back)."""
    return state_passing_gdn(q, k, v, g, beta, plan, ChainLink, chunk_size)


class P2PGDNMixer(ContextParallelGDNMixer):
    """Sequence mixer of ``mode="p2p"`` (see the module docstring)."""

    triton_min_segments = ChainLink.min_segments

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's shard ``proj`` (``[B, T_local, ...]``) -> ``o [B, T_local, HV, V]``."""
        q, k, v, g, beta = local_core_inputs(layer, self.plan, proj, mask)
        return gdn_state_chain(q, k, v, g, beta, self.plan, layer.chunk_size)

    def forward_packed(self, layer: GatedDeltaNet, proj: GDNProjections,
                       mask: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed batch (global ``cu_seqlens``): the chain over the shard's document table
        (``gdn/varlen.py``) -> ``o [B, T_local, HV, V]``."""
        plan = self.plan
        table, (q, k, v, g, beta) = packed_shard_inputs(layer, plan, proj, mask, cu_seqlens)
        scale = q.shape[-1] ** -0.5
        return apply_state_passing(q, k, v, g, beta,
                                   local_backend(plan, scale, layer.chunk_size), table, plan,
                                   ChainLink)
