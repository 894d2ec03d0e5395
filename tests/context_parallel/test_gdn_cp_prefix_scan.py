"""``mode="prefix_scan"``: every rank's entering GDN state by an exclusive scan in log2 P rounds.

Core level (``gdn_prefix_scan`` on each rank's shard), fp32 on gloo ranks, against the float64
token-by-token recurrence on the whole sequence: the output and the gradient of every input
(q, k, v, g, beta) within rel-L2 1e-5; in the same run the sequential p2p chain on the same
shards, which the scan must equal within fp32 rounding (rel-L2 <= 1e-6). One spawn of 8 ranks
covers CP 2..8 through sub-groups (``tests.support.gdn_scan``); local lengths 40 and 24 with chunk
16 leave a partial last chunk on every rank; B = 2.
"""

from __future__ import annotations

import importlib.util

import pytest
from tests.support.gdn_cp import assert_figures, checkpoint_worker, compare_worker
from tests.support.gdn_scan import NAMES, scan_worker

from overlap_runtime.context_parallel.gdn.scan_rounds import scan_messages, scan_rounds
from overlap_runtime.testing import run_ranks
from tests.support.interpreter import INTERPRETED_RANK_ENV, Interpreted

TOL = 1e-5
SAME = 1e-6  # scan vs chain: only the order of the fp32 compositions differs

# (cp, batch, local length, chunk size): partial chunks everywhere (40 = 2 x 16 + 8)
EAGER_CASES = [(2, 2, 40, 16), (3, 2, 40, 16), (4, 1, 24, 16), (5, 2, 40, 16),
               (6, 1, 24, 16), (7, 1, 40, 16), (8, 2, 40, 16)]


def _check(results: list[dict], cases: list[tuple[int, int, int, int]], what: str) -> None:
    for cp, batch, local, chunk in cases:
        key = f"cp={cp} B={batch} local={local} chunk={chunk}"
        for rank in range(cp):
            fig = results[rank][key]
            assert set(fig) == {f"{w}:{n}" for w in ("scan", "chain", "scan_vs_chain")
                                for n in NAMES}, (what, key, sorted(fig))
            bad = {k: v for k, v in fig.items()
                   if not v <= (SAME if k.startswith("scan_vs_chain") else TOL)}
            assert not bad, f"{what} {key} rank {rank}: {bad} (all: {fig})"


def test_scan_plan_rounds_and_messages() -> None:
    """ceil(log2 P) rounds; every send has its receive (same round, same kind); a sender whose
    window reaches rank 0 sends a state, the others an (M, S) pair."""
    for world in range(1, 65):
        rounds = scan_rounds(world)
        assert rounds == (world - 1).bit_length()
        sends, recvs = set(), set()
        for p in range(world):
            msgs = scan_messages(world, p)
            assert len([m for m in msgs if m[1] == "recv"]) <= rounds
            for d, kind, peer, full in msgs:
                assert abs(peer - p) == 1 << d and d < rounds
                (sends if kind == "send" else recvs).add(
                    (d, p, peer, full) if kind == "send" else (d, peer, p, full))
        assert sends == recvs, world
    # rank 5 of 6: pairs from 4 and 3, then rank 1's state (module docstring's picture)
    assert scan_messages(6, 5) == [(0, "recv", 4, True), (1, "recv", 3, True),
                                   (2, "recv", 1, False)]


def test_prefix_scan_cp2_to_cp8_against_float64_and_chain() -> None:
    results = run_ranks(scan_worker, 8, timeout_s=300.0, args=(EAGER_CASES,))
    _check(results, EAGER_CASES, "eager")


def test_prefix_scan_layer_padding_partial_chunks_cp4() -> None:
    """The whole layer (halo conv, gates, padding): B=2, local 70, rank 3 only padding; against
    the single-process module (every parameter gradient), exact zeros on padding."""
    results = run_ranks(compare_worker, 4, args=("prefix_scan", 2, 70, 1, True))
    for rank, res in enumerate(results):
        what = f"mode=prefix_scan cp=4 rank={rank} padded"
        assert_figures(res["worst"], what, TOL)
        assert res["pad_out_max_abs"] == 0.0, what
        assert res["pad_dx_max_abs"] == 0.0, what


def test_prefix_scan_activation_checkpoint_identical_cp3() -> None:
    """The recompute replays the scan's rounds inside backward: bitwise the plain run, twice."""
    results = run_ranks(checkpoint_worker, 3, args=("prefix_scan", 1, 64))
    for rank, res in enumerate(results):
        what = f"mode=prefix_scan cp=3 rank={rank} checkpointed"
        assert res["identical"], what
        assert_figures(res["worst"], what, TOL)


TRITON_CASES = [(2, 1, 64, 64), (3, 1, 128, 64)]  # one chunk (one segment); two segments


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_prefix_scan_triton_interpreted_against_float64_and_chain() -> None:
    """backend="triton" under TRITON_INTERPRET=1, head dim 16: the scan runs inside the op's
    state hooks on its own segment summaries (CP2 with one chunk per rank, CP3 with two)."""
    results = run_ranks(Interpreted(scan_worker), 3, timeout_s=400.0, env=INTERPRETED_RANK_ENV,
                        args=(TRITON_CASES, "triton", 16))
    assert all(r["triton_interpreted"] for r in results), "the Triton kernels did not run"
    _check(results, TRITON_CASES, "triton")
