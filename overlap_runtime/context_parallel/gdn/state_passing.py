"""The one state-passing GDN op of context parallelism: a local backend driven through a link.

The p2p chain and the prefix scan differ only in where the state entering a rank comes from
and where the state leaving it goes; that is a :class:`~overlap_runtime.ops.gdn.state_link.
StateLink` (``p2p.ChainLink``: from ``r - 1``, to ``r + 1``; ``prefix_scan.ScanLink``: the
exclusive prefix of every earlier rank's map in ``ceil(log2 P)`` rounds). The local GDN of the
shard is a backend that calls the link's hooks where its algebra allows:

* :class:`EagerLocal` (``backend="eager"``, or the Triton op on document pieces): the shard's
  affine map ``H_out = M H_in + S`` is formed in PyTorch (one segment:
  :meth:`StateLink.segment_maps` gets ``[B*HV, 1, ...]``), then ``entering_state``, the leaving
  state, the outputs from ``H_in``. Its backward differentiates the local output alone
  (``dH_in_local`` and the input gradients, no message needed: on document pieces through the
  graph the forward kept, ``varlen.packed_local_forward``; on whole rows, or where the forward
  kept none, recomputed), then ``leaving_state_grad``,
  ``dH_in = M^T dH_out + dH_in_local`` to ``entering_state_grad``, then the map's own backward
  with ``dM = dH_out H_in^T``, ``dS = dH_out``.
* :class:`TritonLocal` (``backend="triton"``): on whole rows the Triton op itself calls the
  hooks at its segment boundaries (``ops/gdn/triton/function.py``); its saved tensors serve the
  backward, nothing is recomputed. On document pieces it runs :class:`EagerLocal`'s schedule
  with the Triton op for the pieces.

The shard's layout is a table (``varlen.ShardTable``): whole rows (a dense batch) or document
pieces (a packed batch, global ``cu_seqlens``). On pieces the map is the tail map ``(M', S')`` of
each row's last piece and ``H_in`` enters only a first piece that continues a document
(``varlen`` module docstring).

:class:`StatePassingGDN` is the autograd Function: it builds the forward link (its receives are
posted before any local work), runs the backend, waits the link's sends after the local
output; the backward does the same with the backward link.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.autograd.function import once_differentiable

from overlap_runtime.ops.gdn import (
    GDNKernelOptions,
    apply_summary,
    apply_summary_backward,
    chunk_gated_delta_rule,
    chunk_output,
    prepare_chunks,
    summarize,
)
from overlap_runtime.ops.gdn.state_link import StateLink
from overlap_runtime.ops.profile_range import profile_range

from .common import GDNCPPlan, check_state_passing_call
from .varlen import (
    ShardTable,
    add_packed_tail_grads,
    packed_local_forward,
    packed_local_output_grads,
    packed_tail_maps,
)

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class CPLink(Protocol):
    """What :class:`StatePassingGDN` needs of a link type: built per call, with its receives
    posted at construction; :meth:`finish` waits its sends."""

    min_segments: int
    #: Prefix of the local backend's profile ranges (``"gdn.p2p"``, ``"gdn.prefix_scan"``).
    profile_name: str

    def __init__(self, plan: GDNCPPlan, state_shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device, reverse: bool) -> None: ...

    def finish(self) -> None: ...


def _as_segment(x: torch.Tensor) -> torch.Tensor:
    """``[B, HV, K, N]`` -> ``[B*HV, 1, K, N]``: one segment in the op's hook layout."""
    return x.reshape(-1, 1, *x.shape[-2:])


class EagerLocal:
    """The local GDN of one shard in PyTorch, driven through a :class:`StateLink`.

    Args:
        backend: the op for the outputs of document pieces (``"eager"`` or ``"triton"``);
            whole rows always run the eager chunked form here.
        options: the layer's kernel options, passed to every op call (None: defaults).
        scale: the query scale; chunk_size: the eager chunk length.
    """

    def __init__(self, backend: str, options: GDNKernelOptions | None, scale: float,
                 chunk_size: int) -> None:
        self.backend, self.options, self.scale, self.chunk_size = (backend, options, scale,
                                                                    chunk_size)

    def forward(self, inputs: Inputs, table: ShardTable, link: StateLink, keep_graph: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...], Any]:
        """``o [B, L, HV, V]`` (v's dtype), the tensors to save and the backward's metadata.

        Args:
            inputs: ``(q, k [B, L, H, K], v [B, L, HV, V], g [B, L, HV] fp32, beta [B, L, HV])``.
            table: the shard's layout; link: this call's forward link.
            keep_graph: document pieces keep the local output's graph for the backward
                (``varlen.packed_local_forward``; the metadata is that graph, else None);
                whole rows ignore it (their backward recomputes the local output).
        """
        q, k, v, g, beta = inputs
        name = getattr(link, "profile_name", "gdn.cp")
        if table.whole_rows:  # one prepare serves the map and the outputs
            with profile_range(f"{name} fwd local prepare"):
                prep = prepare_chunks(q, k, v, g, beta, self.scale, True, self.chunk_size)

            def rank_map() -> tuple[torch.Tensor, torch.Tensor]:
                return summarize(prep)

            def outputs(h_in: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
                return chunk_output(prep, h_in)[0], None
        else:
            def rank_map() -> tuple[torch.Tensor, torch.Tensor]:
                return packed_tail_maps(q, k, v, g, beta, table, self.chunk_size)

            def outputs(h_in: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
                return packed_local_forward(q, k, v, g, beta, h_in, table, self.scale,
                                            self.chunk_size, self.backend, self.options,
                                            keep_graph)

        m = s = None
        if link.leaves:  # the last rank's map is never read
            with profile_range(f"{name} fwd local summary"):
                m, s = rank_map()
            if link.wants_segment_maps:
                link.segment_maps(_as_segment(m), _as_segment(s))
        with profile_range(f"{name} fwd entering state"):
            h_in = link.entering_state()  # the wait sits here, after the local map
        if link.leaves:
            with profile_range(f"{name} fwd chain H_out = M H_in + S"):
                link.leaving_state((s if h_in is None else apply_summary(m, s, h_in)).contiguous())
        with profile_range(f"{name} fwd local output"):
            o, meta = outputs(h_in)
        # M serves the backward where a state entered and one leaves (0 < r < P - 1)
        return o, (q, k, v, g, beta, h_in, m if h_in is not None else None), meta

    def backward(self, saved: tuple[torch.Tensor | None, ...], meta: Any, do: torch.Tensor,
                 needs: tuple[bool, ...], table: ShardTable, link: StateLink
                 ) -> list[torch.Tensor | None]:
        """The five input gradients (None where not needed, in the inputs' dtypes) given
        ``do [B, L, HV, V]``; ``saved`` is :meth:`forward`'s, ``link`` the backward link."""
        q, k, v, g, beta, h_in, m = saved
        inputs = (q, k, v, g, beta)
        name = getattr(link, "profile_name", "gdn.cp")
        with profile_range(f"{name} bwd local output"):
            if table.whole_rows:
                grads, dh_local, leaves = _local_output_grads(
                    inputs, needs, h_in, do, self.scale, self.chunk_size, self.backend,
                    self.options)
            else:
                grads, dh_local, leaves = packed_local_output_grads(
                    inputs, h_in, do, table, self.scale, self.chunk_size, self.backend,
                    self.options, kept=meta)
        if link.leaves and link.wants_segment_maps and dh_local is not None:
            link.segment_state_grads(None if m is None else _as_segment(m),
                                     _as_segment(dh_local))
        with profile_range(f"{name} bwd leaving state grad"):
            dh_out = link.leaving_state_grad()  # None on the last rank: nothing after it
        if link.leaves and dh_local is not None:
            with profile_range(f"{name} bwd chain dH_in = M^T dH_out + dH_local"):
                link.entering_state_grad(
                    dh_local if dh_out is None else apply_summary_backward(m, dh_out, dh_local))
        if dh_out is not None and any(needs):
            with profile_range(f"{name} bwd summary"):
                if table.whole_rows:
                    _add_summary_grads(grads, leaves, needs, h_in, dh_out, self.scale,
                                      self.chunk_size)
                else:
                    grads = add_packed_tail_grads(grads, leaves, table, h_in, dh_out,
                                                  self.chunk_size)
        return [gr.to(x.dtype) if gr is not None else None for gr, x in zip(grads, inputs)]


class TritonLocal(EagerLocal):
    """``backend="triton"``: whole rows run the Triton op with the link inside it (q/k/v/beta
    bf16/fp16/fp32, g fp32, ``L`` a multiple of 64); document pieces run
    :class:`EagerLocal`'s schedule with the Triton op for the pieces."""

    def op_kwargs(self) -> dict[str, Any]:
        """``num_segments``, ``recompute_w`` and ``fused`` (``fused_forward``) for
        ``gdn_forward``, from the options (unset: the machine's segment choice, w saved, the
        kernel chain's forward)."""
        options = self.options if self.options is not None else GDNKernelOptions()
        return {"num_segments": options.num_segments, "recompute_w": bool(options.recompute_w),
                "fused": bool(options.fused_forward)}

    def forward(self, inputs: Inputs, table: ShardTable, link: StateLink, keep_graph: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...], Any]:
        if not table.whole_rows:
            return super().forward(inputs, table, link, keep_graph)
        from overlap_runtime.ops.gdn.triton.function import gdn_forward

        q, k, v, g, beta = (x.contiguous() for x in inputs)
        o, _, saved, meta = gdn_forward(q, k, v, g, beta, None, self.scale, True, link=link,
                                        **self.op_kwargs())
        return o, tuple(saved), meta

    def backward(self, saved: tuple[torch.Tensor | None, ...], meta: Any, do: torch.Tensor,
                 needs: tuple[bool, ...], table: ShardTable, link: StateLink
                 ) -> list[torch.Tensor | None]:
        if not table.whole_rows:
            return super().backward(saved, meta, do, needs, table, link)
        from overlap_runtime.ops.gdn.triton.function import gdn_backward

        return list(gdn_backward(saved, meta, do, None, link=link)[:5])


def local_backend(plan: GDNCPPlan, scale: float, chunk_size: int) -> EagerLocal:
    """The plan's local backend (``plan.backend``: ``"eager"`` or ``"triton"``)."""
    kind = TritonLocal if plan.backend == "triton" else EagerLocal
    return kind(plan.backend, plan.options, scale, chunk_size)


def keeps_local_graph(*inputs: torch.Tensor) -> bool:
    """Whether a state-passing forward on ``inputs`` keeps its local graph for the backward:
    grad mode is on, some input requires grad, and no saved-tensor hooks are active.

    Under ``torch.no_grad()`` (reentrant checkpoint's first forward) no backward follows. Under
    saved-tensor hooks (non-reentrant ``torch.utils.checkpoint``'s first forward and its
    recompute, a memory meter, offloading) a graph built inside the Function would go through
    the hooks; checkpoint's unpack is keyed by the graph task, and the nested
    ``torch.autograd.grad`` of the backward is a new one, so it would replay the whole
    checkpointed region again (its messages included) to refill it. Those backwards recompute
    the local output instead, as the whole-row path does. The hooks are read from the private
    ``torch._C._autograd._top_saved_tensors_default_hooks`` (no public query exists)."""
    return (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def apply_state_passing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, local: EagerLocal, table: ShardTable,
                        plan: GDNCPPlan, link_type: type[CPLink]) -> torch.Tensor:
    """:class:`StatePassingGDN` with ``keep_graph`` decided here (:func:`keeps_local_graph`:
    inside the Function's forward grad mode is always off)."""
    return StatePassingGDN.apply(q, k, v, g, beta, local, table, plan, link_type,
                                 keeps_local_graph(q, k, v, g, beta))


class StatePassingGDN(torch.autograd.Function):
    """``apply(q, k, v, g, beta, local, table, plan, link_type, keep_graph) -> o [B, L, HV, V]``
    (v's dtype): this rank's shard with its entering state brought by ``link_type`` (module
    docstring). Call it through :func:`apply_state_passing`, which sets ``keep_graph``.

    q, k ``[B, L, H, K]``, v ``[B, L, HV, V]``, g ``[B, L, HV]`` fp32, beta ``[B, L, HV]``; q and
    k are l2-normalised inside. The states and maps that cross ranks are ``[B, HV, K, V]`` /
    ``[B, HV, K, K]`` in ``promote(q.dtype, fp32)`` (fp32, float64 for float64 inputs).
    ``keep_graph``: document pieces keep their local output's graph in ``ctx.meta`` (per call;
    released by the backward, ``varlen.PackedLocalGraph``) instead of recomputing it there.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, local: EagerLocal, table: ShardTable, plan: GDNCPPlan,
                link_type: type[CPLink], keep_graph: bool) -> torch.Tensor:
        shape = (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
        dtype = torch.promote_types(q.dtype, torch.float32)
        link = link_type(plan, shape, dtype, q.device, reverse=False)
        o, saved, meta = local.forward((q, k, v, g, beta), table, link,  # type: ignore[arg-type]
                                       keep_graph)
        link.finish()  # late: the local output ran while the state travelled
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.local, ctx.table, ctx.plan, ctx.link_type = meta, local, table, plan, link_type
        ctx.link_args = (shape, dtype)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, dtype = ctx.link_args
        link = ctx.link_type(ctx.plan, shape, dtype, do.device, reverse=True)
        grads = ctx.local.backward(ctx.saved_tensors, ctx.meta, do, ctx.needs_input_grad[:5],
                                   ctx.table, link)
        link.finish()
        return (*grads, None, None, None, None, None)


def state_passing_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, plan: GDNCPPlan, link_type: type[CPLink],
                      chunk_size: int = 64, table: ShardTable | None = None) -> torch.Tensor:
    """Validate, check the backend (raises, never falls back), then run
    :class:`StatePassingGDN` on this rank's shard.

    The checks run before any state message, on every rank alike (same shapes), so a refusal
    raises everywhere instead of leaving a peer waiting.

    Args:
        q, k ``[B, L, H, K]``, v ``[B, L, HV, V]``, g ``[B, L, HV]`` fp32, beta ``[B, L, HV]``.
        link_type: ``p2p.ChainLink`` or ``prefix_scan.ScanLink``.
        table: the shard's layout (None: whole rows).

    Returns:
        o ``[B, L, HV, V]`` in v's dtype.
    """
    check_state_passing_call(q, k, v, g, beta, plan, chunk_size, plan.mode)
    if table is None:
        table = ShardTable.dense(q.shape[0], q.shape[1])
    scale = q.shape[-1] ** -0.5
    return apply_state_passing(q, k, v, g, beta, local_backend(plan, scale, chunk_size), table,
                               plan, link_type)


def _local_output_grads(
    inputs: tuple[torch.Tensor, ...], needs: tuple[bool, ...], h_in: torch.Tensor | None,
    do: torch.Tensor, scale: float, chunk_size: int, backend: str,
    options: GDNKernelOptions | None = None,
) -> tuple[list[torch.Tensor | None], torch.Tensor | None, list[torch.Tensor]]:
    """Backward of a shard's local output ``o = GDN(q, k, v, g, beta; H_in)`` alone (whole
    rows, recomputed).

    Args:
        inputs: ``(q, k, v, g, beta)`` as saved by the forward; needs: which need a gradient.
        h_in: ``[B, HV, K, V]`` the state that entered the rank (None: zeros, rank 0).
        do: ``[B, L, HV, V]`` gradient of the output.
        backend, options: the op's backend and kernel options (the plan's).

    Returns:
        ``(grads, dH_in_local, leaves)``: the five input gradients of the local output (None
        where not needed), ``dH_in_local [B, HV, K, V]`` (None when ``h_in`` is None) and the
        detached leaves (for :func:`_add_summary_grads`).
    """
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(need) for x, need in zip(inputs, needs)]
        h_leaf = None if h_in is None else h_in.detach().requires_grad_(True)
        o, _ = chunk_gated_delta_rule(
            *leaves, scale=scale, initial_state=h_leaf, use_qk_l2norm=True,
            chunk_size=chunk_size, backend=backend, options=options,
        )
        wanted = [x for x in leaves if x.requires_grad] + ([h_leaf] if h_leaf is not None else [])
        local = list(torch.autograd.grad(o, wanted, do, allow_unused=True))
    dh_in_local = local.pop() if h_leaf is not None else None
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    it = iter(local)
    for i, need in enumerate(needs):
        if need:
            grads[i] = next(it)
    return grads, dh_in_local, leaves


def _add_summary_grads(
    grads: list[torch.Tensor | None], leaves: list[torch.Tensor], needs: tuple[bool, ...],
    h_in: torch.Tensor | None, dh_out: torch.Tensor, scale: float, chunk_size: int,
) -> None:
    """Add (in ``grads``, in place) the gradient through the rank's summary ``(M, S)`` that
    produced ``H_out = M H_in + S``, given ``dH_out [B, HV, K, V]``: ``dM = dH_out H_in^T``,
    ``dS = dH_out`` (``M`` is skipped when ``h_in`` is None: it multiplied zeros)."""
    with torch.enable_grad():
        prep = prepare_chunks(*leaves, scale, True, chunk_size)
        m2, s2 = summarize(prep)
        outs, gouts = [s2], [dh_out.to(s2.dtype)]
        if h_in is not None:
            outs.append(m2)
            gouts.append(dh_out.to(m2.dtype) @ h_in.to(m2.dtype).transpose(-1, -2))
        targets = [x for x in leaves if x.requires_grad]
        extra = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
    it = iter(extra)
    for i, need in enumerate(needs):
        if need:
            e = next(it)
            if e is not None:
                grads[i] = e if grads[i] is None else grads[i] + e
