"""BENCHMARKS.md's tables are what ``python -m benchmarks.report`` prints from the committed results files.

No figure of a table is copied by hand: every markdown table of the document sits inside a marked block, and each
block equals what the report prints from ``benchmarks/results`` (and ``research/`` for the training figures).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.report import BLOCK, blocks, update

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "BENCHMARKS.md"


@pytest.fixture(scope="module")
def printed() -> dict[str, str]:
    return blocks(ROOT / "benchmarks" / "results", ROOT / "research")


def test_every_block_of_the_document_is_what_the_report_prints(printed):
    in_doc = dict(BLOCK.findall(DOC.read_text()))
    assert in_doc, "BENCHMARKS.md has no report blocks"
    assert set(in_doc) == set(printed), "run `python -m benchmarks.report --update BENCHMARKS.md`"
    for name, text in in_doc.items():
        assert text == printed[name], f"block {name!r} differs: rerun the report with --update BENCHMARKS.md"


def test_every_table_sits_in_a_block():
    outside = BLOCK.sub("", DOC.read_text())
    tables = [line for line in outside.splitlines() if re.match(r"^\|.*\|\s*$", line)]
    assert not tables, f"tables outside a report block: {tables[:3]}"


def test_update_rewrites_a_stale_block(tmp_path, printed):
    name = next(iter(printed))
    stale = tmp_path / "doc.md"
    stale.write_text(f"# doc\n\n<!-- report: {name} -->\nold figures\n<!-- /report -->\n")
    assert update(stale, ROOT / "benchmarks" / "results", ROOT / "research") == [name]
    assert dict(BLOCK.findall(stale.read_text()))[name] == printed[name]


def test_document_is_short_and_leads_with_the_current_figures():
    text = DOC.read_text()
    assert len(text.splitlines()) <= 300
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## At a glance"
