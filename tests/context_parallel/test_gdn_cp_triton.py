"""LinearAttentionContextParallel with backend="triton" on gloo ranks, under the Triton interpreter.

Every case runs its ranks as child processes with ``TRITON_INTERPRET=1`` in their environment
(``run_ranks(..., env=...)``): the children start from a forkserver whose preloads
(``rank_start.FORKSERVER_PRELOAD_*``) import no triton, nor does ``import overlap_runtime``, and
the variable is set before the worker runs, so the first triton import in a child sees it and
nothing leaks into this process or other test files.

Sizes are the smallest the interpreter runs: head dims K = V = 16, 2 key / 4 value heads, hidden
32, local sequence 64 (one chunk per rank), B = 1, fp32. Against the single-process module on the
eager backend: output, input gradient, every parameter gradient (summed over the CP group) and
the grad norm within rel-L2 1e-5 (measured: <= ~1e-6). The slow decay of ``make_module`` makes the
state crossing ranks matter (dropping the chain's ``M^T dH_out`` and the final-state gradient
from the Triton backward raises the gradient errors to ~0.3-0.5).

* ulysses CP2: the Triton GDN op over the full sequence (128 tokens) on each rank's 2 heads.
* p2p CP2, local 128 (two chunks, so two segments per rank): the chain continues through the
  op's segment summaries; rank 0 sends the chain's end before its scans, rank 1 sends dH_in
  from the reverse chain before its per-chunk reverse scan.
* p2p CP3, local 64 (one chunk, one segment): the hooks fall back to the scan's own ends (the
  state is sent after the scan, dH_in after the reverse scan); the middle rank does both.
* all_gather CP2: the eager summaries gathered, the Triton op from ``H_in`` on each rank
  (its backward's ``dh0`` carries the gradient back into the gathered summaries).
* p2p CP2 with padding (B=2, right and left, one rank holding only padding): exact zeros.
* p2p CP2 under ``checkpoint(use_reentrant=False)``, twice: bitwise the plain run (which runs
  once: both checkpointed calls are compared with it).

The CP2 cases share one spawn of two ranks (``jobs_worker``, a module fixture: each test asserts
its own results); p2p CP3 has its own. About 35 s of CPU in all (the interpreter dominates).
"""

from __future__ import annotations

import importlib.util

import pytest
from tests.support.gdn_cp import (assert_figures, checkpoint_worker, compare_worker,
                                  jobs_worker)

from overlap_runtime.testing import run_ranks
from tests.support.interpreter import INTERPRETED_RANK_ENV, Interpreted

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
]

TOL = 1e-5
HEAD_DIM = 16  # interpreter head dims: 16 or 32 (triton/capability.py)

COMPARE_CASES = [("ulysses", 2, 64), ("p2p", 2, 128), ("p2p", 3, 64), ("all_gather", 2, 64)]


def _compare_args(mode: str, batch: int, local_len: int, use_mask: bool) -> tuple:
    return (mode, batch, local_len, 1, use_mask, False, 4, "triton", HEAD_DIM)


@pytest.fixture(scope="module")
def cp2_results() -> list[dict]:
    """Every CP2 case of this file in one spawn of two ranks: per rank ``{case: result}``."""
    jobs = [(f"{mode}-{local_len}", compare_worker, _compare_args(mode, 1, local_len, False))
            for mode, cp, local_len in COMPARE_CASES if cp == 2]
    jobs.append(("padding", compare_worker, _compare_args("p2p", 2, 64, True)))
    jobs.append(("checkpoint", checkpoint_worker, ("p2p", 1, 64, "triton", HEAD_DIM, True)))
    return run_ranks(Interpreted(jobs_worker), 2, timeout_s=400.0, env=INTERPRETED_RANK_ENV,
                     args=(jobs,))


@pytest.mark.parametrize("mode,cp,local_len", COMPARE_CASES)
def test_triton_matches_single_process_eager(mode: str, cp: int, local_len: int,
                                             request: pytest.FixtureRequest) -> None:
    if cp == 2:
        results = [r[f"{mode}-{local_len}"] for r in request.getfixturevalue("cp2_results")]
    else:
        results = run_ranks(Interpreted(compare_worker), cp, timeout_s=300.0,
                            env=INTERPRETED_RANK_ENV, args=_compare_args(mode, 1, local_len, False))
    assert len(results) == cp
    for rank, res in enumerate(results):
        what = f"backend=triton mode={mode} cp={cp} local={local_len} rank={rank}"
        assert res["triton_interpreted"], f"{what}: the Triton kernels did not run"
        assert_figures(res["worst"], what, TOL)


def test_triton_p2p_padding_cp2(cp2_results: list[dict]) -> None:
    """B=2: row 0 has 27 real tokens then right padding (rank 1 holds only padding), row 1 five
    left pads. Padded outputs and input gradients are exactly 0; real tokens equal the unpadded
    row run alone."""
    for rank, r in enumerate(cp2_results):
        res = r["padding"]
        what = f"backend=triton mode=p2p cp=2 rank={rank} padded"
        assert res["triton_interpreted"], f"{what}: the Triton kernels did not run"
        assert_figures(res["worst"], what, TOL)
        assert res["pad_out_max_abs"] == 0.0, what
        assert res["pad_dx_max_abs"] == 0.0, what
        assert res["row0_vs_unpadded"] <= TOL, what
        assert res["row1_vs_unpadded"] <= TOL, what


def test_triton_p2p_activation_checkpoint_identical(cp2_results: list[dict]) -> None:
    """checkpoint(use_reentrant=False) recomputes the forward (halo, summary, H message) inside
    backward; twice in a row the results equal the plain run bit for bit."""
    for rank, r in enumerate(cp2_results):
        res = r["checkpoint"]
        what = f"backend=triton mode=p2p cp=2 rank={rank} checkpointed"
        assert res["identical"], what
        assert_figures(res["worst"], what, TOL)
