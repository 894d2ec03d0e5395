"""Packed (THD) batches under GDN ``mode="prefix_scan"`` against each document run alone and
against the packed p2p chain.

One spawn of 5 ranks runs CP2, CP4 and CP5 on sub-groups (``scan_chain_worker``):
the whole layer in fp32 with the global ``cu_seqlens``, output, input gradient and every
parameter gradient (summed over the group) within rel-L2 1e-5 of the float64 single-process
layer run on each document alone, and within fp32 rounding of the packed p2p chain run on the
same shards (only the order of the fp32 map compositions differs). Cases (local 8 or 12
tokens, chunk 64: partial chunks everywhere): documents crossing rank boundaries, documents
starting exactly at rank starts, ranks holding only the middle of one long document (their
whole summary is a pair in the scan's rounds), a rank whose last document starts inside it
composed with a pass-through rank into one pair (``M' = 0`` inside a composition, CP5: at
CP <= 4 the scan composes only a pair with a state, the chain's very products), two rows
with different piece patterns, documents shorter than the conv halo. The Triton backend's CP2
case under ``TRITON_INTERPRET=1`` (fp32, K = V = 16, 64 tokens per rank) is
``test_packed_cp_triton.py::test_packed_prefix_scan_triton_interpreted_cp2``: it shares that
file's spawn and its p2p chain run on the same shards.
"""

from __future__ import annotations

from overlap_runtime.testing import run_ranks

from tests.support.packed_cp import Case, scan_chain_worker

TOL = 1e-5  # fp32 against the float64 reference
SAME = 1e-6  # scan vs chain: the same maps composed in another order

CASES: list[tuple[int, Case]] = [
    (2, (1, 8, [16])),                          # one document over both ranks
    (2, (2, 8, [3, 10, 3] + [8, 8])),           # crossing; row 2 starts at the rank start
    (4, (1, 8, [32])),                          # ranks 1, 2: the middle of one document
    (4, (1, 8, [3, 22, 7])),                    # ranks 1, 2 middle only, ends inside rank 3
    (4, (1, 8, [8, 8, 8, 8])),                  # every document starts at a rank start
    (4, (2, 8, [10, 20, 2] + [16, 1, 15])),     # rank 1 M' = 0 next to pass-through rank 2
    (4, (1, 12, [2, 1, 20, 5, 11, 9])),         # < halo, < chunk, crossing twice
    # CP5: rank 2 sends rank 4 the pair c2 o c1 (two maps composed; CP <= 4 never does)
    (5, (1, 8, [3, 30, 7])),                    # ranks 1-3 the middle of one document
    (5, (2, 8, [10, 25, 5] + [16, 24])),        # row 0: c1 has M' = 0, c2 passes through
]


def _check(worst: dict[str, float], cps: set[int], what: str) -> None:
    for cp in cps:
        for kind in ("scan", "chain", "scan_vs_chain"):
            assert any(k.startswith(f"cp{cp}:{kind}:param:") for k in worst), (what, cp, kind)
    bad = {k: v for k, v in worst.items()
           if not v <= (SAME if ":scan_vs_chain:" in k else TOL)}
    assert not bad, f"{what}: above tolerance: {bad}"


def test_packed_prefix_scan_cp2_cp4_cp5_against_documents_and_chain() -> None:
    worst = run_ranks(scan_chain_worker, 5, args=(CASES,), timeout_s=150)[0]
    _check(worst, {2, 4, 5}, f"GDN packed prefix_scan eager {CASES}")
