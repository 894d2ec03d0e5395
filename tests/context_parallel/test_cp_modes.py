"""Full-attention CP (ulysses, ring, all_gather_kv) on real gloo ranks against full attention.

Every rank builds the full q, k, v and upstream gradient from one seed, runs the CP function on
its shard, and compares its rows of the output and of dq, dk, dv with float64 autograd attention
over the whole sequence. Each case also asserts how much communication was issued, twice: the
per-call ``CommStats`` the library filled, and an independent count of the c10d operations torch
dispatched (a TorchDispatchMode; torch's CommDebugMode does not track point-to-point). For the
ring it also checks the order of transfers and matrix products (prefetch before compute) and
the bytes of every hop against what the causal mask says the receivers need (``ring_hop_bytes``,
derived from chunk-level visibility, not from ``ring.py``).
"""

from __future__ import annotations


from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.cp import C10dOpCounter, make_qkv, reference_grads
from overlap_runtime.context_parallel import (
    CommStats,
    all_gather_kv_attention,
    ring_attention,
    shard_positions,
    ulysses_attention,
)
from overlap_runtime.testing import rel_l2, run_ranks

TOL = 1e-5
FUNCS = {"ulysses": ulysses_attention, "ring": ring_attention,
         "all_gather_kv": all_gather_kv_attention}


def expected_comm(mode: str, p: int) -> dict[str, dict[str, int]]:
    """Operations per rank and call: the numbers the module docstrings promise."""
    if mode == "ring":  # backward: P-1 K/V hops + P-1 dK/dV hops (the owner keeps its share)
        return {"forward": {"send": p - 1, "recv": p - 1},
                "backward": {"send": 2 * p - 2, "recv": 2 * p - 2}}
    if mode == "ulysses":
        return {"forward": {"all_to_all": 2}, "backward": {"all_to_all": 2}}
    return {"forward": {"all_gather": 1}, "backward": {"all_to_all": 1}}


def _chunks(r: int, p: int, lb: str | None) -> tuple[int, int]:
    """The two chunks (of 2P) rank r holds, first half then second half of its shard."""
    return (r, 2 * p - 1 - r) if lb == "zigzag" else (2 * r, 2 * r + 1)


def _halves_needed(r: int, src: int, p: int, causal: bool, lb: str | None) -> set[int]:
    """Which halves (0, 1) of rank src's K/V the queries of rank r != src attend to, from
    chunk-level causal visibility (query chunk i sees key chunk j < i whole, j > i not at all)."""
    if not causal:
        return {0, 1}
    return {h for h, j in enumerate(_chunks(src, p, lb))
            if any(i > j for i in _chunks(r, p, lb))}


def _hop_bytes(halves: set[int], full: int) -> int:
    """A message carrying ``halves``: the first half alone is half the bytes, else the whole
    block (a second half alone would need another layout; it never occurs)."""
    return full // 2 if halves == {0} else full


def ring_hop_bytes(me: int, p: int, causal: bool, lb: str | None, kv_full: int,
                   dkv_full: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The point-to-point operations rank ``me`` must issue, in order, with their bytes.

    K/V of block ``src`` leaving rank ``m`` must carry what any later rank on its way round
    (``m+1 .. src-1``) needs. The dK/dV accumulator of block ``src`` leaving ``m`` holds the
    shares of ranks ``src+1 .. m`` (the owner keeps its own), i.e. the halves they attend to.
    Contiguous causal: hops nobody needs still carry the whole block (not optimised). Even
    ranks post send-then-receive, odd ranks receive-then-send.
    """
    def kv_hop(m: int, src: int) -> int:
        later = [(m + i) % p for i in range(1, (src - m) % p or p)]
        need = set().union(*(_halves_needed(r, src, p, causal, lb) for r in later))
        return _hop_bytes(need, kv_full) if causal and lb == "zigzag" else kv_full

    def dkv_hop(m: int, src: int) -> int:
        done = [(src + i) % p for i in range(1, (m - src) % p + 1)]
        touched = set().union(*(_halves_needed(r, src, p, causal, lb) for r in done))
        return _hop_bytes(touched, dkv_full) if causal and lb == "zigzag" else dkv_full

    def pair(send: int, recv: int) -> list[tuple[str, int]]:
        ops = [("send", send), ("recv", recv)]
        return ops[::-1] if me % 2 else ops

    prv = (me - 1) % p
    fwd = [op for s in range(p - 1) for op in pair(kv_hop(me, (me - s) % p),
                                                   kv_hop(prv, (prv - s) % p))]
    bwd = list(fwd[:2])
    for s in range(1, p):
        if s + 1 < p:
            bwd += pair(kv_hop(me, (me - s) % p), kv_hop(prv, (prv - s) % p))
        bwd += pair(dkv_hop(me, (me - s) % p), dkv_hop(prv, (prv - s) % p))
    return fwd, bwd


def ring_backward_timeline(p: int) -> list[str]:
    """Backward order, consecutive repeats merged: the K/V of block me-1 is posted before the
    first half of the diagonal's products; every later K/V prefetch before its step's products;
    each step's dK/dV pass-on after them; the second half of the diagonal after the last
    dK/dV hop is posted (so that hop hides behind it)."""
    events = ["comm", "mm"]
    for s in range(1, p):
        events += (["comm"] if s + 1 < p else []) + ["mm", "comm"]
    events.append("mm")
    return [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]


def _case(mode: str, causal: bool, lb: str | None, hq: int, hkv: int, s: int = 32) -> dict:
    return dict(mode=mode, causal=causal, lb=lb, hq=hq, hkv=hkv, s=s)


def _cases(mode: str, p: int) -> list[dict]:
    heads = [(4, 4), (4, 2)]
    if mode == "ulysses":
        heads += [(4, 1)] if p == 2 else [(8, 4)]   # kv replicated (kv < cp) / scattered
    return [_case(mode, c, lb, hq, hkv) for c in (True, False) for lb in ("zigzag", None)
            for hq, hkv in heads]


def _run_case(rank: int, world: int, group: Any, case: dict) -> dict[str, float]:
    mode, causal, lb = case["mode"], case["causal"], case["lb"]
    q, k, v, dout = make_qkv(hash((case["hq"], case["hkv"], causal)) % 1000, 2, case["s"],
                             case["hq"], case["hkv"], 8)
    pos = shard_positions(case["s"], world, rank, lb)
    ql, kl, vl = (x[:, pos].clone().requires_grad_(True) for x in (q, k, v))
    stats = CommStats()
    fwd, bwd = C10dOpCounter(), C10dOpCounter()
    with fwd:
        out = FUNCS[mode](ql, kl, vl, group=group, causal=causal, load_balance=lb, stats=stats)
    with bwd:
        out.backward(dout[:, pos])
    ref = reference_grads(q, k, v, dout, causal)
    errs = {name: rel_l2(got, full[:, pos])
            for name, got, full in zip(("out", "dq", "dk", "dv"),
                                       (out.detach(), ql.grad, kl.grad, vl.grad), ref)}
    bad = {n: e for n, e in errs.items() if not e <= TOL}
    assert not bad, f"rank {rank}/{world} {case}: rel-L2 above {TOL}: {bad}"

    want = expected_comm(mode, world)
    for phase, counter in (("forward", fwd), ("backward", bwd)):
        got_stats = {kind: n for (ph, kind), n in stats.calls.items() if ph == phase}
        assert got_stats == want[phase], f"{case} {phase}: CommStats {got_stats} != {want[phase]}"
        # plus, before the forward's first transfer, the ranks' agreement check: one all-gather
        # of 10 int64 (peers.check_attention_call; not the algorithm's traffic, not in CommStats)
        dispatched = Counter(want[phase])
        if phase == "forward":
            dispatched["all_gather"] += 1
        assert dict(counter.counts) == dict(dispatched), \
            f"{case} {phase}: c10d ops dispatched {dict(counter.counts)} != {dict(dispatched)}"
    if mode == "ring":
        kv_bytes = 2 * kl.numel() * kl.element_size()
        dkv_bytes = 2 * kl.numel() * 4  # float32 accumulators
        want_fwd, want_bwd = ring_hop_bytes(rank, world, causal, lb, kv_bytes, dkv_bytes)
        assert fwd.p2p == want_fwd, f"{case} rank {rank} forward hops {fwd.p2p} != {want_fwd}"
        assert bwd.p2p == want_bwd, f"{case} rank {rank} backward hops {bwd.p2p} != {want_bwd}"
        for phase, want_ops in (("forward", want_fwd), ("backward", want_bwd)):
            for kind in ("send", "recv"):
                total = sum(n for kd, n in want_ops if kd == kind)
                assert stats.nbytes[(phase, kind)] == total, (case, phase, kind)
        if causal and lb == "zigzag" or not causal:
            # every step computes; each step but the last issues its transfer before its
            # products (the last step's products merge with the previous step's in the timeline)
            assert fwd.timeline == ["comm", "mm"] * (world - 1), fwd.timeline
            assert bwd.timeline == ring_backward_timeline(world), bwd.timeline
    return errs


def _modes_worker(rank: int, world: int, cases: list[dict]) -> float:
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    worst = 0.0
    for case in cases:
        worst = max(worst, *_run_case(rank, world, group, case).values())
    return worst


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["ulysses", "ring", "all_gather_kv"])
def test_cp_matches_full_attention(mode: str, world: int) -> None:
    worst = run_ranks(_modes_worker, world, args=(_cases(mode, world),))
    assert max(worst) <= TOL


def test_cp8_matches_full_attention() -> None:
    cases = [_case("ring", True, "zigzag", 4, 2), _case("ring", True, None, 4, 4),
             _case("ulysses", True, "zigzag", 8, 2), _case("all_gather_kv", True, "zigzag", 4, 2)]
    worst = run_ranks(_modes_worker, 8, args=(cases,))
    assert max(worst) <= TOL



class _AtenOpCounter(TorchDispatchMode):
    """Counts the aten ops (by packet name) torch dispatches, views included."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as C10dOpCounter: avoid importing torch._dynamo per rank

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


#: Reorders by index (and their backward: index_add, sort for argsort) that the chunk
#: permutation replaced, and zero fills the accumulators no longer need.
_INDEX_OPS = {"index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index",
              "index_put", "index_put_", "gather", "scatter", "scatter_add", "sort", "argsort"}
_FILL_OPS = {"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like"}


def _elementwise_worker(rank: int, world: int) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    q, k, v, dout = make_qkv(7, 2, 32, 4, 2, 8)
    pos = shard_positions(32, world, rank, "zigzag")
    dl = dout[:, pos]
    found: dict[str, dict[str, int]] = {}
    for mode in ("ulysses", "ring"):
        ql, kl, vl = (x[:, pos].clone().requires_grad_(True) for x in (q, k, v))
        counter = _AtenOpCounter()
        with counter:
            out = FUNCS[mode](ql, kl, vl, group=group, causal=True, load_balance="zigzag")
            out.backward(dl)
        found[mode] = {op: n for op, n in counter.counts.items()
                       if op in _INDEX_OPS or op in _FILL_OPS}
    return found


def test_ulysses_and_ring_need_no_index_reorder_or_zero_fill() -> None:
    """Causal zigzag, forward + backward: Ulysses permutes whole chunks (no index_select /
    index_add / argsort), and neither mode zero-fills an accumulator (ring: each gradient row
    piece's first contribution is copied in; Ulysses: the kernel's gradients are written once)."""
    for rank, found in enumerate(run_ranks(_elementwise_worker, 2)):
        assert found == {"ulysses": {}, "ring": {}}, f"rank {rank}: {found}"


def _float64_worker(rank: int, world: int) -> dict[str, float]:
    """float64 inputs: output and every gradient against float64 full attention."""
    group = init_device_mesh("cpu", (world,)).get_group()
    errs: dict[str, float] = {}
    for mode, fn in FUNCS.items():
        for causal, lb in ((True, "zigzag"), (True, None), (False, "zigzag")):
            q, k, v, dout = make_qkv(3, 2, 32, 4, 2, 8, torch.float64)
            pos = shard_positions(32, world, rank, lb)
            ql, kl, vl = (x[:, pos].clone().requires_grad_(True) for x in (q, k, v))
            out = fn(ql, kl, vl, group=group, causal=causal, load_balance=lb)
            out.backward(dout[:, pos])
            assert out.dtype == torch.float64 and ql.grad.dtype == torch.float64
            ref = reference_grads(q, k, v, dout, causal)
            for name, got, full in zip(("out", "dq", "dk", "dv"),
                                       (out.detach(), ql.grad, kl.grad, vl.grad), ref):
                errs[f"{mode} causal={causal} lb={lb} {name}"] = rel_l2(got, full[:, pos])
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_float64_inputs_are_computed_in_float64(world: int) -> None:
    """float64 in, float64 math: every mode within 1e-10 of float64 full attention (before:
    ~1e-7, the blocks, merges and accumulators ran in float32 and only the result was cast)."""
    for rank, errs in enumerate(run_ranks(_float64_worker, world)):
        bad = {n: e for n, e in errs.items() if not e <= 1e-10}
        assert not bad, f"rank {rank}/{world}: rel-L2 above 1e-10: {bad}"
