"""benchmarks/gdn_walks.py: every walk variant it times on the GPU computes what the library's
walk computes (states, v_new, final state), checked under the Triton interpreter in fp32 at
K = V = 64 (600 tokens, the segmented library path) and K = V = 128 (the split kernel's two
state blocks), before a GPU lease spends minutes timing them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.triton, pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed")]


def test_every_walk_variant_matches_the_librarys_walk():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gdn_walks", "--check"],
                          env=env, capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout)
    assert {name.split()[0] for name in errors} == {"lib_segmented", "lib_bv32", "split"}
    bad = {name: e for name, e in errors.items() if not max(e.values()) <= 1e-5}
    assert not bad, f"rel-L2 against the library's walk above 1e-5: {bad}"
