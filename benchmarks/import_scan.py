"""Layering figures of the ``overlap_runtime`` package, read from the source with ``ast`` (the
package is never imported, so the figures hold on a machine without torch).

Prints:

(a) modules ``stepgraph`` reaches (transitively) that import ``torch.distributed``;
(b) ``trainer`` modules ``stepgraph`` reaches;
(c) function-level imports of the package's own modules (``file:line``);
(d) library files spelling a GDN context-parallel mode name as a string literal;
(e) ``torch.autograd.Function`` subclasses in ``context_parallel/gdn``.

An import counts wherever it sits (module level or inside a function: both run), except under
``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``; a package
that re-exports lazily (``lazy_exports(__name__, X)``) counts as importing what ``X`` names.

Usage: ``python -m benchmarks.import_scan [--root overlap_runtime] [--json]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from tests.support.source_imports import (import_statements, import_targets, lazy_targets,
                                          module_name, resolve, within)

PACKAGE = "overlap_runtime"
# Mode names of the GDN (linear attention) context-parallel strategies that no other part of the
# package uses as a word: "p2p", "all_gather" and "ulysses" also name collectives and attention
# modes, so a literal of those says nothing about where GDN modes are spelled.
GDN_ONLY_MODE_NAMES = ("prefix_scan",)
GDN_MODE_NAMES = ("ulysses", "p2p", "all_gather", "prefix_scan")


class Package:
    """The parsed package: trees, import edges, external imports, function-level own imports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}
        self.paths: dict[str, Path] = {}
        is_pkg: dict[str, bool] = {}
        for path in sorted(root.rglob("*.py")):
            name = module_name(root, path)
            self.trees[name] = ast.parse(path.read_text(), str(path))
            self.paths[name] = path
            is_pkg[name] = path.name == "__init__.py"
        modules = set(self.trees)
        self.edges: dict[str, set[str]] = {m: set() for m in modules}
        self.external: dict[str, set[str]] = {m: set() for m in modules}
        self.function_level: list[tuple[str, int, str]] = []
        for mod, tree in self.trees.items():
            package = mod if is_pkg[mod] else mod.rpartition(".")[0]
            targets = [sub if sub.startswith(PACKAGE + ".") else f"{package}.{sub}"
                       for sub in lazy_targets(tree)]
            for node, in_function in import_statements(tree):
                found = import_targets(node, package, modules, PACKAGE)
                own = [t for t in found if t.split(".")[0] == PACKAGE]
                if in_function and own:
                    self.function_level.append((mod, node.lineno, ", ".join(sorted(set(own)))))
                targets += found
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    self.external[mod].add(target)
                    continue
                resolved = resolve(target, modules)
                if resolved is None:
                    raise SystemExit(f"{mod} imports {target}, which does not exist")
                # importing a.b.c runs a and a.b first
                parts = resolved.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep != mod and dep in modules:
                        self.edges[mod].add(dep)

    def reach(self, starts: list[str]) -> set[str]:
        seen = set(starts)
        todo = list(starts)
        while todo:
            for dep in self.edges[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    def imports_dist(self, mod: str) -> bool:
        return any(x == "torch.distributed" or x.startswith("torch.distributed.")
                   for x in self.external[mod])


def _string_files(pkg: Package, names: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {n: [] for n in names}
    for mod, tree in pkg.trees.items():
        found = {node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        for n in names:
            if n in found:
                out[n].append(str(pkg.paths[mod].relative_to(pkg.root.parent)))
    return out


def _autograd_functions(pkg: Package, package: str) -> list[str]:
    out = []
    for mod, tree in pkg.trees.items():
        if not within(mod, package):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Attribute) and b.attr == "Function")
                    or (isinstance(b, ast.Name) and b.id == "Function") for b in node.bases):
                out.append(f"{mod}.{node.name}")
    return sorted(out)


def scan(root: Path) -> dict[str, object]:
    """Every figure of the module docstring, as lists (the counts are their lengths)."""
    pkg = Package(root)
    stepgraph = [m for m in pkg.trees if within(m, f"{PACKAGE}.stepgraph")]
    reached = pkg.reach(stepgraph)
    floor = [m for m in pkg.trees if within(m, f"{PACKAGE}.config")]
    floor_reached = pkg.reach(floor) if floor else set()
    literals = _string_files(pkg, GDN_MODE_NAMES)
    gdn_files = sorted({f for n in GDN_ONLY_MODE_NAMES for f in literals[n]})
    return {
        "a_stepgraph_reaches_torch_distributed": sorted(m for m in reached
                                                        if pkg.imports_dist(m)),
        "b_stepgraph_reaches_trainer": sorted(m for m in reached
                                              if within(m, f"{PACKAGE}.trainer")),
        "c_function_level_own_imports": [f"{pkg.paths[m].relative_to(root.parent)}:{line} "
                                         f"({what})" for m, line, what in pkg.function_level],
        "d_files_spelling_a_gdn_only_mode_name": gdn_files,
        "d_files_per_gdn_mode_name (informational)": literals,
        "e_autograd_functions_in_context_parallel_gdn": _autograd_functions(
            pkg, f"{PACKAGE}.context_parallel.gdn"),
        "config_floor_reaches_torch_distributed": sorted(m for m in floor_reached
                                                         if pkg.imports_dist(m)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent.parent / PACKAGE
    parser.add_argument("--root", type=Path, default=here, help="the package directory")
    parser.add_argument("--json", action="store_true", help="print the lists as JSON")
    args = parser.parse_args(argv)
    result = scan(args.root.resolve())
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for name, files in value.items():
                print(f"  {name!r}: {len(files)} files")
            continue
        print(f"{key}: {len(value)}")
        for item in value:
            print(f"    {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
