"""docs/accuracy.md's tables are what ``python -m evaluation.tables`` prints from the committed run directories."""

from pathlib import Path

import pytest

from evaluation import tables

DOC = Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"


@pytest.fixture(scope="module")
def marked() -> dict[str, str]:
    return tables.marked_tables(DOC.read_text(encoding="utf-8"))


def test_every_table_is_marked_in_the_doc(marked):
    assert sorted(marked) == sorted(tables.TABLES)


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_marked_table_equals_what_the_script_prints(marked, name):
    assert marked[name] == tables.render(name), f"rerun `python -m evaluation.tables --write {DOC.name}`"


def test_check_reports_a_stale_table(tmp_path, capsys):
    name = "gemma-4k-pairs"
    stale = tmp_path / "accuracy.md"
    stale.write_text(f"# t\n\n<!-- table: {name} -->\n| old |\n<!-- /table -->\n", encoding="utf-8")
    assert tables.main(["--check", str(stale)]) == 1
    assert name in capsys.readouterr().err
    assert tables.main(["--write", str(stale)]) == 0
    assert tables.main(["--check", str(stale)]) == 0
    assert tables.marked_tables(stale.read_text(encoding="utf-8"))[name] == tables.render(name)


def test_unknown_table_is_refused():
    with pytest.raises(SystemExit):
        tables.main(["no-such-table"])
