"""BENCHMARKS.md's tables are what ``python -m benchmarks.report`` prints from the committed results files.

No figure of a table is copied by hand: every markdown table of the document sits inside a marked block, and each
block equals what the report prints from ``benchmarks/results`` (and ``research/`` for the training figures).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.report import BLOCK, BLOCKS, blocks, main, update

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
# The anchors README.md links to: renaming one of these headings breaks the README's Results table.
README_ANCHORS = (
    "kv-memory-measured-from-outside",
    "decoding-speed",
    "time-to-first-token-and-prefill",
    "ragged-batches",
    "gemma-3-270m-second-model",
    "side-by-side-with-the-alternatives",
)


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


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


def test_the_anchors_that_links_point_at_exist():
    text = DOC.read_text()
    anchors = _anchors(text)
    assert set(README_ANCHORS) <= anchors
    linked = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert linked <= anchors, f"links to missing headings: {sorted(linked - anchors)}"
    for target in re.findall(r"BENCHMARKS\.md#([\w-]+)", (ROOT / "README.md").read_text()):
        assert target in anchors, f"README.md links to BENCHMARKS.md#{target}, which no heading makes"


def test_every_results_file_is_a_raw_file_of_the_document_and_named_by_what_it_measures():
    text = DOC.read_text()
    linked = set(re.findall(r"\]\(benchmarks/results/([\w.-]+)\)", text))
    assert all((RESULTS / name).is_file() for name in linked), sorted(n for n in linked if not (RESULTS / n).is_file())
    committed = {p.name for p in RESULTS.iterdir() if p.is_file()}
    assert committed <= linked, f"results files no table reads: {sorted(committed - linked)}"
    assert not [name for name in committed if "session" in name.lower()]


def test_the_report_prints_one_table_by_name(capsys, printed):
    main(["--results", str(RESULTS), "--table", "decode"])
    assert capsys.readouterr().out == f"<!-- report: decode -->\n{printed['decode']}\n<!-- /report -->\n"
    main(["--list"])
    assert capsys.readouterr().out.split() == list(BLOCKS)
    with pytest.raises(SystemExit):
        main(["--table", "no-such-table"])
    with pytest.raises(ValueError, match="No table named"):
        blocks(RESULTS, names=["no-such-table"])
