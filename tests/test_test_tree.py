"""The layout of tests/ and benchmarks/, read with ``ast`` (nothing is imported).

- Test helpers live in one importable package, ``tests.support``: no other module under tests/
  is a helper (every other ``*.py`` is a ``test_*.py`` module or a ``conftest.py``), and no test
  module imports another test module (shared layouts and toys belong in ``tests.support``).
- Nothing under tests/ or benchmarks/ edits ``sys.path``: the repository root is on the path
  (pytest's ``pythonpath``; ``python -m benchmarks.<name>`` from the root) and modules import
  ``tests.support.<module>`` and ``benchmarks.<module>``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"


def _modules(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py"))


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _edits_sys_path(tree: ast.AST) -> bool:
    """A call ``sys.path.<insert|append|extend|remove>(...)`` (``sys`` under any name)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("insert", "append", "extend", "remove")
               and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "path"
               and isinstance(n.func.value.value, ast.Name) for n in ast.walk(tree))


def test_helpers_are_in_the_support_package_only() -> None:
    stray = [str(p.relative_to(ROOT)) for p in _modules(TESTS)
             if SUPPORT not in p.parents and p.name != "conftest.py"
             and not p.name.startswith("test_")]
    assert stray == [], f"helper modules outside tests/support: {stray}"
    assert (SUPPORT / "__init__.py").is_file()


def test_no_test_module_imports_another_test_module() -> None:
    bad = []
    for path in _modules(TESTS, ROOT / "benchmarks"):
        for name in _imported(ast.parse(path.read_text(), str(path))):
            top = name.split(".")[0]
            if name.split(".")[-1].startswith("test_") or (
                    top.startswith("_") and top not in sys.stdlib_module_names):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == [], bad


def test_nothing_edits_sys_path() -> None:
    bad = [str(p.relative_to(ROOT)) for p in _modules(TESTS, ROOT / "benchmarks")
           if _edits_sys_path(ast.parse(p.read_text(), str(p)))]
    assert bad == [], f"sys.path edited in {bad}"
