"""Rank worker for the prefix-scan GDN CP tests: the GDN core on sub-groups of CP 2..P.

One spawn of ``world`` ranks covers every CP size ``2 .. world``: each size gets the sub-group
of ranks ``[0, P)`` (every rank creates every group, in the same order, as ``new_group``
requires). On each group the members run, on their contiguous shards of one global input,
``mode="prefix_scan"`` and the sequential ``mode="p2p"`` chain (fp32, forward + backward of
``sum(o * w)``), and compare both with the float64 token-by-token recurrence on the whole
sequence (output and the gradient of every input: q, k, v, g, beta), and with each other.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.context_parallel.gdn.common import GDNCPPlan
from overlap_runtime.context_parallel.gdn.p2p import gdn_state_chain
from overlap_runtime.context_parallel.gdn.prefix_scan import gdn_prefix_scan
from overlap_runtime.ops.gdn import recurrent_gated_delta_rule
from overlap_runtime.testing import rel_l2

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def _inputs(batch: int, seq_len: int, heads: int, value_heads: int, dim: int, seed: int
            ) -> tuple[torch.Tensor, ...]:
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g (slow decay) and beta ``[B, T, HV]``, the
    loss weights ``[B, T, HV, V]``; float64."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    q = torch.randn(batch, seq_len, heads, dim, **f64)
    k = torch.randn(batch, seq_len, heads, dim, **f64)
    v = torch.randn(batch, seq_len, value_heads, dim, **f64)
    # exp(g) in ~[0.97, 1): the state entering a rank still matters at the end of the sequence
    g = -0.03 * torch.rand(batch, seq_len, value_heads, **f64)
    beta = torch.rand(batch, seq_len, value_heads, **f64)
    w = torch.randn(batch, seq_len, value_heads, dim, **f64)
    return q, k, v, g, beta, w


def _reference(inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    *xs, w = inputs
    leaves = [x.clone().requires_grad_(True) for x in xs]
    o, _ = recurrent_gated_delta_rule(*leaves, use_qk_l2norm=True)
    (o * w).sum().backward()
    return [o.detach()] + [x.grad for x in leaves]  # type: ignore[misc]


def _cp_run(fn, plan: GDNCPPlan, inputs: tuple[torch.Tensor, ...], rank: int, world: int,
            chunk_size: int, gate_dtype: torch.dtype) -> list[torch.Tensor]:
    *xs, w = inputs
    local = xs[0].shape[1] // world
    sl = slice(rank * local, (rank + 1) * local)
    leaves = []
    for i, x in enumerate(xs):
        dtype = gate_dtype if i == 3 else torch.float32
        leaves.append(x[:, sl].to(dtype).contiguous().requires_grad_(True))
    o = fn(*leaves, plan, chunk_size=chunk_size)
    (o * w[:, sl].to(o.dtype)).sum().backward()
    parts = [o.detach()] + [x.grad for x in leaves]
    out = []
    for t in parts:  # every rank gets the whole tensors of the group, in rank order
        pieces = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(pieces, t.contiguous(), group=plan.group)
        out.append(torch.cat(pieces, dim=1))
    return out


def scan_worker(rank: int, world: int, cases: list[tuple[int, int, int, int]],
                backend: str = "eager", dim: int = 8) -> dict:
    """For each ``(cp, batch, local_len, chunk_size)`` in ``cases`` (cp <= world), ranks
    ``< cp`` return ``{case: {"scan:<t>": rel-L2 vs float64, "chain:<t>": ...,
    "scan_vs_chain:<t>": ...}}`` for t in output, dq, dk, dv, dg, dbeta."""
    groups = {}
    for cp in sorted({c[0] for c in cases}):
        groups[cp] = dist.new_group(list(range(cp)))  # every rank, every group, same order
    out: dict = {}
    for n, (cp, batch, local_len, chunk_size) in enumerate(cases):
        if rank >= cp:
            continue
        group = groups[cp]
        mesh = DeviceMesh.from_group(group, "cpu")
        inputs = _inputs(batch, cp * local_len, 2, 4, dim, seed=10 + n)
        ref = _reference(inputs)
        runs = {}
        for mode, fn in (("scan", gdn_prefix_scan), ("chain", gdn_state_chain)):
            plan = GDNCPPlan("prefix_scan" if mode == "scan" else "p2p", backend, group, cp,
                             mesh, timeout_s=60.0)
            runs[mode] = _cp_run(fn, plan, inputs, rank, cp, chunk_size, torch.float32)
        fig = {}
        for i, name in enumerate(NAMES):
            fig[f"scan:{name}"] = rel_l2(runs["scan"][i], ref[i])
            fig[f"chain:{name}"] = rel_l2(runs["chain"][i], ref[i])
            fig[f"scan_vs_chain:{name}"] = rel_l2(runs["scan"][i], runs["chain"][i])
        out[f"cp={cp} B={batch} local={local_len} chunk={chunk_size}"] = fig
    out["triton_interpreted"] = (
        "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1")
    return out
