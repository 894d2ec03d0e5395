"""Hierarchical attention CP (Ulysses over the inner dimension, ring over the outer) on real gloo
ranks against float64 full attention: CP4 = 2x2 in one spawn, CP8 = 2x4 and 4x2 in one spawn.

Each case builds the full q, k, v and upstream gradient from one seed on every rank, runs on the
rank's flat shard (the rule over all P ranks) and compares its rows of out, dq, dk, dv (rel-L2
<= 1e-5, fp32). It also asserts the per-call communication: 2 all-to-alls each way on the inner
group, the ring's R-1 forward hops and 2(R-1) backward hops on the outer group, and, from an
independent c10d op count, that nothing else was dispatched (plus one agreement all-gather per
group). The 4-rank spawn also runs ``ContextParallel("hierarchical")`` on a reference attention
module (projections, GQA, RoPE) against the single-device module, parameters' gradients too.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.support.cp import C10dOpCounter, make_qkv, reference_grads
from overlap_runtime.context_parallel import (
    CommStats,
    ContextParallel,
    hierarchical_attention,
    hierarchical_cp_mesh,
    shard_positions,
)
from overlap_runtime.context_parallel.hierarchical import check_hierarchical_degrees, mesh_groups
from overlap_runtime.layers import ReferenceAttention
from overlap_runtime.testing import rel_l2, run_ranks

TOL = 1e-5


def _case(mesh: Any, rank: int, causal: bool, lb: str | None, hq: int, hkv: int,
          seq: int) -> float:
    world, ring = mesh.size(), mesh.size(0)
    a2a_group, ring_group = mesh_groups(mesh)
    q, k, v, dout = make_qkv(hq * 10 + hkv + int(causal), 2, seq, hq, hkv, 8)
    pos = shard_positions(seq, world, rank, lb)
    ql, kl, vl = (x[:, pos].clone().requires_grad_(True) for x in (q, k, v))
    stats = CommStats()
    fwd, bwd = C10dOpCounter(), C10dOpCounter()
    with fwd:
        out = hierarchical_attention(ql, kl, vl, a2a_group, ring_group, causal=causal,
                                     load_balance=lb, stats=stats)
    with bwd:
        out.backward(dout[:, pos])
    ref = reference_grads(q, k, v, dout, causal)
    errs = {n: rel_l2(got, full[:, pos]) for n, got, full in
            zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad), ref)}
    what = f"rank {rank}, {tuple(mesh.shape)} (ring, a2a), causal={causal}, lb={lb}, {hq}/{hkv}"
    bad = {n: e for n, e in errs.items() if not e <= TOL}
    assert not bad, f"{what}: rel-L2 above {TOL}: {bad}"
    want = {"forward": {"all_to_all": 2, "send": ring - 1, "recv": ring - 1},
            "backward": {"all_to_all": 2, "send": 2 * ring - 2, "recv": 2 * ring - 2}}
    for phase, counter in (("forward", fwd), ("backward", bwd)):
        got = {kind: n for (ph, kind), n in stats.calls.items() if ph == phase}
        assert got == want[phase], f"{what} {phase}: CommStats {got} != {want[phase]}"
        dispatched = dict(want[phase])
        if phase == "forward":  # one agreement all-gather on each group
            dispatched["all_gather"] = 2
        assert dict(counter.counts) == dispatched, \
            f"{what} {phase}: c10d ops dispatched {dict(counter.counts)} != {dispatched}"
    return max(errs.values())


def _module_case(mesh: Any, rank: int) -> float:
    torch.manual_seed(7)
    full = ReferenceAttention(32, 4, 2, head_dim=8)
    g = torch.Generator().manual_seed(11)
    x, dy = torch.randn(2, 32, 32, generator=g), torch.randn(2, 32, 32, generator=g)
    x_full = x.clone().requires_grad_(True)
    y_full = full(x_full, torch.arange(32))
    y_full.backward(dy)
    cp = ContextParallel("hierarchical", "zigzag")
    m = cp.apply(copy.deepcopy(full), mesh)
    m.zero_grad()
    pos = cp.position_ids(32, mesh)
    assert torch.equal(pos, shard_positions(32, mesh.size(), rank, "zigzag"))
    x_loc = cp.shard(x, mesh).clone().requires_grad_(True)
    y = m(x_loc, pos)
    y.backward(cp.shard(dy, mesh))
    errs = {"y": rel_l2(y.detach(), cp.shard(y_full.detach(), mesh)),
            "dx": rel_l2(x_loc.grad, cp.shard(x_full.grad, mesh))}
    for name, p in m.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # weights are replicated over the CP ranks (the whole world here)
        errs[name] = rel_l2(grad, dict(full.named_parameters())[name].grad)
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, f"rank {rank} ContextParallel('hierarchical'): {bad}"
    return max(errs.values())


def _cp4_worker(rank: int, world: int) -> float:
    mesh = hierarchical_cp_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), 2)
    assert mesh.mesh_dim_names == ("cp_ring", "cp_a2a")
    worst = 0.0
    for causal, lb, hq, hkv in ((True, "zigzag", 4, 2), (True, None, 4, 4),
                                (False, "zigzag", 4, 2), (True, "zigzag", 4, 1)):
        worst = max(worst, _case(mesh, rank, causal, lb, hq, hkv, 32))
    return max(worst, _module_case(mesh, rank))


def _cp8_worker(rank: int, world: int) -> float:
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    worst = 0.0
    for a2a, cases in ((2, ((True, "zigzag", 4, 2), (True, None, 4, 1))),
                       (4, ((True, "zigzag", 4, 2), (False, None, 8, 4)))):
        mesh = hierarchical_cp_mesh(flat, a2a)
        assert tuple(mesh.shape) == (world // a2a, a2a)
        for causal, lb, hq, hkv in cases:
            worst = max(worst, _case(mesh, rank, causal, lb, hq, hkv, 64))
    return worst


def test_hierarchical_cp4_2x2_matches_full_attention() -> None:
    assert max(run_ranks(_cp4_worker, 4)) <= TOL


def test_hierarchical_cp8_2x4_and_4x2_match_full_attention() -> None:
    assert max(run_ranks(_cp8_worker, 8, timeout_s=300)) <= TOL


@pytest.mark.parametrize("cp, a2a, ring, needle", [
    (4, 1, 4, "a2a=1 must be an integer >= 2"),
    (4, 4, 1, "ring=1 must be an integer >= 2"),
    (8, 2, 2, "a2a=2 x x.ring=2 = 4 must equal the cp size 8"),
])
def test_degree_errors_name_the_field(cp: int, a2a: int, ring: int, needle: str) -> None:
    problems = check_hierarchical_degrees(cp, a2a, ring, prefix="x.")
    assert any(needle in p for p in problems), problems
