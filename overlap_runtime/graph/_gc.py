"""Pause Python's cyclic garbage collector around allocation-heavy passes.

Compiling a 100k-task schedule allocates millions of small tuples, lists and dicts; each
allocation burst triggers generation scans whose cost grows with the number of live objects,
which tripled the time of ``pp=32, v=2, m=256`` (benchmarks/schedule_compile.py). The passes
create no reference cycles, so pausing the collector loses nothing; it is re-enabled on exit
(only if it was enabled on entry, so nesting is fine).
"""

from __future__ import annotations

import functools
import gc
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def gc_paused(fn: F) -> F:
    """Decorator: run ``fn`` with the cyclic GC disabled."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]
