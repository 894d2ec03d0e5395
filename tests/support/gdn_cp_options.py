"""Rank worker for test_gdn_cp_kernel_options.py: a layer's kernel options in every GDN CP mode.

Each rank builds two copies of one tiny float64 layer (chunk size 4, so a 16-token shard is 4
chunks; float64 so that the two agree to ~1e-15 and any difference the options made would show):
one without options, one with ``GDNKernelOptions(block_chunks=1)``; applies the same CP style to
both and runs forward + backward on its shard, dense and packed. The op is wrapped, in every
module namespace the GDN paths call it from, by a recorder of the ``options`` each call got.
The worker returns, per mode and path, the number of op calls, whether each carried the
expected options, and the worst rel-L2 between the two copies (output, input gradient, every
parameter gradient of this rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

import overlap_runtime.context_parallel.gdn.state_passing as state_passing_module
import overlap_runtime.context_parallel.gdn.varlen as varlen_module
import overlap_runtime.layers.gated_deltanet as layer_module
from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.layers import GatedDeltaNet
from overlap_runtime.ops.gdn import GDNKernelOptions
from overlap_runtime.testing import rel_l2

HIDDEN, LOCAL, CHUNK = 32, 16, 4
TUNED = GDNKernelOptions(block_chunks=1)
MODES = ("ulysses", "p2p", "all_gather", "prefix_scan")
#: Global document starts of the packed run (B = 1): one document crosses the rank boundary.
CU_SEQLENS = (0, 5, 21, 2 * LOCAL)
#: Where the GDN paths call ``chunk_gated_delta_rule`` from (each imports it by name).
OP_HOMES = (layer_module, state_passing_module, varlen_module)


def _layer(options: GDNKernelOptions | None, source: GatedDeltaNet | None) -> GatedDeltaNet:
    m = GatedDeltaNet(HIDDEN, 2, 4, 8, 8, chunk_size=CHUNK, kernel_options=options).double()
    if source is None:
        with torch.no_grad():  # slow decay: the state crossing ranks matters
            m.A_log.uniform_(-5.0, -3.0)
            m.dt_bias.uniform_(-2.0, 0.0)
    else:
        m.load_state_dict(source.state_dict())
    return m


def _run(module: GatedDeltaNet, x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor | None,
         rank: int) -> list[torch.Tensor]:
    sl = slice(rank * LOCAL, (rank + 1) * LOCAL)
    module.zero_grad(set_to_none=True)
    xl = x[:, sl].clone().requires_grad_(True)
    y = module(xl, cu_seqlens=cu)
    (y * w[:, sl]).sum().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
    return [y.detach(), xl.grad, *grads]


def options_worker(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    seen: list[Any] = []
    originals = [home.chunk_gated_delta_rule for home in OP_HOMES]

    def recording(op: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("options"))
            return op(*args, **kwargs)
        return call

    for home, op in zip(OP_HOMES, originals):
        home.chunk_gated_delta_rule = recording(op)
    try:
        torch.manual_seed(0)
        source = _layer(None, None)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, world * LOCAL, HIDDEN, generator=gen, dtype=torch.float64)
        w = torch.randn(1, world * LOCAL, HIDDEN, generator=gen, dtype=torch.float64)
        out: dict[str, Any] = {}
        for mode in MODES:
            style = LinearAttentionContextParallel(mode=mode, backend="eager")
            plain = style.apply(_layer(None, source), mesh)
            tuned = style.apply(_layer(TUNED, source), mesh)
            for cu in (None, torch.tensor(CU_SEQLENS)):
                seen.clear()
                ref = _run(plain, x, w, cu, rank)
                plain_seen = list(seen)
                seen.clear()
                got = _run(tuned, x, w, cu, rank)
                out[f"{mode}/{'dense' if cu is None else 'packed'}"] = {
                    "calls": len(seen),
                    "tuned_calls_carry_options": all(o == TUNED for o in seen),
                    "plain_calls_carry_none": all(o is None for o in plain_seen),
                    "worst": max(rel_l2(a, b) for a, b in zip(got, ref)),
                }
        return out
    finally:
        for home, op in zip(OP_HOMES, originals):
            home.chunk_gated_delta_rule = op



def triton_options_worker(rank: int, world: int) -> dict[str, Any]:
    """Under ``TRITON_INTERPRET=1``: the Triton p2p chain and prefix scan of a layer with
    ``num_segments=2, recompute_w=True, fused_forward=True`` (local 128 tokens: 2 chunks; the
    fused forward's summaries, the link's hooks and its walks), against the single-process
    eager layer. ``gdn_forward`` is wrapped by a recorder of the options it got and of what it
    did with them (its segment count; whether w was saved)."""
    import overlap_runtime.ops.gdn.triton.function as kernels

    mesh = init_device_mesh("cpu", (world,))
    local, dim = 128, 16  # the interpreter's smallest head dim
    seen: list[Any] = []
    forward = kernels.gdn_forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        o, final, saved, meta = forward(*args, **kwargs)
        seen.append({"num_segments": kwargs.get("num_segments"),
                     "recompute_w": kwargs.get("recompute_w"), "fused": kwargs.get("fused"),
                     "segments_run": meta.num_segments, "w_saved": saved[9] is not None})
        return o, final, saved, meta

    kernels.gdn_forward = recording
    try:
        torch.manual_seed(0)
        ref = GatedDeltaNet(HIDDEN, 2, 4, dim, dim)
        with torch.no_grad():
            ref.A_log.uniform_(-5.0, -3.0)
            ref.dt_bias.uniform_(-2.0, 0.0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, world * local, HIDDEN, generator=gen)
        w = torch.randn(1, world * local, HIDDEN, generator=gen)
        xr = x.clone().requires_grad_(True)
        y_ref = ref(xr)
        (y_ref * w).sum().backward()
        sl = slice(rank * local, (rank + 1) * local)
        out: dict[str, Any] = {}
        for mode in ("p2p", "prefix_scan"):
            cp = GatedDeltaNet(HIDDEN, 2, 4, dim, dim, backend="triton",
                               kernel_options=GDNKernelOptions(num_segments=2, recompute_w=True,
                                                               fused_forward=True))
            cp.load_state_dict(ref.state_dict())
            LinearAttentionContextParallel(mode=mode, backend="triton").apply(cp, mesh)
            seen.clear()
            xl = x[:, sl].clone().requires_grad_(True)
            y = cp(xl)
            (y * w[:, sl]).sum().backward()
            out[mode] = {"seen": list(seen), "out": rel_l2(y.detach(), y_ref.detach()[:, sl]),
                         "dx": rel_l2(xl.grad, xr.grad[:, sl])}
        return out
    finally:
        kernels.gdn_forward = forward
