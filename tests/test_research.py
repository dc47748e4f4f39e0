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
if not RESEARCH.is_dir():  # an sdist holds the tests but, by design, not the studies
    pytest.skip("research/ lives in the repository only", allow_module_level=True)
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
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})

    def folder(package: str) -> str:  # as setuptools maps it: the longest listed parent, then the rest as folders
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            if ".".join(parts[:cut]) in package_dir:
                return "/".join([package_dir[".".join(parts[:cut])], *parts[cut:]])
        return "/".join(parts)

    # Every package is a folder outside research/ (kvzap.train is train/, which holds no results folder) ...
    for name in setuptools["packages"]:
        folder_ = folder(name)
        assert (ROOT / folder_ / "__init__.py").is_file(), name
        assert not folder_.startswith(("research", "train/results")), name
    # ... and the package data stays inside the package.
    for name, patterns in setuptools["package-data"].items():
        for pattern in patterns:
            assert ".." not in pattern and "research" not in pattern and "results" not in pattern, (name, pattern)
    # The sdist (MANIFEST.in) leaves out the studies and the recorded results.
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert {"prune research", "prune benchmarks", "prune evaluation/results"} <= set(manifest)
