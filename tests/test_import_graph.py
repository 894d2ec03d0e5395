"""Import layering, read from the source with ``ast`` (no module is imported).

- The import graph among ``overlap_runtime`` modules has no cycle (one test for cycles through
  ``schedules/`` or ``pipeline/``, one for any cycle). Every import counts (module level and inside functions: both run), except those
  under ``if TYPE_CHECKING:``; a package ``__init__`` that re-exports lazily
  (``lazy_exports(__name__, _EXPORTS)``) imports the submodules its ``_EXPORTS`` names.
- ``schedules/`` is pure: no module it reaches imports ``torch.distributed``, and it never
  reaches ``pipeline/`` (the runtime sits above it).
- Lower never imports higher: every import goes down (or sideways inside one layer) the layer
  map of docs/architecture.md, written out as :data:`LAYERS`.
- Every package ``__init__`` docstring says what the package may import.
- The configuration floor ``config/`` reaches no module that imports ``torch.distributed``;
  ``stepgraph/`` reaches none either, and no ``trainer`` module (it sits below the trainer).
- A function-level import of the package's own modules (the walk counts it, but a reader of the
  module's header does not see it) appears only where the module must not load an optional
  dependency when imported (:data:`FUNCTION_LEVEL`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

import overlap_runtime
from tests.support.source_imports import (import_statements, import_targets, is_type_checking,
                                          lazy_targets, module_name, resolve, within)

ROOT = Path(overlap_runtime.__file__).parent
PURE = "overlap_runtime.schedules"
RUNTIME = "overlap_runtime.pipeline"


def _parse_package() -> tuple[dict[str, ast.Module], dict[str, bool]]:
    return _parsed(ROOT)


@functools.lru_cache(maxsize=None)
def _parsed(root: Path) -> tuple[dict[str, ast.Module], dict[str, bool]]:
    """Every module's tree under ``root``, parsed once per test session (the trees are only
    read; the checker's own test points ``ROOT`` at a tiny package, a key of its own)."""
    trees, is_pkg = {}, {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(root, path)
        trees[name] = ast.parse(path.read_text(), str(path))
        is_pkg[name] = path.name == "__init__.py"
    return trees, is_pkg


def import_graph() -> tuple[nx.DiGraph, dict[str, set[str]]]:
    """Edges between ``overlap_runtime`` modules, and every module's external imports (built
    once per ``ROOT``; the tests only read them)."""
    return _import_graph_of(ROOT)


@functools.lru_cache(maxsize=None)
def _import_graph_of(root: Path) -> tuple[nx.DiGraph, dict[str, set[str]]]:
    trees, is_pkg = _parsed(root)
    modules = set(trees)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    external: dict[str, set[str]] = {m: set() for m in modules}
    for mod, tree in trees.items():
        package = mod if is_pkg[mod] else mod.rpartition(".")[0]
        targets: list[str] = [sub if sub.startswith("overlap_runtime.") else f"{package}.{sub}"
                                for sub in lazy_targets(tree)]
        for node, _ in import_statements(tree):
            targets += import_targets(node, package, modules, "overlap_runtime")
        for target in targets:
            if target.split(".")[0] == "overlap_runtime":
                resolved = resolve(target, modules)
                assert resolved is not None, f"{mod} imports {target}, which does not exist"
                if resolved != mod:
                    graph.add_edge(mod, resolved)
            else:
                external[mod].add(target)
    return graph, external


def _cycles(graph: nx.DiGraph) -> list[set[str]]:
    return [c for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_no_import_cycle_through_schedules_or_pipeline() -> None:
    ours = [c for c in _cycles(import_graph()[0])
            if any(within(m, PURE) or within(m, RUNTIME) for m in c)]
    assert not ours, f"import cycles: {[sorted(c) for c in ours]}"


def test_no_import_cycle_anywhere() -> None:
    """No cycle among ``overlap_runtime`` modules at all (imports inside one module aside): the
    layers import one way, and so do the modules of a package (graph/: tasks <- validate <-
    simulate <- task_graph)."""
    cycles = [sorted(c) for c in _cycles(import_graph()[0])]
    assert not cycles, f"import cycles: {cycles}"


# The layer map of docs/architecture.md, lowest first. A module may import its own layer and the
# layers below, never one above (a module in none of these fails the test: place it).
LAYERS: list[tuple[str, ...]] = [
    ("overlap_runtime", "overlap_runtime._lazy", "overlap_runtime.platform",
     "overlap_runtime.rank_start", "overlap_runtime.launch", "overlap_runtime.testing"),
    ("overlap_runtime.ops",),
    ("overlap_runtime.graph",),
    ("overlap_runtime.schedules",),
    ("overlap_runtime.pipeline",),
    ("overlap_runtime.coordinator",),
    ("overlap_runtime.layers",),
    ("overlap_runtime.config",),
    ("overlap_runtime.moe",),
    ("overlap_runtime.context_parallel",),
    ("overlap_runtime.models",),
    ("overlap_runtime.trainer", "overlap_runtime.stepgraph"),
    ("overlap_runtime.cli", "overlap_runtime.demo", "overlap_runtime.info",
     "overlap_runtime.failure"),
]


def layer_of(mod: str) -> int:
    """Index in :data:`LAYERS` of the longest entry ``mod`` is in (the root only as itself)."""
    best, best_len = -1, -1
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            hit = mod == entry if entry == "overlap_runtime" else within(mod, entry)
            if hit and len(entry) > best_len:
                best, best_len = i, len(entry)
    assert best >= 0, f"{mod} is in no layer of LAYERS: add it where docs/architecture.md puts it"
    return best


def upward_imports(graph: nx.DiGraph) -> list[str]:
    return sorted(f"{u} (layer {layer_of(u)}) imports {v} (layer {layer_of(v)})"
                  for u, v in graph.edges if layer_of(u) < layer_of(v))


def test_lower_never_imports_higher() -> None:
    graph = import_graph()[0]
    assert not upward_imports(graph), upward_imports(graph)
    # the walk sees the edges that the map allows
    assert graph.has_edge("overlap_runtime.moe.parallel", "overlap_runtime.coordinator")
    assert upward_imports(nx.DiGraph([("overlap_runtime.layers.mlp", "overlap_runtime.moe")]))


def test_every_package_says_what_it_is_for_and_may_import() -> None:
    """Every package ``__init__`` has a docstring naming what it may import; the root's names
    every subpackage and public module."""
    trees, is_pkg = _parse_package()
    exempt = {"overlap_runtime.ops.gdn.triton"}  # its parent ops.gdn's docstring covers it
    missing = []
    for mod, tree in trees.items():
        if not is_pkg[mod] or mod == "overlap_runtime" or mod in exempt:
            continue
        doc = ast.get_docstring(tree) or ""
        if "May import" not in doc and "imports only" not in doc:
            missing.append(mod)
    assert not missing, f"package docstrings without 'May import': {missing}"
    root = ast.get_docstring(trees["overlap_runtime"]) or ""
    children = {m.split(".")[1] for m in trees if m.count(".") >= 1}
    unnamed = sorted(c for c in children if not c.startswith("_") and f"``{c}``" not in root)
    assert not unnamed, f"overlap_runtime/__init__.py's docstring does not name {unnamed}"


def test_schedules_reach_no_torch_distributed_and_not_the_runtime() -> None:
    graph, external = import_graph()
    start = [m for m in graph if within(m, PURE)]
    reached = set(start).union(*(nx.descendants(graph, m) for m in start))
    assert not [m for m in reached if within(m, RUNTIME)], sorted(m for m in reached
                                                               if within(m, RUNTIME))
    offenders = {m: sorted(x for x in external[m]
                           if x == "torch.distributed" or x.startswith("torch.distributed."))
                 for m in reached}
    assert not {m: x for m, x in offenders.items() if x}, offenders
    assert "overlap_runtime.graph.task_graph" in reached  # the walk does follow imports


def _reach(package: str) -> tuple[set[str], dict[str, set[str]]]:
    """Every module the modules of ``package`` reach (themselves included), importing a module
    counting as importing its parent packages too (Python runs them first)."""
    graph, external = import_graph()
    graph = graph.copy()
    for mod in list(graph):
        for i in range(1, mod.count(".") + 1):
            parent = mod.rsplit(".", i)[0]
            if parent in graph and parent != "overlap_runtime":
                for u in list(graph.predecessors(mod)):
                    if u != parent:
                        graph.add_edge(u, parent)
    start = [m for m in graph if within(m, package)]
    return set(start).union(*(nx.descendants(graph, m) for m in start)), external


def _distributed(reached: set[str], external: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in reached if any(
        x == "torch.distributed" or x.startswith("torch.distributed.") for x in external[m]))


def test_config_floor_reaches_no_torch_distributed() -> None:
    reached, external = _reach("overlap_runtime.config")
    assert "overlap_runtime.config.train" in reached  # the floor is there and walked
    assert not _distributed(reached, external), _distributed(reached, external)
    higher = sorted(m for m in reached if layer_of(m) > layer_of("overlap_runtime.config"))
    assert not higher, higher


def test_stepgraph_reaches_no_trainer_and_no_torch_distributed() -> None:
    reached, external = _reach("overlap_runtime.stepgraph")
    assert "overlap_runtime.config.train" in reached  # it reads the configuration floor
    assert not _distributed(reached, external), _distributed(reached, external)
    trainer = sorted(m for m in reached if within(m, "overlap_runtime.trainer"))
    assert not trainer, trainer


def test_the_reach_sees_parent_packages_and_function_level_imports() -> None:
    """A module reached through a function-level import, or a parent package run by an import
    of its submodule, counts (the walk on the real package: the trainer's loop reaches
    ``torch.distributed``; ``ops.comm``'s package runs when a submodule is imported)."""
    reached, external = _reach("overlap_runtime.trainer.loop")
    assert _distributed(reached, external)
    assert "overlap_runtime.ops.comm" in reached


# module -> why it imports some of the package's own modules inside functions (each import there
# loads an optional dependency, or a seam a test removes); anything else imports at module level
FUNCTION_LEVEL: dict[str, str] = {
    "overlap_runtime.ops.gdn.backend": "the Triton GDN kernels (triton)",
    "overlap_runtime.ops.causal_conv.function": "the Triton conv kernels (triton)",
    "overlap_runtime.context_parallel.gdn.common": "the Triton capability check (triton)",
    "overlap_runtime.context_parallel.gdn.halo": "the Triton halo conv (triton)",
    "overlap_runtime.context_parallel.gdn.state_passing": "the Triton GDN forward (triton)",
    "overlap_runtime.models.mlp": "the MoE package, refused by name when it cannot load",
    "overlap_runtime.context_parallel.gdn.task_graph": "a hand-written graph builder that is "
                                                       "being removed",
}
FUNCTION_LEVEL_BUDGET = 20


def function_level_imports(root: Path | None = None) -> list[tuple[str, int]]:
    """``(module, line)`` of every import of an ``overlap_runtime`` module inside a function
    (outside ``if TYPE_CHECKING:``)."""
    trees, is_pkg = _parsed(root or ROOT)
    out: list[tuple[str, int]] = []
    for mod, tree in trees.items():
        for node, in_function in import_statements(tree):
            if not in_function:
                continue
            if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").split(".")[0] == "overlap_runtime"):
                out.append((mod, node.lineno))
            if isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "overlap_runtime" for a in node.names):
                out.append((mod, node.lineno))
    return sorted(out)


def test_function_level_imports_only_for_optional_dependencies() -> None:
    found = function_level_imports()
    unexplained = [f"{m}:{line}" for m, line in found if m not in FUNCTION_LEVEL]
    assert not unexplained, (f"imports inside functions of modules that may import at module "
                             f"level (hoist them, or say why in FUNCTION_LEVEL): {unexplained}")
    assert len(found) <= FUNCTION_LEVEL_BUDGET, found
    assert ("overlap_runtime.ops.gdn.backend" in {m for m, _ in found})  # the walk sees them


# Loading these runs code chosen by whoever wrote the bytes; the pipeline runtime reads bytes
# from peer ranks (gathered traces, tensor headers), so it uses checked JSON and tensors only.
CODE_LOADING = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}


def test_pipeline_imports_no_pickle() -> None:
    _, external = import_graph()
    found = {m: sorted(x for x in ext if x.split(".")[0] in CODE_LOADING)
             for m, ext in external.items() if within(m, RUNTIME)}
    assert not {m: x for m, x in found.items() if x}, found
    assert "torch" in external["overlap_runtime.pipeline.exec_trace"]  # the walk sees imports


@pytest.mark.parametrize("source, cyclic, reaches_dist", [
    ("from . import b\n", True, False),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n", False, False),
    ("def f():\n    from .b import x\n", True, False),
    ("def f():\n    import torch.distributed as dist\n", False, True),
])
def test_the_checker_sees_what_it_must(tmp_path, monkeypatch, source, cyclic, reaches_dist
                                       ) -> None:  # type: ignore[no-untyped-def]
    """The walk on a tiny package: a function-level import counts, a TYPE_CHECKING one not."""
    pkg = tmp_path / "overlap_runtime"
    (pkg / "schedules").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "schedules" / "__init__.py").write_text("")
    (pkg / "schedules" / "a.py").write_text(source)
    (pkg / "schedules" / "b.py").write_text("from .a import y\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph, external = import_graph()
    assert bool(_cycles(graph)) is cyclic
    assert ("torch.distributed" in external["overlap_runtime.schedules.a"]) is reaches_dist
    in_function = source.startswith("def f():\n    from .")
    assert bool(function_level_imports(pkg)) is in_function
