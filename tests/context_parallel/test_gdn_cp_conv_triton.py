"""The CP halo conv with ``conv_backend="triton"`` (the ``ops.causal_conv`` kernels with the
previous rank's halo as ``left``, d_left sent back) on gloo ranks under the Triton interpreter,
against the single-process layer with the torch conv (``F.conv1d``): output, input gradient,
every parameter gradient and the grad norm within rel-L2 1e-5.

p2p CP2, B = 2, local 64 (the GDN core on the eager backend: only the conv runs interpreted),
and Ulysses CP2 (the local conv of a head slice, ``channels`` indexing the weight). Ranks run as
children with ``TRITON_INTERPRET=1`` (see test_gdn_cp_triton.py); both modes in one spawn of
two ranks (a module fixture; each test asserts its mode's results). About 6 s on two cores.
"""

from __future__ import annotations

import importlib.util

import pytest
from tests.support.gdn_cp import assert_figures, compare_worker, jobs_worker

from overlap_runtime.testing import run_ranks
from tests.support.interpreter import INTERPRETED_RANK_ENV, Interpreted

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
]


MODES = ["p2p", "ulysses"]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """Per rank ``{mode: compare_worker's result}``, both modes in one spawn."""
    jobs = [(mode, compare_worker, (mode, 2, 64, 1, False, False, 4, "eager", 8, "triton"))
            for mode in MODES]
    return run_ranks(Interpreted(jobs_worker), 2, timeout_s=300.0, env=INTERPRETED_RANK_ENV,
                     args=(jobs,))


@pytest.mark.parametrize("mode", MODES)
def test_triton_conv_cp2_matches_single_process(mode: str, results: list[dict]) -> None:
    for rank, r in enumerate(results):
        res = r[mode]
        what = f"conv_backend=triton mode={mode} cp=2 rank={rank}"
        assert res["triton_interpreted"], f"{what}: the Triton kernels did not run"
        assert_figures(res["worst"], what, 1e-5)
