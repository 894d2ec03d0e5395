"""GDN context parallelism on packed (THD) batches: documents reset the conv and the state.

Every rank holds the contiguous shard ``[r L, (r+1) L)`` of each row (``L = T / P``) and the
global ``cu_seqlens`` (the same on every rank). Cut by the document starts, a row of a shard is
a list of **pieces**; only the first can continue a document from the previous rank
(``cont_in``: no document starts at the shard's first token), only the last can continue into
the next::

    row    | d0 d0 d0 d1 d1 | d1 d1 d1 d1 d1 | d1 d2 d2 d3 d3 |     P = 3, L = 5
    rank 0: pieces [d0 d0 d0] [d1 d1]     cont_in False
    rank 1: pieces [d1 d1 d1 d1 d1]       cont_in True   (one piece: passes the state through)
    rank 2: pieces [d1] [d2 d2] [d3 d3]   cont_in True

**State chain.** A shard's affine map ``H_out = M' H_in + S'`` (per row) is that of its *last*
piece, from the last document's start inside the shard: when the shard is one piece that
continues a document, ``(M', S')`` is the whole shard's summary; otherwise ``M' = 0`` and ``S'``
is the last piece's final state from zero (earlier documents are ignored). ``H_in`` enters only
the first piece, and only when it continues a document. The pieces are a :class:`ShardTable`
(a dense shard is the table of whole rows), and the one state-passing op
(``state_passing.StatePassingGDN``: the p2p chain or the prefix scan, by its link) and the
summary all-gather run on these maps exactly as on whole rows; a document spanning
several ranks passes through the one-piece ranks' ``M'``. The pieces' forward
(:func:`packed_local_forward`, which keeps the pieces' graph for the backward), their
backward (:func:`packed_local_output_grads`) and the tail maps' (:func:`add_packed_tail_grads`)
serve both links.

**Conv halo.** The previous rank's last ``halo`` positions still travel (``halo.HaloConv``),
and the depthwise conv is computed tap by tap with each tap kept only where the tap's token is
in the output token's document (``halo.DocumentConv``, the table's ``doc_ids``), so no window
crosses a document start, inside a shard or across the rank boundary.

**Ulysses** gathers whole rows per head group, so it runs the single-device packed path (one
conv with ``doc_positions``, one varlen op call) on the full rows with the global ``cu_seqlens``.

**Backends.** The pieces of all rows run as ONE varlen call of the plan's local op
(``cu_seqlens`` over the rows flattened, :func:`packed_local_outputs`):
``backend="eager"`` or ``"triton"`` (a piece shorter than a chunk or not a multiple of 64 is a
partial chunk, which the kernels mask). The continuing first pieces take ``H_in`` as their rows
of the call's per-sequence ``initial_state`` (zeros for the other pieces) and its backward
returns ``dH_in_local`` as those rows of the op's ``dh0``. The tail maps ``(M', S')`` are always
computed by the eager :func:`state_summary` (plain PyTorch, fp32, differentiable), with either
backend: exact, but one extra prepare of the last piece per row (the unpacked Triton p2p chain
reuses the op's own segment summaries instead), one call per row. A shard whose every row is
one piece continuing a document is whole rows (``ShardTable.whole_rows``) and runs as a dense
shard does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet, GDNProjections
from overlap_runtime.layers.segments import segments_of
from overlap_runtime.ops.gdn import (
    GDNKernelOptions,
    chunk_gated_delta_rule,
    state_summary,
)

from overlap_runtime.ops import comm
from .common import GDNCPPlan
from .halo import local_core_inputs


@dataclass(frozen=True)
class ShardTable:
    """The layout of one rank's shard ``[B, L]`` as pieces: a ``cu_seqlens`` table.

    A dense batch is whole rows (:meth:`dense`: one piece per row, each continuing whatever
    state enters the shard); a packed batch cuts each row at the document starts
    (:func:`_shard_table`, module docstring). The local ops read the table, not the kind of
    batch: whole rows run the op on ``[B, L]`` with ``H_in`` entering every row, pieces run one
    varlen call over the rows flattened to ``[1, B * L]`` (:meth:`cu_seqlens`).

    Attributes:
        length: ``L``, the shard's tokens per row.
        rows: per row, the ``(start, end)`` of each piece in local positions ``[0, L)``.
        cont_in: per row, whether the first piece continues the state entering the shard.
        doc_ids: ``[B, halo + L]`` int64 document of the ``halo`` positions before the shard
            and of the shard's tokens (-1 before the first row's start); None for whole rows.
    """

    length: int
    rows: tuple[tuple[tuple[int, int], ...], ...]
    cont_in: tuple[bool, ...]
    doc_ids: torch.Tensor | None = None

    @classmethod
    def dense(cls, batch: int, length: int) -> ShardTable:
        """Whole rows: ``B`` pieces ``[0, L)``, every one continuing the entering state."""
        return cls(length, (((0, length),),) * batch, (True,) * batch)

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def whole_rows(self) -> bool:
        """Every row is one piece that continues the entering state (a dense shard)."""
        return all(cont and row == ((0, self.length),) for row, cont in
                   zip(self.rows, self.cont_in))

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[N + 1]`` int64 offsets of the ``N`` pieces over the rows flattened to ``B * L``."""
        offsets = [0]
        for b, row in enumerate(self.rows):
            offsets.extend(b * self.length + e for _, e in row)
        return torch.tensor(offsets, dtype=torch.int64, device=device)

    def first_pieces(self) -> list[int]:
        """Per row, the index of its first piece among the ``N``."""
        firsts, n = [], 0
        for row in self.rows:
            firsts.append(n)
            n += len(row)
        return firsts


def _shard_table(cu_seqlens: torch.Tensor, batch: int, local_len: int, cp_size: int,
                rank: int, halo: int) -> ShardTable:
    """The table of rank ``rank``'s shard of a packed batch ``[B, P * local_len]`` with the
    global ``cu_seqlens``."""
    seq_len = local_len * cp_size
    segs = segments_of(cu_seqlens, batch, seq_len)
    starts = torch.tensor([a for a, _ in segs], dtype=torch.int64)
    start_set = set(starts.tolist())
    rows, cont = [], []
    for b in range(batch):
        lo = b * seq_len + rank * local_len
        cuts = [0] + [i for i in range(1, local_len) if lo + i in start_set] + [local_len]
        rows.append(tuple(zip(cuts[:-1], cuts[1:])))
        cont.append(lo not in start_set)
    flat = (torch.arange(batch)[:, None] * seq_len + rank * local_len
            + torch.arange(-halo, local_len)[None, :])
    doc = torch.searchsorted(starts, flat.clamp(min=0), right=True) - 1
    doc = torch.where(flat < 0, -1, doc)
    return ShardTable(local_len, tuple(rows), tuple(cont), doc)


def packed_shard_inputs(layer: GatedDeltaNet, plan: GDNCPPlan, proj: GDNProjections,
                        mask: torch.Tensor | None, cu_seqlens: torch.Tensor
                        ) -> tuple[ShardTable, tuple[torch.Tensor, ...]]:
    """A packed call's checks (:func:`check_packed_call`), this shard's table and its core
    inputs (``halo.local_core_inputs`` with the table's document ids: the conv stays inside
    documents): the prologue of every state-passing mode."""
    batch, local_len = proj.mixed_qkv.shape[:2]
    check_packed_call(layer, plan, cu_seqlens, batch, local_len)
    table = _shard_table(cu_seqlens, batch, local_len, plan.cp_size, plan.rank, layer.conv_halo)
    return table, local_core_inputs(layer, plan, proj, mask, table.doc_ids)


def packed_local_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, h_in: torch.Tensor | None, table: ShardTable,
                         scale: float, chunk_size: int, backend: str,
                         options: GDNKernelOptions | None = None) -> torch.Tensor:
    """``o [B, L, HV, V]``: every piece from a zero state, except a first piece that continues
    a document, which starts from ``h_in[b]`` (``[B, HV, K, V]`` fp32, or None on rank 0).

    ONE varlen op call (``table.cu_seqlens()``) over the rows flattened to ``[1, B * L, ...]``,
    the pieces as its N sequences; ``initial_state`` ``[N, HV, K, V]`` holds ``h_in[b]`` at each
    continuing row's first piece and zeros elsewhere (None when no piece continues), so its
    backward hands ``dH_in_local`` to ``h_in`` through the same call."""
    batch, length = q.shape[:2]
    cu = table.cu_seqlens(q.device)
    init = None
    cont = [b for b in range(batch) if table.cont_in[b]]
    if h_in is not None and cont:
        firsts = table.first_pieces()
        idx = torch.tensor([firsts[b] for b in cont], dtype=torch.int64, device=q.device)
        init = h_in.new_zeros(cu.numel() - 1, *h_in.shape[1:]).index_copy(0, idx, h_in[cont])
    flat = [x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(*flat, scale=scale, initial_state=init, use_qk_l2norm=True,
                                  chunk_size=chunk_size, backend=backend, cu_seqlens=cu,
                                  options=options)
    return o.reshape(batch, length, *o.shape[2:])


def packed_tail_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, table: ShardTable, chunk_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the shard's map ``(M' [B, HV, K, K], S' [B, HV, K, V])`` fp32 (docstring)."""
    ms, ss = [], []
    for b, row in enumerate(table.rows):
        s, e = row[-1]
        m, st = state_summary(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e],
                              g[b:b + 1, s:e], beta[b:b + 1, s:e], use_qk_l2norm=True,
                              chunk_size=chunk_size)
        if not (len(row) == 1 and table.cont_in[b]):
            m = torch.zeros_like(m)  # the last document starts inside the shard: H_in is lost
        ms.append(m)
        ss.append(st)
    return torch.cat(ms, 0), torch.cat(ss, 0)


class PackedLocalGraph:
    """The autograd graph of one forward's :func:`packed_local_outputs`, kept for that call's
    backward (:func:`packed_local_forward`) and handed out once (:meth:`take`).

    Per call, never on a module: the autograd Function keeps it as its ``ctx`` metadata. It
    holds ``(leaves, h_leaf, out)``: the five detached leaves the op ran on, the leaf of the
    entering state (None on the first rank) and the op's output ``[B, L, HV, V]``, whose
    ``grad_fn`` reaches the op's saved tensors. ``out`` is not the Function's output (that is
    ``out.detach()``), so nothing in the graph points back at the Function's node: the graph
    goes when :meth:`take`'s caller drops it.
    """

    __slots__ = ("_graph",)

    def __init__(self, leaves: list[torch.Tensor], h_leaf: torch.Tensor | None,
                 out: torch.Tensor) -> None:
        self._graph: tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor] | None = (
            leaves, h_leaf, out)

    def take(self) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor] | None:
        """``(leaves, h_leaf, out)`` the first time, then None (this object forgets it)."""
        graph, self._graph = self._graph, None
        return graph


def packed_local_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h_in: torch.Tensor | None, table: ShardTable, scale: float, chunk_size: int, backend: str,
    options: GDNKernelOptions | None = None, keep_graph: bool = False,
) -> tuple[torch.Tensor, PackedLocalGraph | None]:
    """:func:`packed_local_outputs` for a state-passing forward: ``(o [B, L, HV, V], graph)``.

    ``keep_graph`` False: the op runs as given (no graph is built here) and ``graph`` is None;
    the backward then runs the op again (:func:`packed_local_output_grads`). True: the op
    runs ONCE under ``torch.enable_grad()`` on detached leaves of the five inputs and of
    ``h_in`` (the very tensor that entered the shard) and ``graph`` keeps that graph, which
    the backward differentiates instead of recomputing the forward; ``o`` is its output
    detached (the same values, bit for bit, as the op run without a graph).

    What the kept graph holds until the backward: aliases of q, k ``[B, L, H, K]``, v
    ``[B, L, HV, V]``, g, beta ``[B, L, HV]``, ``h_in [B, HV, K, V]`` and ``o`` (no copies;
    the Function saves the inputs and ``h_in`` anyway) and the op's own saved tensors: eager,
    the flattened inputs (aliases), ``initial_state [N, HV, K, V]`` (``N`` pieces; only when a
    row continues a document) and one boundary state ``[HV, K, V]`` per ``block_chunks``
    chunks of each piece, in the state dtype (fp32, float64 for float64 inputs); Triton, its
    saved set (``ops/gdn/triton/function.py::gdn_forward``: contiguous inputs, the q/k norms,
    gates, ``Ainv [1, B*L, HV, 64]``, w unless ``recompute_w``, one fp32 ``[K, V]`` state per
    chunk and head, ``v_new [1, B*L, HV, V]``), plus the index tensors of the ``h_in``
    scatter. That is one forward's activations of the local op, the memory a plain
    (non-context-parallel) layer keeps too.
    """
    if not keep_graph:
        return packed_local_outputs(q, k, v, g, beta, h_in, table, scale, chunk_size, backend,
                                    options), None
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    h_leaf = None if h_in is None else h_in.detach().requires_grad_(True)
    with torch.enable_grad():
        out = packed_local_outputs(*leaves, h_leaf, table, scale, chunk_size, backend, options)
    return out.detach(), PackedLocalGraph(leaves, h_leaf, out)


def packed_local_output_grads(
    inputs: tuple[torch.Tensor, ...], h_in: torch.Tensor | None, do: torch.Tensor,
    table: ShardTable, scale: float, chunk_size: int, backend: str,
    options: GDNKernelOptions | None = None, kept: PackedLocalGraph | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None, list[torch.Tensor]]:
    """Backward of a shard's pieces alone (:func:`packed_local_outputs`).

    Args:
        inputs: ``(q, k, v, g, beta)`` as saved by the forward.
        h_in: ``[B, HV, K, V]`` the state that entered the shard (None on the first rank).
        do: ``[B, L, HV, V]`` gradient of the pieces' outputs.
        kept: the forward's graph (:func:`packed_local_forward`): differentiated, then
            released (``kept`` forgets it). None, or already taken (a second backward through
            a retained graph): the op runs again on detached leaves of ``inputs`` and
            ``h_in`` (a forward that ran without grad or under saved-tensor hooks keeps none).

    Returns:
        ``(grads, dH_in_local, leaves)``: the five input gradients (zeros where an input does
        not reach the output), ``dH_in_local [B, HV, K, V]`` (zeros where no row continues a
        document; None when ``h_in`` is None) and the detached leaves for
        :func:`add_packed_tail_grads`.
    """
    graph = None if kept is None else kept.take()
    if graph is None:  # nothing kept: run the op again, building the graph here
        _, rebuilt = packed_local_forward(*inputs, h_in, table, scale, chunk_size, backend,
                                          options, keep_graph=True)
        graph = rebuilt.take()  # type: ignore[union-attr]
    leaves, h_leaf, o = graph
    del graph
    with torch.enable_grad():
        wanted = leaves + ([h_leaf] if h_leaf is not None else [])
        local = list(torch.autograd.grad(o, wanted, do, allow_unused=True))
    del o  # the graph's last reference: its saved tensors were freed by the grad call
    dh_local = local.pop() if h_leaf is not None else None
    if dh_local is None and h_leaf is not None:  # no row continues a document
        dh_local = torch.zeros_like(h_leaf)
    grads = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(local, leaves)]
    return grads, dh_local, leaves


def add_packed_tail_grads(
    grads: list[torch.Tensor], leaves: list[torch.Tensor], table: ShardTable,
    h_in: torch.Tensor | None, dh_out: torch.Tensor, chunk_size: int,
) -> list[torch.Tensor]:
    """``grads`` plus the gradient through the shard's tail maps ``H_out = M' H_in + S'``
    (:func:`packed_tail_maps`, recomputed on ``leaves``) given ``dH_out [B, HV, K, V]``:
    ``dM' = dH_out H_in^T`` (skipped when ``h_in`` is None or every row's ``M'`` is 0),
    ``dS' = dH_out``."""
    with torch.enable_grad():
        m2, s2 = packed_tail_maps(*leaves, table, chunk_size)
        outs, gouts = [s2], [dh_out.to(s2.dtype)]
        if h_in is not None and m2.requires_grad:
            outs.append(m2)
            gouts.append(dh_out.to(m2.dtype) @ h_in.to(m2.dtype).transpose(-1, -2))
        extra = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
    return [gr if e is None else gr + e for gr, e in zip(grads, extra)]


def check_packed_call(layer: GatedDeltaNet, plan: GDNCPPlan, cu_seqlens: torch.Tensor,
                      batch: int, local_len: int) -> None:
    """The packed rules, on every rank alike: ranks agree on ``cu_seqlens``; it is valid over
    ``B * P * L`` tokens. Raises naming the value and the rule (either backend: the Triton rules
were checked in ``prepare_inputs``)."""
    cu = tuple(int(c) for c in cu_seqlens.tolist()) if cu_seqlens.dim() == 1 else None
    comm.check_ranks_agree(f"GatedDeltaNet context parallelism (mode={plan.mode!r}, packed)",
                           [("cu_seqlens", cu)], plan.group, device=cu_seqlens.device,
                           group_name="cp", timeout_s=plan.timeout_s)
    segments_of(cu_seqlens, batch, local_len * plan.cp_size)
