"""Packed (THD) batches under GDN context parallelism with ``backend="triton"`` (issue #23).

The four modes run the Triton op under the CPU interpreter (``TRITON_INTERPRET=1`` in the
ranks' environment only, as ``test_gdn_cp_triton.py``), fp32, head dims K = V = 16, 64 tokens
per rank, against the single-process float64 eager layer run on each document alone: output,
input gradient and every parameter gradient (summed over the ranks) within rel-L2 1e-5, the
Triton CP tests' tolerance (fp32 kernels; measured <= 2.6e-6, a parameter gradient).

Cases: one document over every rank (the state crosses the boundary, the middle ranks of CP4
pass it through), two rows: a document crossing the boundary between one shorter than the conv
halo and two one-token documents (lengths not multiples of 64, pieces shorter than a chunk),
then two documents, the second starting exactly at rank 1's start; and two rows of documents
crossing the boundary.

One spawn of two ranks runs the CP2 cases of every mode (the float64 reference once per case):
p2p, all_gather and ulysses on the three cases, prefix_scan on the second, which it also
compares with the p2p chain run on the same shards there (within fp32 rounding, rel-L2 <= 1e-6:
only the order of the map compositions differs); each test asserts its mode's figures.
"""

from __future__ import annotations

import importlib.util

import pytest

from overlap_runtime.testing import run_ranks
from tests.support.interpreter import INTERPRETED_RANK_ENV, Interpreted

from tests.support.packed_cp import Case, gdn_worker

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
]

TOL = 1e-5
HEAD_DIM = 16  # interpreter head dims: 16 or 32 (triton/capability.py)
LOCAL = 64  # the Triton CP rule: whole 64-token chunks per rank

SAME = 1e-6  # prefix_scan vs the p2p chain: the same maps composed in another order

CASES_CP2: list[Case] = [
    (1, LOCAL, [2 * LOCAL]),                    # one document, the state crosses the boundary
    # row 0: < halo, crossing, one-token documents; row 1: a document starts at rank 1's start
    (2, LOCAL, [2, 67, 1, 1, 57] + [LOCAL, LOCAL]),
    (2, LOCAL, [5, 123, 70, 58]),               # two rows
]
MODES = ["p2p", "all_gather", "ulysses", "prefix_scan"]
#: the modes each case runs: prefix_scan (and its comparison with the chain) on the second
CASE_MODES = [MODES[:3], MODES, MODES[:3]]


@pytest.fixture(scope="module")
def cp2_figures() -> dict[str, float]:
    """The worst figure of every mode over its cases, one spawn (``{"<mode>:<tensor>": rel-L2,
    "scan_vs_chain:<tensor>": rel-L2}``)."""
    return run_ranks(Interpreted(gdn_worker), 2, timeout_s=600.0, env=INTERPRETED_RANK_ENV,
                     args=(MODES, CASES_CP2, "triton", HEAD_DIM, CASE_MODES, True))[0]


def _check(worst: dict[str, float], prefix: str, what: str, tol: float = TOL) -> None:
    figures = {k: v for k, v in worst.items() if k.startswith(prefix)}
    for name in ("out", "dx", "param:"):
        assert any(k.startswith(prefix + name) for k in figures), (
            f"{what}: no {prefix}{name} figure in {sorted(worst)}")
    bad = {k: v for k, v in figures.items() if not v <= tol}
    assert not bad, f"{what}: rel-L2 above {tol}: {bad}"


@pytest.mark.parametrize("mode", ["p2p", "all_gather", "ulysses"])
def test_triton_packed_cp2(mode: str, cp2_figures: dict[str, float]) -> None:
    _check(cp2_figures, f"{mode}:", f"GDN packed backend=triton mode={mode} CP2 {CASES_CP2}")


def test_packed_prefix_scan_triton_interpreted_cp2(cp2_figures: dict[str, float]) -> None:
    """prefix_scan on the second case (row 0: a document crossing the boundary between one
    shorter than the halo and one-token documents; row 1: a document starting exactly at rank
    1's start): against the per-document reference and within fp32 rounding of the p2p chain on
    the same shards (moved here from test_packed_cp_prefix_scan.py to share the chain's run)."""
    what = f"GDN packed prefix_scan backend=triton {CASES_CP2[1]}"
    _check(cp2_figures, "prefix_scan:", what)
    _check(cp2_figures, "p2p:", what)
    _check(cp2_figures, "scan_vs_chain:", what, SAME)


def test_triton_packed_p2p_cp4() -> None:
    """A document over all four shards with tiny ends: ranks 1 and 2 pass the state through."""
    cases: list[Case] = [(1, LOCAL, [1, 4 * LOCAL - 3, 2])]
    worst = run_ranks(Interpreted(gdn_worker), 4, timeout_s=300.0, env=INTERPRETED_RANK_ENV,
                      args=(["p2p"], cases, "triton", HEAD_DIM))[0]
    _check(worst, "p2p:", f"GDN packed backend=triton mode=p2p CP4 {cases}")
