"""research/ holds the studies behind the product's choices, apart from the package.

Each study is one folder whose README says its question, command, result and conclusion; the index lists every
study; no script lives there (a study reproduces with the public ``train`` and ``evaluation`` command lines);
and nothing of it is packaged.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESEARCH = ROOT / "research"
STUDIES = sorted(p for p in RESEARCH.iterdir() if p.is_dir())


def test_every_study_is_in_the_index():
    index = (RESEARCH / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+)/\)", index))
    assert linked == {p.name for p in STUDIES}


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_study_says_question_command_result_conclusion(study):
    text = (study / "README.md").read_text()
    for part in ("**Question.**", "**Command.**", "**Result.**", "**Conclusion.**"):
        assert part in text, f"{study.name}/README.md lacks {part}"


def test_no_scripts_in_research_or_train_results():
    assert not list(RESEARCH.rglob("*.py"))
    assert not (ROOT / "train" / "results").exists()


def test_research_is_not_packaged():
    setuptools = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools]", 1)[1].split("\n[tool.pytest", 1)[0]
    assert "packages = [" in setuptools
    assert "research" not in setuptools
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert "prune research" in manifest
