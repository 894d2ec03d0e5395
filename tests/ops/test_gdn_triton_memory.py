"""What the Triton GDN saves for backward.

The forward keeps the raw q, k and their fp32 1/norm, not the normalised copies (the backward's
kernels normalise the tiles they load, with the norm kernel's operations), never u (no backward kernel reads it), and w
unless ``GDNKernelOptions(recompute_w=True)``. One child process under the Triton interpreter
(``tests.support.gdn_triton_memory_cases``; why a child: test_gdn_triton.py) runs four fp32 configs (key
heads shared by value heads, H == HV with dk's norm backward in the WY kernel, no norm,
cu_seqlens), each with and without ``recompute_w``, and the float64 eager backend.
"""

from __future__ import annotations

import pytest

from tests.support.gdn import run_interpreted

pytestmark = pytest.mark.triton

needs_triton = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def report() -> dict:
    return run_interpreted("gdn_triton_memory_cases", "all")


@needs_triton
def test_saved_tensors_hold_no_normalised_copies_nor_u(report):
    for config, r in report["configs"].items():
        for mode, saved in r["saved"].items():
            where = f"{config}, {mode}"
            assert saved["q_k_inputs"] == 2, f"{where}: raw q, k not saved: {saved}"
            assert (saved["qn"], saved["kn"]) == (0, 0), f"{where}: normalised copy saved: {saved}"
            assert saved["u"] == 0, f"{where}: u saved: {saved}"
            assert saved["rstd"] == (2 if r["l2norm"] else 0), f"{where}: 1/norm: {saved}"


@needs_triton
def test_recompute_w_leaves_w_out(report):
    for config, r in report["configs"].items():
        kept, lean = r["saved"]["saved_w"], r["saved"]["recompute_w"]
        assert kept["w"] == 1 and lean["w"] == 0, f"{config}: w saved {kept['w']} / {lean['w']}"
        # bytes_before adds back what is not saved (w too in the lean set): equal iff w's
        # bytes are the one difference between the two saved sets
        assert lean["bytes"] < kept["bytes"] < kept["bytes_before"], (config, kept, lean)
        assert lean["bytes_before"] == kept["bytes_before"], (config, kept, lean)


@needs_triton
def test_recomputed_tensors_are_the_forwards_bit_for_bit(report):
    for config, r in report["configs"].items():
        assert all(r["recomputed_equal"].values()), (config, r["recomputed_equal"])


@needs_triton
def test_recompute_w_gives_the_same_results_bit_for_bit(report):
    for config, r in report["configs"].items():
        assert len(r["bitwise"]) == 8 and all(r["bitwise"].values()), (config, r["bitwise"])


@needs_triton
def test_both_paths_match_the_float64_reference(report):
    tol = report["tolerance"]
    for config, r in report["configs"].items():
        bad = {name: err for name, err in r["errors"].items() if not err <= tol}
        assert not bad, f"{config}: rel-L2 above {tol}: {bad}"
