"""Library code states rules, not where they came from.

Every ``.py`` file under ``overlap_runtime/`` (code, comments, docstrings, messages) is read as
text and must not cite:

* an issue or pull-request number (``issue #23``, ``issue 11584``, ``(#23)``): the reader cannot
  open it from the code, and the rule it stood for is what the code needs;
* the seed documents or their requirement ids (``seed 001 section 2.2``, ``OV-B06``): they are
  not in the repository;
* a ``*.md`` file that is not in the repository (``README.md`` and ``docs/*.md`` are).

docs/ may cite sources; the library says the rule itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "overlap_runtime"

#: kind of citation -> the pattern that finds it (case-insensitive)
CITATIONS: dict[str, re.Pattern[str]] = {
    "an issue number": re.compile(
        r"\b(?:issue|pull request|PR)\s*#?\d+\b|\bissues\s*#\d+|(?<![\w&])#\d{1,5}\b", re.IGNORECASE),
    "a seed document": re.compile(r"\bseed\s+(?:0\d\d\b|doc)", re.IGNORECASE),
    "a requirement id of the seed documents": re.compile(r"\bOV-[A-Z]\d{2}\b"),
}
MARKDOWN = re.compile(r"[\w./-]*\w\.md\b")


def citations(text: str, root: Path = ROOT) -> list[tuple[int, str, str]]:
    """``(line, kind, cited text)`` of every citation in ``text``; a ``*.md`` name counts unless
    it is a file of ``root`` (as written, or under ``docs/``)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for kind, pattern in CITATIONS.items():
            found += [(lineno, kind, m.group(0)) for m in pattern.finditer(line)]
        for m in MARKDOWN.finditer(line):
            name = m.group(0)
            if not ((root / name).is_file() or (root / "docs" / name).is_file()):
                found.append((lineno, "a document not in the repository", name))
    return found


def test_library_code_cites_no_issue_and_no_outside_document() -> None:
    problems = [f"{path.relative_to(ROOT)}:{line}: cites {kind} ({cited!r}); state the rule"
                for path in sorted(LIBRARY.rglob("*.py"))
                for line, kind, cited in citations(path.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, kind", [
    ("# passed only when set (issue #22)", "an issue number"),
    ("# triton-lang/triton issue 11584", "an issue number"),
    ('"""Packed documents (#23)."""', "an issue number"),
    ("# see PR 104", "an issue number"),
    ("(seed 001 section 2.2)", "a seed document"),
    ("# see the seed document", "a seed document"),
    ("the serial baseline of OV-D02", "a requirement id of the seed documents"),
    ("a second scan (GDN_CP_NOTES.md)", "a document not in the repository"),
    ("the pattern of gpu/README.md", "a document not in the repository"),
])
def test_each_kind_of_citation_is_found(text: str, kind: str) -> None:
    assert [k for _, k, _ in citations(text)] == [kind]


@pytest.mark.parametrize("text", [
    'colors = {"F": "#4c72b0", "B": "#999999"}',
    "seed = torch.zeros((), dtype=torch.long)  # dropout 0: never read",
    "epoch e:  order_e = a permutation drawn from seed (seed, e)",
    "a call issues 2 all-to-alls forward and 2 backward",
    "(Narayanan et al. 2021, section 2.2)",
    "See docs/training.md and README.md; docs/ architecture.md has the map",
])
def test_rules_and_repository_documents_pass(text: str) -> None:
    assert citations(text) == []
