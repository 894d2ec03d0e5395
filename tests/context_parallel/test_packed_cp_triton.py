"""Packed (THD) batches under GDN context parallelism with ``backend="triton"`` (issue #23).

The three modes run the Triton op under the CPU interpreter (``TRITON_INTERPRET=1`` in the
ranks' environment only, as ``test_gdn_cp_triton.py``), fp32, head dims K = V = 16, 64 tokens
per rank, against the single-process float64 eager layer run on each document alone: output,
input gradient and every parameter gradient (summed over the ranks) within rel-L2 1e-5, the
Triton CP tests' tolerance (fp32 kernels; measured <= 2.6e-6, a parameter gradient).

Cases: one document over every rank (the state crosses the boundary, the middle ranks of CP4
pass it through), a document crossing the boundary between one shorter than the conv halo and
two one-token documents (lengths not multiples of 64, pieces shorter than a chunk), and two
rows (documents starting exactly at a shard start: the eager tests, the same piece logic).
"""

from __future__ import annotations

import importlib.util

import pytest

from overlap_runtime.testing import run_ranks
from tests.support.interpreter import INTERPRETER_ENV, Interpreted

from tests.support.packed_cp import Case, gdn_worker

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
]

TOL = 1e-5
HEAD_DIM = 16  # interpreter head dims: 16 or 32 (triton/capability.py)
LOCAL = 64  # the Triton CP rule: whole 64-token chunks per rank

CASES_CP2: list[Case] = [
    (1, LOCAL, [2 * LOCAL]),                    # one document, the state crosses the boundary
    (1, LOCAL, [2, 67, 1, 1, 57]),              # < halo, crossing, one-token documents
    (2, LOCAL, [5, 123, 70, 58]),               # two rows
]


def _check(worst: dict[str, float], what: str) -> None:
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{what}: rel-L2 above {TOL}: {bad}"
    assert worst, f"{what}: nothing was compared"


@pytest.mark.parametrize("mode", ["p2p", "all_gather", "ulysses"])
def test_triton_packed_cp2(mode: str) -> None:
    worst = run_ranks(Interpreted(gdn_worker), 2, timeout_s=300.0, env=INTERPRETER_ENV,
                      args=([mode], CASES_CP2, "triton", HEAD_DIM))[0]
    _check(worst, f"GDN packed backend=triton mode={mode} CP2 {CASES_CP2}")


def test_triton_packed_p2p_cp4() -> None:
    """A document over all four shards with tiny ends: ranks 1 and 2 pass the state through."""
    cases: list[Case] = [(1, LOCAL, [1, 4 * LOCAL - 3, 2])]
    worst = run_ranks(Interpreted(gdn_worker), 4, timeout_s=300.0, env=INTERPRETER_ENV,
                      args=(["p2p"], cases, "triton", HEAD_DIM))[0]
    _check(worst, f"GDN packed backend=triton mode=p2p CP4 {cases}")
