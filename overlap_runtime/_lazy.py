"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package lists ``{name: submodule}`` and gets a module-level ``__getattr__`` that imports the
submodule on the first use of one of its names (and caches the value in the package), and a
``__dir__`` that shows the names before they are loaded. Used where importing everything up
front would cost: ``overlap-runtime --help`` (pydantic, torch) and the Triton kernels (triton
must not be imported before ``TRITON_INTERPRET`` is set).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` re-exporting ``exports`` lazily.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the submodule (relative to ``package``) that defines it, or a
            module's absolute name (``overlap_runtime.config.train``) for a name a lower
            package defines and this one presents.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = module if module.startswith("overlap_runtime.") else f"{package}.{module}"
        value = getattr(importlib.import_module(target), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
