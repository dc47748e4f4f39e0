"""The repository's Markdown documents are well-formed: every table row has its header's cells, every relative
link leads to a file or folder of the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SKIP = {"outputs", "build", "dist", "node_modules", "site-packages"}


def _ours(path: Path) -> bool:
    """A document of the repository: not under a hidden folder (virtual environments such as CI's `.venv-ci-*`,
    `.git`), an output or build folder, or an installed package."""
    parts = path.relative_to(ROOT).parts[:-1]
    return not any(part.startswith(".") or part in _SKIP or part.endswith(".egg-info") for part in parts)


DOCS = sorted(p for p in ROOT.rglob("*.md") if _ours(p))
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _cells(line: str) -> int:
    """Cells of a table row: ``|`` separators outside code spans, escaped ``\\|`` not counted."""
    text = re.sub(r"`[^`]*`", "", line.strip()).replace("\\|", "")
    return len(text.strip("|").split("|"))


def _tables(text: str):
    """Yield ``(first line number, rows)`` for each table: a run of lines starting with ``|``."""
    rows, first = [], 0
    for n, line in enumerate(text.splitlines() + [""], start=1):
        if line.lstrip().startswith("|"):
            if not rows:
                first = n
            rows.append(line)
        elif rows:
            yield first, rows
            rows = []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_table_rows_have_the_header_cells(doc):
    bad = []
    for first, rows in _tables(doc.read_text()):
        width = _cells(rows[0])
        bad += [
            f"line {first + i}: {_cells(row)} cells, header {width}"
            for i, row in enumerate(rows)
            if _cells(row) != width
        ]
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        path = target.split("#")[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_the_documents_are_found():
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert {"README.md", "BENCHMARKS.md", "evaluation/README.md", "train/README.md"} <= names
