"""Imports read from source with ``ast`` (no module is imported): shared by the import-layering
test (tests/test_import_graph.py) and ``benchmarks.import_scan``."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """``root/a/b.py`` -> ``<root's name>.a.b`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_statements(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement outside ``if TYPE_CHECKING:`` bodies, and whether it sits in a
    function (or lambda) body."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def lazy_targets(tree: ast.Module) -> list[str]:
    """Submodules named by ``X`` in a module-level ``lazy_exports(__name__, X)``."""
    dicts: dict[str, ast.Dict] = {}
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        for t in targets:
            if isinstance(t, ast.Name) and isinstance(value, ast.Dict):
                dicts[t.id] = value
    out: list[str] = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Name)):
            mapping = dicts.get(node.args[1].id)
            assert mapping is not None, f"lazy_exports({node.args[1].id}) needs a dict literal"
            out += [v.value for v in mapping.values if isinstance(v, ast.Constant)]
    return out


def import_targets(node: ast.Import | ast.ImportFrom, package: str, modules: set[str],
                   own: str) -> list[str]:
    """The dotted names one statement imports, in ``package`` (the importing module's package);
    ``from pkg import sub`` names the submodule ``pkg.sub`` when ``modules`` holds it (under the
    package ``own``), else ``pkg``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - (node.level - 1)]
                        + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        out.append(full if full in modules or not base.startswith(own) else base)
    return out


def resolve(name: str, modules: set[str]) -> str | None:
    """The module ``name`` denotes (a longest known prefix: ``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def within(mod: str, package: str) -> bool:
    """``mod`` is ``package`` or inside it."""
    return mod == package or mod.startswith(package + ".")
