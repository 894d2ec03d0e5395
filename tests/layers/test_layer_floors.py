"""The import floors around ``layers``: it imports only ``ops`` (and torch, the standard
library); ``context_parallel`` never imports ``models``, not even inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import overlap_runtime

PACKAGE = Path(overlap_runtime.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (relative ones
    resolved against the file's package), at any depth of the file (functions included)."""
    package = ["overlap_runtime", *path.relative_to(PACKAGE).parent.parts]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            if node.module is None:  # ``from . import x``: x is a module
                names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _files(subpackage: str) -> list[Path]:
    files = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert files, f"no modules under {subpackage}/"
    return files


def test_layers_import_only_ops_and_torch() -> None:
    allowed_outside = set(sys.stdlib_module_names) | {"torch"}
    bad = []
    for path in _files("layers"):
        for name in _imported_modules(path):
            top = name.split(".")[0]
            if top == "overlap_runtime":
                ok = name.startswith(("overlap_runtime.ops", "overlap_runtime.layers"))
            else:
                ok = top in allowed_outside
            if not ok:
                bad.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert not bad, f"layers/ may import only ops/ and torch: {bad}"


def test_context_parallel_never_imports_models() -> None:
    bad = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _files("context_parallel")
        for name in _imported_modules(path)
        if name == "overlap_runtime.models" or name.startswith("overlap_runtime.models.")
    ]
    assert not bad, f"context_parallel/ must not import models/: {bad}"


def test_floors_import_alone_in_a_fresh_interpreter() -> None:
    code = (
        "import sys, overlap_runtime.layers, overlap_runtime.context_parallel; "
        "print(sorted(m for m in sys.modules if m.startswith('overlap_runtime.models')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"layers/context_parallel loaded {out.stdout.strip()}"
