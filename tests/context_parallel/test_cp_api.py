"""ContextParallel on a reference attention module (projections, GQA, RoPE) on gloo ranks,
low-precision forwards, and the errors users meet."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.support.cp import make_qkv, reference_attention
from overlap_runtime.context_parallel import (
    CommStats,
    ContextParallel,
    ContextParallelCoreAttention,
    all_gather_kv_attention,
    ring_attention,
    shard_positions,
    ulysses_attention,
)
from overlap_runtime.context_parallel.ulysses import ulysses_kv_heads
from overlap_runtime.layers import ReferenceAttention
from overlap_runtime.testing import rel_l2, run_ranks

TOL = 1e-5
S, HIDDEN = 32, 32


def _module(heads: int = 4, kv_heads: int = 2) -> ReferenceAttention:
    torch.manual_seed(7)
    return ReferenceAttention(HIDDEN, heads, kv_heads, head_dim=8)


def _api_worker(rank: int, world: int) -> float:
    mesh = init_device_mesh("cpu", (world,))
    full = _module()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, S, HIDDEN, generator=g)
    dy = torch.randn(2, S, HIDDEN, generator=g)
    x_full = x.clone().requires_grad_(True)
    y_full = full(x_full, torch.arange(S))
    y_full.backward(dy)
    worst = 0.0
    for mode in ("ulysses", "ring", "all_gather_kv"):
        for lb in ("zigzag", None):
            cp = ContextParallel(mode, lb)
            m = cp.apply(copy.deepcopy(full), mesh)
            m.zero_grad()
            assert isinstance(m.core_attention, ContextParallelCoreAttention)
            pos = cp.position_ids(S, mesh)
            assert torch.equal(pos, shard_positions(S, world, rank, lb))
            x_loc = cp.shard(x, mesh).clone().requires_grad_(True)
            stats = CommStats()
            y = m(x_loc, pos, stats=stats)
            y.backward(cp.shard(dy, mesh))
            assert stats.calls, f"{mode}: nothing recorded"
            errs = {"y": rel_l2(y.detach(), cp.shard(y_full.detach(), mesh)),
                    "dx": rel_l2(x_loc.grad, cp.shard(x_full.grad, mesh))}
            for name, p in m.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad, group=mesh.get_group())   # weights are replicated over CP
                errs[name] = rel_l2(grad, dict(full.named_parameters())[name].grad)
            bad = {k: e for k, e in errs.items() if not e <= TOL}
            assert not bad, f"rank {rank} mode={mode} load_balance={lb}: {bad}"
            worst = max(worst, *errs.values())
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_module_matches_single_device(world: int) -> None:
    assert max(run_ranks(_api_worker, world)) <= TOL


def _low_precision_worker(rank: int, world: int) -> dict[str, float]:
    group = init_device_mesh("cpu", (world,)).get_group()
    q, k, v, _ = make_qkv(5, 1, 64, 4, 2, 16)
    ref = reference_attention(q, k, v, causal=True)
    pos = shard_positions(64, world, rank, "zigzag")
    errs = {}
    for dtype in (torch.bfloat16, torch.float16):
        for name, fn in (("ring", ring_attention), ("ulysses", ulysses_attention),
                         ("all_gather_kv", all_gather_kv_attention)):
            ql, kl, vl = (t[:, pos].to(dtype) for t in (q, k, v))
            out = fn(ql, kl, vl, group=group, causal=True, load_balance="zigzag")
            assert out.dtype == dtype
            errs[f"{name}/{dtype}"] = rel_l2(out, ref[:, pos])
    bad = {n: e for n, e in errs.items() if not e <= 1e-2}
    assert not bad, f"rank {rank}: {bad}"
    return errs


def test_bf16_fp16_forward_against_fp32_full_attention() -> None:
    errs = run_ranks(_low_precision_worker, 2)
    assert max(max(e.values()) for e in errs) <= 1e-2


def _errors_worker(rank: int, world: int) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    # heads % cp: six query heads over cp 4, raised by the module's forward before any comm
    m = ContextParallel("ulysses").apply(ReferenceAttention(48, 6, 6, head_dim=8), mesh)
    x = torch.randn(1, 8, 48)
    with pytest.raises(ValueError, match="query heads 6 are not divisible by cp size 4"):
        m(x, ContextParallel("ulysses").position_ids(32, mesh))
    with pytest.raises(ValueError, match="already context parallel"):
        ContextParallel("ring").apply(m, mesh)
    with pytest.raises(ValueError, match=r"sequence length 36 is not a multiple of 2 \* cp_size"
                                         r".* = 8"):
        ContextParallel("ring").position_ids(36, mesh)
    with pytest.raises(TypeError, match="Linear has no 'core_attention' submodule"):
        ContextParallel("ring").apply(torch.nn.Linear(2, 2), mesh)
    with pytest.raises(ValueError, match="cp_mesh must be 1-D"):
        ContextParallel("ring").apply(_module(), init_device_mesh("cpu", (2, 2)))
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="local length 3 must be even under zigzag"):
        ring_attention(q, q, q, group=mesh.get_group())
    return True


def test_errors_on_ranks() -> None:
    assert all(run_ranks(_errors_worker, 4))


def test_errors_name_values() -> None:
    with pytest.raises(ValueError, match="mode must be one of .* got 'stripes'"):
        ContextParallel("stripes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_balance must be 'zigzag' or None"):
        ContextParallel("ring", "round_robin")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cp_mesh must be a torch.distributed DeviceMesh, got "
                                        "NoneType"):
        ContextParallel("ring").apply(_module(), None)  # type: ignore[arg-type]
    # GQA rules for Ulysses: scatter when kv >= cp, replicate when kv < cp and cp % kv == 0
    assert ulysses_kv_heads(8, 4, 4) == 4
    assert ulysses_kv_heads(8, 2, 4) == 4
    with pytest.raises(ValueError, match="query heads 6 are not divisible by cp size 4"):
        ulysses_kv_heads(6, 6, 4)
    with pytest.raises(ValueError, match="key/value heads 6 are not divisible by cp size 4"):
        ulysses_kv_heads(12, 6, 4)
    with pytest.raises(ValueError, match="key/value heads 3 < cp size 4 .* cp % kv_heads == 0"):
        ulysses_kv_heads(12, 3, 4)
