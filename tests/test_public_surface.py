"""What the packages of ``overlap_runtime`` present: ``__all__`` of each package ``__init__``.

* Only a package ``__init__`` (and the top-level ``testing`` module, the harness API) lists a
  public surface with ``__all__``: a module inside a package is reached through its package's
  surface or by its own path, and does not keep a second list of its names.

* Every name a package lists resolves (a lazy package's names too, each loading its module), so
  the public surface never names something that is gone.
* A lazy package (``lazy_exports(__name__, MAPPING)``) lists each name once: ``__all__`` is
  ``sorted(MAPPING)``, and no ``if TYPE_CHECKING:`` block repeats the names as imports.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "overlap_runtime"
INITS = sorted(PACKAGE.rglob("__init__.py"))


def _package(init: Path) -> str:
    return ".".join(init.relative_to(ROOT).parent.parts)


def _lazy_mapping(tree: ast.Module) -> str | None:
    """The mapping's name in a module-level ``lazy_exports(__name__, NAME)``, or None."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Name)):
            return node.args[1].id
    return None


#: modules other than package ``__init__`` files that may define ``__all__``
SURFACE_MODULES = {PACKAGE / "testing.py"}


def defines_all(source: str) -> bool:
    """Whether a module's top level assigns ``__all__``."""
    for node in ast.parse(source).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_only_package_surfaces_define_all() -> None:
    stray = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "__init__.py" and p not in SURFACE_MODULES
             and defines_all(p.read_text())]
    assert stray == [], f"__all__ outside a package's surface: {stray}"
    assert defines_all("x = 1\n__all__ = ['x']\n") and defines_all("__all__: list = []\n")
    assert not defines_all("def f():\n    __all__ = []\n")


def lazy_listing_problems(source: str) -> list[str]:
    """Why a lazy package's ``__init__`` source lists a name twice (empty: once each)."""
    tree = ast.parse(source)
    mapping = _lazy_mapping(tree)
    if mapping is None:
        return []
    problems = []
    all_values = [node.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                  and any(isinstance(t, ast.Name) and t.id == "__all__"
                          for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    derived = (len(all_values) == 1 and isinstance(all_values[0], ast.Call)
               and getattr(all_values[0].func, "id", None) == "sorted"
               and [getattr(a, "id", None) for a in all_values[0].args] == [mapping])
    if not derived:
        problems.append(f"__all__ must be sorted({mapping}), not a second list of the names")
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            problems.append(f"line {node.lineno}: an `if TYPE_CHECKING:` block repeats the "
                            f"names of {mapping} as imports")
    return problems


@pytest.mark.parametrize("init", [i for i in INITS if "lazy_exports(" in i.read_text()],
                         ids=_package)
def test_a_lazy_package_lists_each_name_once(init: Path) -> None:
    assert lazy_listing_problems(init.read_text()) == []


def test_a_second_listing_is_found() -> None:
    listed_twice = ('from typing import TYPE_CHECKING\n_EXPORTS = {"f": "mod"}\n'
                    '__all__ = ["f"]\nif TYPE_CHECKING:\n    from .mod import f\n'
                    "__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)\n")
    assert len(lazy_listing_problems(listed_twice)) == 2
    once = '_EXPORTS = {"f": "mod"}\n__all__ = sorted(_EXPORTS)\n' \
           "__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)\n"
    assert lazy_listing_problems(once) == []


def test_every_listed_name_resolves() -> None:
    # in a fresh interpreter: resolving the lazy names imports triton, which other tests must
    # be able to import after setting TRITON_INTERPRET
    code = (
        "import importlib, json, sys\n"
        "missing = []\n"
        f"for pkg in {[_package(i) for i in INITS]!r}:\n"
        "    mod = importlib.import_module(pkg)\n"
        "    for name in getattr(mod, '__all__', ()):\n"
        "        try:\n"
        "            getattr(mod, name)\n"
        "        except (AttributeError, ImportError) as exc:\n"
        "            missing.append(f'{pkg}.{name}: {exc}')\n"
        "print(json.dumps(missing))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
