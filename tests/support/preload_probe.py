"""A rank function that imports nothing: which modules a rank holds when it starts
(``tests/test_launch.py``, the forkserver's preload)."""

from __future__ import annotations

import sys


def modules_at_start(rank: int, world: int, names: list[str]) -> dict[str, bool]:
    return {n: n in sys.modules for n in names}
