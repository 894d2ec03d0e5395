"""Rank workers for the packed (THD) CP tests: every case against each document run alone.

A case is ``(batch, local_len, lengths)``: ``lengths`` are the document lengths of the
``batch`` rows of ``P * local_len`` tokens, in order (they fill every row exactly). The
reference runs the single-process module (float64) on each document as its own sequence, no
``cu_seqlens`` involved; the CP run gets this rank's shard and the global ``cu_seqlens``.
Workers return the worst rel-L2 per tensor over all cases, so one spawn checks many mixes.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.context_parallel.packed import PackedLayout
from overlap_runtime.context_parallel.varlen_attention import (
    packed_ring_attention,
    packed_ulysses_attention,
)
from overlap_runtime.ops.attention import attention
from overlap_runtime.testing import rel_l2

from tests.support.gdn_cp import HEAD_DIM, HIDDEN, make_module

Case = tuple[int, int, list[int]]


def cu_of(lengths: list[int]) -> torch.Tensor:
    """``cu_seqlens`` (int32) of consecutive documents."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _worst(worst: dict[str, float], name: str, err: float) -> None:
    worst[name] = max(worst.get(name, 0.0), err)


def _gather(x: torch.Tensor, world: int, group=None) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _per_document_reference(ref: torch.nn.Module, x: torch.Tensor, w: torch.Tensor,
                            lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                         dict[str, torch.Tensor]]:
    """The single-process module on every document alone: ``(y [B, T, hidden], dx, {param:
    grad})`` of ``sum(y * w)`` (float64, no ``cu_seqlens`` involved)."""
    batch, seq = x.shape[:2]
    ref.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(True)
    flat, wf = xr.reshape(1, -1, HIDDEN), w.reshape(1, -1, HIDDEN)
    ys, start = [], 0
    for n in lengths:
        ys.append(ref(flat[:, start:start + n]))
        start += n
    y_ref = torch.cat(ys, 1)
    (y_ref * wf).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return y_ref.reshape(batch, seq, HIDDEN).detach(), xr.grad, g_ref


def _packed_cp_run(cp: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, lengths: list[int],
                   rank: int, world: int, dtype: torch.dtype, group=None
                   ) -> dict[str, torch.Tensor]:
    """The CP layer on this rank's shard with the global ``cu_seqlens``: ``{"out", "dx",
    "param:<name>"}`` gathered over the CP group (parameter gradients summed over it)."""
    local_len = x.shape[1] // world
    cp.zero_grad(set_to_none=True)
    sl = slice(rank * local_len, (rank + 1) * local_len)
    xl = x[:, sl].to(dtype, copy=True).requires_grad_(True)
    y = cp(xl, cu_seqlens=cu_of(lengths))
    (y * w[:, sl].to(dtype)).sum().backward()
    out = {"out": torch.cat(_gather(y.detach(), world, group), 1),
           "dx": torch.cat(_gather(xl.grad, world, group), 1)}
    for n, p in cp.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        out[f"param:{n}"] = g
    return out


def _reference_figures(got: dict[str, torch.Tensor], y_ref: torch.Tensor, dx_ref: torch.Tensor,
                       g_ref: dict[str, torch.Tensor]) -> dict[str, float]:
    want = {"out": y_ref, "dx": dx_ref, **{f"param:{n}": g for n, g in g_ref.items()}}
    return {k: rel_l2(got[k], want[k]) for k in want}


def _check_interpreted(rank: int, backend: str) -> None:
    if backend == "triton" and not ("triton" in sys.modules
                                    and os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(f"rank {rank}: backend='triton' did not run the interpreted kernels")


def gdn_worker(rank: int, world: int, modes: list[str], cases: list[Case],
               backend: str = "eager", head_dim: int = HEAD_DIM,
               case_modes: list[list[str]] | None = None,
               scan_vs_chain: bool = False) -> dict[str, float]:
    """Each mode x case: output, input gradient and every parameter gradient (summed over ranks)
    against the per-document float64 reference; returns ``{"<mode>:<tensor>": worst}``.

    ``backend="eager"`` runs the CP layer in float64; ``"triton"`` (under the interpreter,
    head dims 16/32) in fp32, the Triton backend's dtype, against the same float64 reference.
    ``case_modes[i]`` (default: every mode) are the modes case ``i`` runs. With
    ``scan_vs_chain``, a case that runs both ``"prefix_scan"`` and ``"p2p"`` also compares the
    two on the same shards: ``{"scan_vs_chain:<tensor>": worst}``.
    """
    mesh = init_device_mesh("cpu", (world,))
    ref = make_module(head_dim=head_dim).double()
    dtype = torch.float64 if backend == "eager" else torch.float32
    worst: dict[str, float] = {}
    cps = {mode: LinearAttentionContextParallel(mode=mode, backend=backend).apply(
        copy.deepcopy(ref).to(dtype), mesh) for mode in modes}
    for i, (batch, local_len, lengths) in enumerate(cases):
        seq = world * local_len
        gen = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
        w = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
        # the reference does not depend on the mode: run once per case, compared with each
        y_ref, dx_ref, g_ref = _per_document_reference(ref, x, w, lengths)
        runs = {}
        for mode, cp in cps.items():
            if case_modes is not None and mode not in case_modes[i]:
                continue
            runs[mode] = got = _packed_cp_run(cp, x, w, lengths, rank, world, dtype)
            for k, err in _reference_figures(got, y_ref, dx_ref, g_ref).items():
                _worst(worst, f"{mode}:{k}", err)
        if scan_vs_chain and "prefix_scan" in runs and "p2p" in runs:
            for k, scan in runs["prefix_scan"].items():
                _worst(worst, f"scan_vs_chain:{k}", rel_l2(scan, runs["p2p"][k]))
    _check_interpreted(rank, backend)
    return worst


def scan_chain_worker(rank: int, world: int, cases: list[tuple[int, Case]],
                      backend: str = "eager", head_dim: int = HEAD_DIM) -> dict[str, float]:
    """``mode="prefix_scan"`` and the packed p2p chain, fp32, on CP sub-groups of one spawn.

    Each ``(cp, case)`` runs on the ranks ``[0, cp)`` (every rank creates every group, in the
    same order, as ``new_group`` requires): both modes against the per-document float64
    reference and against each other. Returns, on ranks in some group, ``{"cp<cp>:scan:<t>",
    "cp<cp>:chain:<t>", "cp<cp>:scan_vs_chain:<t>": worst}`` for t in out, dx, param:<name>.
    """
    groups = {cp: dist.new_group(list(range(cp))) for cp in sorted({c for c, _ in cases})}
    ref = make_module(head_dim=head_dim).double()
    worst: dict[str, float] = {}
    layers: dict[tuple[int, str], torch.nn.Module] = {}
    for i, (cp_size, (batch, local_len, lengths)) in enumerate(cases):
        if rank >= cp_size:
            continue
        group = groups[cp_size]
        for mode in ("prefix_scan", "p2p"):
            if (cp_size, mode) not in layers:
                mesh = DeviceMesh.from_group(group, "cpu")
                layers[cp_size, mode] = LinearAttentionContextParallel(
                    mode=mode, backend=backend).apply(copy.deepcopy(ref).float(), mesh)
        gen = torch.Generator().manual_seed(3000 + i)
        x = torch.randn(batch, cp_size * local_len, HIDDEN, generator=gen, dtype=torch.float64)
        w = torch.randn(batch, cp_size * local_len, HIDDEN, generator=gen, dtype=torch.float64)
        y_ref, dx_ref, g_ref = _per_document_reference(ref, x, w, lengths)
        runs = {name: _packed_cp_run(layers[cp_size, mode], x, w, lengths, rank, cp_size,
                                     torch.float32, group)
                for name, mode in (("scan", "prefix_scan"), ("chain", "p2p"))}
        for name, got in runs.items():
            for k, err in _reference_figures(got, y_ref, dx_ref, g_ref).items():
                _worst(worst, f"cp{cp_size}:{name}:{k}", err)
        for k, scan in runs["scan"].items():
            _worst(worst, f"cp{cp_size}:scan_vs_chain:{k}", rel_l2(scan, runs["chain"][k]))
    _check_interpreted(rank, backend)
    return worst


#: ``kept_graph_worker``'s ways to run the layer: calls of the local op in the forward and in
#: the backward, then of the whole layer (checkpoint's replays) in each, per rank. "kept": a
#: plain step, the backward runs on the graph the forward kept; "hooks": the forward under
#: identity saved-tensor hooks keeps none, so the backward runs the op again (the recompute
#: path); checkpoint reentrant: the first forward keeps nothing (no grad), the backward's
#: replay keeps its graph and the backward uses it; non-reentrant: one replay, then the local
#: recompute (hooks are active in both forwards; a graph kept under them would make the
#: backward's nested ``autograd.grad`` replay the whole layer a second time).
KEPT_GRAPH_CALLS = {"kept": (1, 0, 1, 0), "hooks": (1, 1, 1, 0),
                    "checkpoint_reentrant": (1, 1, 1, 1), "checkpoint": (1, 2, 1, 1)}


def kept_graph_worker(rank: int, world: int, modes: list[str], case: Case) -> dict[str, object]:
    """The packed p2p chain / prefix scan (eager, float64) on one case, run each way of
    :data:`KEPT_GRAPH_CALLS`: calls of the local op (``varlen.chunk_gated_delta_rule``,
    wrapped inside this rank) and of the layer in the forward and in the backward, whether
    the output, the input gradient and every parameter gradient of the shard equal the "kept"
    run's bit for bit, whether the kept graph's output tensor is gone right after the
    backward (the layer's output still alive) and whether every kept graph holder is gone
    once the step's tensors are (garbage collection off: no reference cycle).
    ``{"<mode>:<way>:<what>": value}``."""
    from torch.utils.checkpoint import checkpoint

    import overlap_runtime.context_parallel.gdn.varlen as varlen

    batch, local_len, lengths = case
    calls = [0, 0]  # the local op's, the layer's
    holders: list[weakref.ref] = []
    outs: list[weakref.ref] = []
    op, base = varlen.chunk_gated_delta_rule, varlen.PackedLocalGraph

    def counted(*args, **kwargs):
        calls[0] += 1
        return op(*args, **kwargs)

    class Tracked(base):  # type: ignore[misc, valid-type]
        def __init__(self, leaves, h_leaf, out) -> None:
            super().__init__(leaves, h_leaf, out)
            holders.append(weakref.ref(self))
            outs.append(weakref.ref(out))

    varlen.chunk_gated_delta_rule, varlen.PackedLocalGraph = counted, Tracked
    mesh = init_device_mesh("cpu", (world,))
    ref = make_module().double()
    gen = torch.Generator().manual_seed(4000)
    x = torch.randn(batch, world * local_len, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(batch, world * local_len, HIDDEN, generator=gen, dtype=torch.float64)
    sl = slice(rank * local_len, (rank + 1) * local_len)
    cu = cu_of(lengths)
    out: dict[str, object] = {}
    gc.disable()
    try:
        for mode in modes:
            cp = LinearAttentionContextParallel(mode=mode, backend="eager").apply(
                copy.deepcopy(ref), mesh)
            cp.register_forward_pre_hook(lambda *_: calls.__setitem__(1, calls[1] + 1))
            first = None
            for way in KEPT_GRAPH_CALLS:
                key = f"{mode}:{way}"
                cp.zero_grad(set_to_none=True)
                holders.clear()
                outs.clear()
                xl = x[:, sl].clone().requires_grad_(True)
                calls[:] = [0, 0]
                if way == "hooks":
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                        y = cp(xl, cu_seqlens=cu)
                elif way.startswith("checkpoint"):
                    y = checkpoint(lambda t: cp(t, cu_seqlens=cu), xl,
                                   use_reentrant=way == "checkpoint_reentrant")
                else:
                    y = cp(xl, cu_seqlens=cu)
                fwd = list(calls)
                (y * w[:, sl]).sum().backward()
                out[f"{key}:calls"] = (fwd[0], calls[0] - fwd[0], fwd[1], calls[1] - fwd[1])
                if way == "kept":
                    out[f"{key}:kept"] = len(holders)
                    out[f"{key}:released_after_backward"] = all(r() is None for r in outs)
                got = [y.detach(), xl.grad, *(torch.zeros_like(p) if p.grad is None else p.grad
                                              for p in cp.parameters())]
                del y, xl
                out[f"{key}:holders_freed"] = all(r() is None for r in holders)
                if first is None:
                    first = got
                out[f"{key}:same"] = all(torch.equal(a, b) for a, b in zip(got, first))
    finally:
        gc.enable()
        varlen.chunk_gated_delta_rule, varlen.PackedLocalGraph = op, base
    return out


def attention_worker(rank: int, world: int, modes: list[str], rules: list[str],
                     cases: list[Case], heads: tuple[int, int] = (4, 2)) -> dict[str, float]:
    """Each mode x layout rule x case: out, dq, dk, dv of the packed CP attention against
    ``ops.attention.attention`` (causal, float64) on each document alone."""
    hq, hkv = heads
    fns = {"ring": packed_ring_attention, "ulysses": packed_ulysses_attention}
    group = dist.new_group(list(range(world)))
    worst: dict[str, float] = {}
    for i, (batch, local_len, lengths) in enumerate(cases):
        seq = world * local_len
        gen = torch.Generator().manual_seed(2000 + i)
        q, k, v = (torch.randn(batch, seq, h, 8, generator=gen, dtype=torch.float64)
                   for h in (hq, hkv, hkv))
        w = torch.randn(batch, seq, hq, 8, generator=gen, dtype=torch.float64)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        flat = [x.reshape(1, -1, *x.shape[2:]) for x in leaves]
        outs, start = [], 0
        for n in lengths:
            outs.append(attention(*(x[:, start:start + n] for x in flat), causal=True))
            start += n
        o_ref = torch.cat(outs, 1).reshape(batch, seq, hq, 8)
        (o_ref * w).sum().backward()
        for rule in rules:
            try:
                layout = PackedLayout.from_cu_seqlens(cu_of(lengths), batch, seq, world, rule)
            except ValueError:
                continue  # e.g. document_zigzag with a length not a multiple of 2P
            loc = [layout.shard(x, rank).requires_grad_(True) for x in (q, k, v)]
            for mode in modes:
                for x in loc:
                    x.grad = None
                o = fns[mode](*loc, layout, group)
                (o * layout.shard(w, rank)).sum().backward()
                key = f"{mode}:{rule}"
                _worst(worst, f"{key}:out",
                       rel_l2(layout.unshard(_gather(o.detach(), world)), o_ref.detach()))
                for name, x, ref in zip("qkv", loc, leaves):
                    _worst(worst, f"{key}:d{name}",
                           rel_l2(layout.unshard(_gather(x.grad, world)), ref.grad))
    return worst
