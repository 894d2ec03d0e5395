"""Every ```python block of README.md and docs/*.md is a complete program or a pointer to one.

The rule, per block:

* **pointer**: a line ``# complete program: examples/<name>.py`` naming an existing example (which
  tests/test_examples.py runs on its ranks); the block may keep a few lines of the example's
  API for reading (at most ``POINTER_MAX_LINES``), it must parse, and every name it imports from
  ``overlap_runtime`` must occur in that example, so the pointer leads to the code it shows.
* **complete program**: it compiles and a static check (``symtable``) finds no undefined name:
  every name read anywhere in it is a builtin or bound at module level (import, assignment,
  ``def``, ``class``, loop or ``with`` target). A complete block that starts no ranks (no
  ``overlap_runtime.launch``) is also executed here, in a fresh namespace (cheap single-process
  snippets); one that joins a process group is checked statically only.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import re
import symtable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
POINTER = re.compile(r"^#\s*complete program:\s*(examples/[\w.]+\.py)\b", re.MULTILINE)
POINTER_MAX_LINES = 18
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    source: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(path, text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in FENCE.finditer(text)]


ALL_BLOCKS = [b for doc in DOCS for b in python_blocks(doc)]


def undefined_names(source: str, filename: str = "<block>") -> set[str]:
    """Names read in ``source`` that are neither builtins nor bound at its module level."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins))
    missing: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced() or sym.get_name() in known:
                continue
            at_module = table is top and not (sym.is_assigned() or sym.is_imported())
            if at_module or (table is not top and sym.is_global()):
                missing.add(sym.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return missing


def overlap_runtime_imports(tree: ast.AST) -> set[str]:
    """Names a block imports from ``overlap_runtime`` (``from overlap_runtime.x import a, b``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("overlap_runtime"):
            names |= {a.asname or a.name for a in node.names}
    return names


def block_problems(block: Block) -> list[str]:
    """Why ``block`` breaks the rule (empty when it follows it)."""
    try:
        tree = ast.parse(block.source, block.where)
    except SyntaxError as exc:
        return [f"does not parse as Python ({exc.msg}, block line {exc.lineno})"]
    pointer = POINTER.search(block.source)
    if pointer:
        example = ROOT / pointer.group(1)
        if not example.is_file():
            return [f"points to {pointer.group(1)}, which does not exist"]
        problems = []
        lines = len(block.source.strip().splitlines())
        if lines > POINTER_MAX_LINES:
            problems.append(f"is a pointer of {lines} lines (at most {POINTER_MAX_LINES}: the "
                            f"complete version lives in {pointer.group(1)})")
        body = set(re.findall(r"\w+", example.read_text()))
        absent = sorted(overlap_runtime_imports(tree) - body)
        if absent:
            problems.append(f"imports {absent}, which {pointer.group(1)} does not use")
        return problems
    undefined = undefined_names(block.source, block.where)
    if undefined:
        return [f"uses undefined names {sorted(undefined)}: make it a complete program or a "
                f"pointer ('# complete program: examples/<name>.py')"]
    return []


def starts_ranks(block: Block) -> bool:
    return "overlap_runtime.launch" in block.source


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.where for b in ALL_BLOCKS])
def test_block_is_a_complete_program_or_a_pointer(block: Block) -> None:
    problems = block_problems(block)
    assert not problems, f"{block.where}: " + "; ".join(problems) + f"\n{block.source}"


RUNNABLE = [b for b in ALL_BLOCKS if not POINTER.search(b.source) and not starts_ranks(b)]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_single_process_block_runs(block: Block) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.source, block.where, "exec"),  # noqa: S102 - the docs' own code
             {"__name__": "__doc_block__"})


def test_the_docs_have_python_blocks_of_both_kinds() -> None:
    assert len(ALL_BLOCKS) >= 10, [b.where for b in ALL_BLOCKS]
    assert any(POINTER.search(b.source) for b in ALL_BLOCKS)
    assert RUNNABLE


FRAGMENT = '''\
from overlap_runtime.pipeline import PipelineStage, ScheduleInterleaved1F1B

stages = [PipelineStage(chunks[s], s, num_stages) for s in my_stages]
schedule = ScheduleInterleaved1F1B(stages, num_microbatches=8, loss_fn=loss_fn)
out = schedule.step(x, target=y)
'''


def test_the_checker_rejects_fragments_and_bad_pointers() -> None:
    here = ROOT / "docs" / "x.md"
    assert undefined_names(FRAGMENT) == {"chunks", "num_stages", "my_stages", "loss_fn", "x", "y"}
    assert "undefined names" in block_problems(Block(here, 1, FRAGMENT))[0]
    # names read inside a function count too; names bound anywhere at module level do not
    assert undefined_names("def f():\n    return a + b\nb = 1\n") == {"a"}
    assert undefined_names("import torch\nfor i in range(2):\n    print(torch, i)\n") == set()
    assert "does not parse" in block_problems(Block(here, 1, "f, b = forward and backward x\n"))[0]
    missing = block_problems(Block(here, 1, "# complete program: examples/nope.py\n" + FRAGMENT))
    assert "does not exist" in missing[0]
    elsewhere = "# complete program: examples/gdn_context_parallel.py\n" + FRAGMENT
    assert "does not use" in block_problems(Block(here, 1, elsewhere))[0]
    good = "# complete program: examples/pipeline_interleaved_overlap.py\n" + FRAGMENT
    assert block_problems(Block(here, 1, good)) == []
