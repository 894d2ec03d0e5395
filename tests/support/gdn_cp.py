"""Rank workers for the GDN context-parallel tests: CP runs against the single-process module.

Every rank builds the same module (seeded) and the same global input, runs the single-process
module on the whole sequence (the reference) and the CP module on its own shard, then measures:

* ``out``: rel-L2 of the gathered CP output against the reference output;
* ``dx``: rel-L2 of the gathered input gradient;
* ``param:<name>``: rel-L2 of each parameter gradient summed over the CP group (each rank holds
  its share, as under FSDP/DDP) against the reference gradient;
* ``grad_norm``: relative difference of the total gradient norms.

Workers return the figures; the tests assert on them in the parent, so a failure names the
mode, the CP size and the tensor.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.layers import GatedDeltaNet
from overlap_runtime.testing import rel_l2

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 32, 2, 4, 8


def make_module(seed: int = 0, value_heads: int = VALUE_HEADS, head_dim: int = HEAD_DIM,
                conv_backend: str = "torch") -> GatedDeltaNet:
    """Tiny Qwen3.5-shaped layer (2 key heads, 4 value heads, head dim 8; the Triton tests use
    16, the smallest the interpreter runs), fp32, eager backend (the reference). The same seed
    gives the same parameters whatever ``conv_backend``."""
    torch.manual_seed(seed)
    m = GatedDeltaNet(HIDDEN, KEY_HEADS, value_heads, head_dim, head_dim,
                      conv_backend=conv_backend)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)  # non-trivial, so its gradient means something
        # Slow decay (exp(g) ~ 0.97-0.9995 per token, Qwen's init decays ~100x faster): the
        # state entering a rank must still matter at the rank's end, or a broken chain would
        # go unnoticed.
        m.A_log.uniform_(-5.0, -3.0)
        m.dt_bias.uniform_(-2.0, 0.0)
    return m


def make_inputs(batch: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global input ``[B, S, hidden]`` and loss weights ``[B, S, hidden]`` (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, HIDDEN, generator=gen)
    w = torch.randn(batch, seq_len, HIDDEN, generator=gen)
    return x, w


def padding_mask(batch: int, seq_len: int, real_lengths: list[int], left: list[bool]) -> torch.Tensor:
    """``[B, S]`` float mask: row b has ``real_lengths[b]`` real tokens, padded right or left."""
    mask = torch.zeros(batch, seq_len)
    for b, (n, is_left) in enumerate(zip(real_lengths, left)):
        if is_left:
            mask[b, seq_len - n :] = 1.0
        else:
            mask[b, :n] = 1.0
    return mask


def _gather_seq(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def _reference(module: GatedDeltaNet, x: torch.Tensor, w: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(True)
    y = module(xr, attention_mask=mask)
    (y * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    return y.detach(), xr.grad.detach(), grads


def _cp_run(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor | None,
            rank: int, world: int, use_checkpoint: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    local = x.shape[1] // world
    sl = slice(rank * local, (rank + 1) * local)
    module.zero_grad(set_to_none=True)
    xl = x[:, sl].clone().requires_grad_(True)
    ml = None if mask is None else mask[:, sl].contiguous()
    if use_checkpoint:
        y = checkpoint(module, xl, ml, use_reentrant=False)
    else:
        y = module(xl, attention_mask=ml)
    (y * w[:, sl]).sum().backward()
    grads = {}
    for n, p in module.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)  # each rank holds its share of a parameter gradient
        grads[n] = g
    return _gather_seq(y.detach(), world), _gather_seq(xl.grad.detach(), world), grads


def _errors(got: tuple, ref: tuple) -> dict[str, float]:
    y, dx, grads = got
    y_ref, dx_ref, grads_ref = ref
    err = {"out": rel_l2(y, y_ref), "dx": rel_l2(dx, dx_ref)}
    for n, g in grads_ref.items():
        err[f"param:{n}"] = rel_l2(grads[n], g)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    norm_ref = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads_ref.values()])
    )
    err["grad_norm"] = abs(norm.item() - norm_ref.item()) / norm_ref.item()
    return err


def compare_worker(rank: int, world: int, mode: str, batch: int, local_len: int,
                   iterations: int = 1, use_mask: bool = False,
                   use_checkpoint: bool = False, value_heads: int = VALUE_HEADS,
                   backend: str = "eager", head_dim: int = HEAD_DIM,
                   conv_backend: str = "torch") -> dict:
    """CP vs single process for ``iterations`` fresh inputs; returns the worst figure of each.

    ``backend`` / ``conv_backend`` are the CP layer's local GDN backend and causal conv; the
    reference is always the single-process module on the eager backend with the torch conv.
    """
    mesh = init_device_mesh("cpu", (world,))
    ref_module = make_module(value_heads=value_heads, head_dim=head_dim)
    cp_source = (copy.deepcopy(ref_module) if conv_backend == "torch" else
                 make_module(value_heads=value_heads, head_dim=head_dim,
                             conv_backend=conv_backend))
    cp_module = LinearAttentionContextParallel(mode=mode, backend=backend).apply(cp_source, mesh)
    seq_len = world * local_len
    worst: dict[str, float] = {}
    result: dict = {}
    for it in range(iterations):
        x, w = make_inputs(batch, seq_len, seed=100 + it)
        mask = None
        if use_mask:
            # row 0: real tokens then right padding; row 1: left padding; lengths not multiples
            # of 64 * P, so chunks are partial and a rank can hold only padding.
            real = [seq_len - local_len - 37, seq_len - 5]
            mask = padding_mask(batch, seq_len, real, left=[False, True])
        ref = _reference(ref_module, x, w, mask)
        got = _cp_run(cp_module, x, w, mask, rank, world, use_checkpoint)
        for k, v in _errors(got, ref).items():
            worst[k] = max(worst.get(k, 0.0), v)
        if use_mask:
            pad = mask == 0
            result["pad_out_max_abs"] = got[0][pad].abs().max().item()
            result["pad_dx_max_abs"] = got[1][pad].abs().max().item()
            # the real tokens of each row equal the unpadded sequence run alone
            for b in range(batch):
                keep = mask[b] == 1
                xb = x[b : b + 1, keep]
                with torch.no_grad():
                    alone = ref_module(xb)
                result[f"row{b}_vs_unpadded"] = rel_l2(got[0][b : b + 1, keep], alone)
    result["worst"] = worst
    # the Triton kernels really ran (under the interpreter on the CPU), not another path
    result["triton_interpreted"] = (
        "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1")
    return result


def checkpoint_worker(rank: int, world: int, mode: str, batch: int, local_len: int,
                      backend: str = "eager", head_dim: int = HEAD_DIM,
                      plain_once: bool = False) -> dict:
    """Same inputs with and without activation checkpointing: are the results bitwise equal?

    The checkpointed layer runs twice; by default the plain layer runs before each, with
    ``plain_once`` only once, both checkpointed results compared with that one run (each still
    against the single-process reference)."""
    mesh = init_device_mesh("cpu", (world,))
    ref_module = make_module(head_dim=head_dim)
    style = LinearAttentionContextParallel(mode=mode, backend=backend)
    plain = style.apply(copy.deepcopy(ref_module), mesh)
    ckpt = style.apply(copy.deepcopy(ref_module), mesh)
    x, w = make_inputs(batch, world * local_len, seed=7)
    out = {"identical": True, "worst": {}}
    a = ref = None
    for _ in range(2):  # twice: the recompute's P2P order must stay aligned across calls
        if a is None or not plain_once:
            a = _cp_run(plain, x, w, None, rank, world, use_checkpoint=False)
            ref = _reference(ref_module, x, w, None)
        b = _cp_run(ckpt, x, w, None, rank, world, use_checkpoint=True)
        same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(
            torch.equal(a[2][n], b[2][n]) for n in a[2]
        )
        out["identical"] = out["identical"] and same
        for k, v in _errors(b, ref).items():
            out["worst"][k] = max(out["worst"].get(k, 0.0), v)
    return out


def jobs_worker(rank: int, world: int, jobs: list[tuple[str, Any, tuple]]) -> dict[str, Any]:
    """Several workers of one world size in one spawn, one after the other: ``{name:
    fn(rank, world, *args)}`` for each ``(name, fn, args)`` of ``jobs`` (module-level ``fn``)."""
    return {name: fn(rank, world, *args) for name, fn, args in jobs}


def _raises(fn, exc_type: type[BaseException]) -> str:
    """Run ``fn``; return ``"<ExcType>: message"`` of the expected exception, or a failure note."""
    try:
        fn()
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        return f"WRONG {type(exc).__name__}: {exc}"
    return "DID NOT RAISE"


def errors_worker(rank: int, world: int) -> dict[str, str]:
    """Misuse that needs a live CP group; every rank hits each case at the same point."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, str] = {}
    x, _ = make_inputs(1, 64 * world, seed=3)
    local = x[:, rank * 64 : (rank + 1) * 64]

    # ulysses head divisibility is checked at apply: 4 value heads, 3 ranks would be needed...
    # with world=2 use 3 value heads instead (HV % cp != 0).
    odd = GatedDeltaNet(HIDDEN, 1, 3, HEAD_DIM, HEAD_DIM)
    out["ulysses_heads"] = _raises(
        lambda: LinearAttentionContextParallel("ulysses").apply(odd, mesh), ValueError)

    p2p = LinearAttentionContextParallel("p2p").apply(make_module(), mesh)
    out["short_local_seq"] = _raises(lambda: p2p(local[:, :2]), ValueError)
    out["cu_seqlens"] = _raises(
        lambda: p2p(local, cu_seqlens=torch.tensor([0, 64])), ValueError)  # global: 128
    out["mask_shape"] = _raises(lambda: p2p(local, attention_mask=torch.ones(1, 63)), ValueError)
    out["apply_twice"] = _raises(
        lambda: LinearAttentionContextParallel("p2p").apply(p2p, mesh), RuntimeError)
    dt_rep = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    out["dtensor_replicate"] = _raises(lambda: p2p(dt_rep), ValueError)

    # Triton: the local-length rule first (before any communication), then the backend's
    # capability rules (head dim 8 is not a Triton head dim).
    x100, _ = make_inputs(1, 100 * world, seed=4)
    local100 = x100[:, rank * 100 : (rank + 1) * 100]
    for mode in ("p2p", "ulysses"):
        tri = LinearAttentionContextParallel(mode, backend="triton").apply(make_module(), mesh)
        out[f"triton_{mode}"] = _raises(lambda: tri(local), NotImplementedError)
        out[f"triton_{mode}_local_len"] = _raises(lambda: tri(local100), NotImplementedError)

    # A DTensor Shard(1) input gives the tensor path's result, as a DTensor Shard(1).
    dt = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    with torch.no_grad():
        y_dt = p2p(dt)
        y = p2p(local)
    out["dtensor_ok"] = (
        "ok" if isinstance(y_dt, DTensor) and tuple(y_dt.placements) == (Shard(1),)
        and torch.equal(y_dt.to_local(), y) else f"mismatch {type(y_dt).__name__}"
    )
    return out


# the GatedDeltaNet layer's parameters: every one must come back with a gradient figure
PARAMS = (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight",
)


def assert_figures(worst: dict[str, float], what: str, tol: float) -> None:
    """Every figure of a compare run present (out, dx, grad norm, each parameter) and <= tol."""
    expected = {"out", "dx", "grad_norm"} | {f"param:{p}" for p in PARAMS}
    assert set(worst) == expected, f"{what}: figures {sorted(worst)}"
    bad = {k: v for k, v in worst.items() if not v <= tol}
    assert not bad, f"{what}: rel-L2 above {tol:g}: {bad} (all: {worst})"
