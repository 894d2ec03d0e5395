"""LinearAttentionContextParallel (eager) on real gloo ranks against the single-process module.

fp32, tiny Qwen3.5-shaped layer (hidden 32, 2 key / 4 value heads, head dim 8), slow decay so
the state crossing ranks matters. For every mode: output, input gradient, every parameter
gradient (summed over the CP group) and the grad norm within rel-L2 1e-5 of the single-process
module. Worker code: tests/support/gdn_cp.py.
"""

from __future__ import annotations

import pytest
from tests.support.gdn_cp import assert_figures, checkpoint_worker, compare_worker

from overlap_runtime.testing import run_ranks

TOL = 1e-5
MODES = ("ulysses", "p2p", "all_gather")


@pytest.mark.parametrize(
    "mode,cp,value_heads",
    [
        ("ulysses", 2, 4),     # key heads split evenly (1 per rank)
        ("p2p", 2, 4),
        ("all_gather", 2, 4),
        ("p2p", 8, 4),         # the longest chain
        ("ulysses", 8, 8),     # cp > key heads: each key head replicated to 4 ranks
    ],
)
def test_matches_single_process(mode: str, cp: int, value_heads: int) -> None:
    results = run_ranks(compare_worker, cp, args=(mode, 1, 64, 1, False, False, value_heads))
    for rank, res in enumerate(results):
        assert_figures(res["worst"], f"mode={mode} cp={cp} rank={rank}", TOL)


@pytest.mark.parametrize("mode", MODES)
def test_twenty_consecutive_runs_cp4(mode: str) -> None:
    """20 forward/backward runs on fresh inputs, same module: no mismatch, no hang."""
    results = run_ranks(compare_worker, 4, args=(mode, 1, 64, 20))
    for rank, res in enumerate(results):
        assert_figures(res["worst"], f"mode={mode} cp=4 rank={rank}, worst of 20 runs", TOL)


@pytest.mark.parametrize("mode", MODES)
def test_padding_and_partial_chunks_cp4(mode: str) -> None:
    """B=2, local 70 (partial chunks), global 280 (not a multiple of 64 * 4).

    Row 0: 173 real tokens then right padding (rank 3 holds only padding); row 1: 5 left pads.
    Padded positions give exact zeros (output and input gradient) and the real tokens of each
    row equal the unpadded sequence run alone.
    """
    results = run_ranks(compare_worker, 4, args=(mode, 2, 70, 1, True))
    for rank, res in enumerate(results):
        what = f"mode={mode} cp=4 rank={rank} padded"
        assert_figures(res["worst"], what, TOL)
        assert res["pad_out_max_abs"] == 0.0, what
        assert res["pad_dx_max_abs"] == 0.0, what
        assert res["row0_vs_unpadded"] <= TOL, what
        assert res["row1_vs_unpadded"] <= TOL, what


@pytest.mark.parametrize("mode,cp", [("p2p", 4), ("ulysses", 2), ("all_gather", 2)])
def test_activation_checkpoint_identical(mode: str, cp: int) -> None:
    """checkpoint(use_reentrant=False) recomputes the forward - its halo, state chain or
    collectives included - inside backward; twice in a row the results equal the plain run
    bit for bit, so the P2P order stays aligned."""
    results = run_ranks(checkpoint_worker, cp, args=(mode, 1, 64))
    for rank, res in enumerate(results):
        what = f"mode={mode} cp={cp} rank={rank} checkpointed"
        assert res["identical"], what
        assert_figures(res["worst"], what, TOL)
