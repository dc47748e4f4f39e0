"""Build a reproducible offline training corpus from text already on this machine.

Without network access the Nemotron sample cannot be downloaded, so ``python -m train build-corpus`` gathers
prose, reference and code that ships with the operating system and Python:

========================  ===============================================================  ==================
subset                    files                                                            source (split unit)
========================  ===============================================================  ==================
``python-stdlib``         ``*.py`` of the standard library                                 top-level module
``python-package-docs``   long descriptions (``METADATA``) of installed Python packages    distribution
``man-pages``             ``/usr/share/man/man*/*`` (troff markup stripped)                page-name prefix
``debian-docs``           README / NEWS / changelog / ``*.md`` / ``*.txt`` in /usr/share/doc  Debian package
``rst-docs``              ``*.rst`` help pages (e.g. CMake's)                              folder
========================  ===============================================================  ==================

Held-out data is split by **source**, never by chunk: all documents of a test source (a whole Python module,
Debian package, ...) are in the test split, so held-out scores measure generalisation to unseen text rather
than to other pieces of a text seen in training. Short files of one source are packed together; each source
contributes at most ``max_per_source`` documents (``gcloud`` alone has 16k man pages). Given the same files
and seed, the output is byte-identical.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
import re
import sys
import sysconfig
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["CorpusFile", "build_corpus", "default_roots", "split_sources", "strip_troff"]


@dataclass(frozen=True)
class CorpusFile:
    """A file found by a scanner, before packing."""

    path: Path
    subset: str
    source: str
    reader: Callable[[Path], str]


# ---------------------------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


_TROFF_FONT = re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)")  # \fB, \f(CW, \f[B]
_TROFF_ESCAPES = {r"\-": "-", r"\(em": "--", r"\(en": "-", r"\(bu": "*", r"\e": "\\", r"\&": "", r"\ ": " ", r"\|": ""}


def strip_troff(source: str) -> str:
    """Turn man-page troff into plain text (good enough for language-model input, not for display).

    Parameters
    ----------
    source : str
        troff/man source.

    Returns
    -------
    str
        Text with comments and formatting requests removed and section titles kept.
    """
    lines = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            request, _, rest = line[1:].partition(" ")
            if request in {"SH", "SS"}:
                lines.append("\n" + rest.strip('"'))
            elif request in {"B", "I", "BI", "IB", "BR", "RB", "IR", "RI", "TP", "IP", "TH", "Nm", "Nd", "Sh"}:
                if rest:
                    lines.append(rest.replace('"', ""))
            elif request in {"PP", "P", "LP", "sp", "br"}:
                lines.append("")
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = _TROFF_FONT.sub("", text)
    for escape, replacement in _TROFF_ESCAPES.items():
        text = text.replace(escape, replacement)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _read_man(path: Path) -> str:
    return strip_troff(_read_text(path))


def _read_metadata(path: Path) -> str:
    """Long description of a package: the body of its METADATA file, after the e-mail style headers."""
    text = _read_text(path)
    _, _, body = text.partition("\n\n")
    return body.strip()


# ---------------------------------------------------------------------------------------------------------------
# Scanners: one per subset, each yields the files of that subset with their source
# ---------------------------------------------------------------------------------------------------------------


def _scan_stdlib(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in {"site-packages", "dist-packages"} or "__pycache__" in rel.parts:
            continue
        source = rel.parts[0].removesuffix(".py")
        yield CorpusFile(path, "python-stdlib", source, _read_text)


def _scan_package_docs(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("*.dist-info/METADATA")):
        source = path.parent.name.split("-")[0].lower()
        yield CorpusFile(path, "python-package-docs", source, _read_metadata)


def _scan_man(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("man*/*")):
        if not path.is_file():
            continue
        # "git-commit.1.gz" -> "git", "Algorithm::Diff.3pm.gz" -> "Algorithm": pages of one tool share a source.
        source = re.split(r"[-_.:]", path.name, maxsplit=1)[0].lower()
        yield CorpusFile(path, "man-pages", source, _read_man)


_DEBIAN_DOC = re.compile(r"^(README|NEWS|TODO|changelog|FAQ|HISTORY|CHANGES)|\.(md|txt)(\.gz)?$", re.IGNORECASE)


def _scan_debian_docs(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("*/**/*")):
        rel = path.relative_to(root)
        if not path.is_file() or path.is_symlink() or "copyright" in path.name.lower():
            continue  # license texts are identical across packages: they would leak between splits
        if _DEBIAN_DOC.search(path.name):
            yield CorpusFile(path, "debian-docs", rel.parts[0], _read_text)


def _scan_rst(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.rglob("*.rst")):
        rel = path.relative_to(root)
        source = f"{root.name}/{rel.parts[0]}" if len(rel.parts) > 1 else root.name
        yield CorpusFile(path, "rst-docs", source, _read_text)


_SCANNERS: dict[str, Callable[[Path], Iterable[CorpusFile]]] = {
    "python-stdlib": _scan_stdlib,
    "python-package-docs": _scan_package_docs,
    "man-pages": _scan_man,
    "debian-docs": _scan_debian_docs,
    "rst-docs": _scan_rst,
}


def default_roots() -> dict[str, list[Path]]:
    """Where each subset is looked for on this machine (missing folders are skipped).

    Returns
    -------
    dict
        Subset name -> folders to scan.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    cmake_help = sorted(Path("/usr/share").glob("cmake-*/Help"))
    roots = {
        "python-stdlib": [stdlib],
        "python-package-docs": [purelib],
        "man-pages": [Path("/usr/share/man")],
        "debian-docs": [Path("/usr/share/doc")],
        "rst-docs": cmake_help,
    }
    return {subset: [p for p in paths if p.is_dir()] for subset, paths in roots.items()}


# ---------------------------------------------------------------------------------------------------------------
# Packing, capping and splitting
# ---------------------------------------------------------------------------------------------------------------


def _pack(texts: list[tuple[str, str]], min_chars: int, max_chars: int) -> list[tuple[str, str]]:
    """Join consecutive short texts of one source until each document has ``min_chars``; cut long ones.

    ``texts`` holds ``(path, text)`` pairs in a fixed order; the result holds ``(paths, document)`` pairs.
    """
    documents, buffer, paths = [], [], []
    for path, text in texts:
        text = text[:max_chars]
        buffer.append(text)
        paths.append(path)
        if sum(len(t) for t in buffer) >= min_chars:
            documents.append((";".join(paths), "\n\n".join(buffer)[:max_chars]))
            buffer, paths = [], []
    return documents  # a short remainder is dropped: it could not make a prompt of min_tokens anyway


def split_sources(doc_counts: dict[str, int], test_fraction: float, rng: random.Random) -> set[str]:
    """Pick whole sources for the test split until they hold ``test_fraction`` of the documents.

    Parameters
    ----------
    doc_counts : dict
        Source -> number of documents.
    test_fraction : float
        Target share of documents in the test split.
    rng : random.Random
        Shuffles the sources.

    Returns
    -------
    set of str
        Test sources: at least one, and never all, when there are two sources or more.
    """
    sources = sorted(doc_counts)
    if len(sources) < 2 or test_fraction <= 0:
        return set()
    rng.shuffle(sources)
    total = sum(doc_counts.values())
    test, held = set(), 0
    for source in sources[:-1]:  # always leave one source for training
        if held >= test_fraction * total:
            break
        test.add(source)
        held += doc_counts[source]
    return test


def build_corpus(
    out_dir: str | Path,
    *,
    seed: int = 0,
    test_fraction: float = 0.1,
    min_chars: int = 4000,
    max_chars: int = 24000,
    max_per_source: int = 20,
    max_per_subset: int = 2000,
    roots: dict[str, list[Path]] | None = None,
) -> dict:
    """Scan local text, pack it into documents, split by source and write ``corpus.jsonl`` + ``info.json``.

    Parameters
    ----------
    out_dir : str or Path
        Output folder.
    seed : int, default 0
        Seed of the per-source sampling and of the source split.
    test_fraction : float, default 0.1
        Target share of each subset's documents held out (whole sources).
    min_chars, max_chars : int
        Document length bounds in characters (about 4 characters per token for prose, fewer for code).
    max_per_source, max_per_subset : int
        Caps that keep one large source or subset from dominating.
    roots : dict, optional
        Subset -> folders to scan; defaults to :func:`default_roots`.

    Returns
    -------
    dict
        Summary (also written to ``info.json``): documents per subset and split, test sources, sha256.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}.")
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"Need 0 < min_chars <= max_chars, got {min_chars} and {max_chars}.")
    from tqdm.auto import tqdm

    roots = default_roots() if roots is None else roots
    unknown = set(roots) - set(_SCANNERS)
    if unknown:
        raise ValueError(f"Unknown corpus subsets {sorted(unknown)}; known: {sorted(_SCANNERS)}.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    records, summary, seen = [], {"seed": seed, "subsets": {}, "python": sys.version.split()[0]}, set()
    for subset in sorted(roots):
        files: dict[str, list[CorpusFile]] = defaultdict(list)
        for root in roots[subset]:
            for item in _SCANNERS[subset](Path(root)):
                files[item.source].append(item)
        rng = random.Random(f"{seed}:{subset}")
        documents: dict[str, list[tuple[str, str]]] = {}
        for source in tqdm(sorted(files), desc=f"corpus {subset}", unit="source", disable=None):
            items = list(files[source])
            rng.shuffle(items)  # a random sample of the source's files, not its alphabetical head
            texts = []
            for item in items:
                try:
                    text = item.reader(item.path)
                except (OSError, EOFError, ValueError) as error:
                    logger.debug("Skipping %s: %s", item.path, error)
                    continue
                digest = hashlib.sha256(text.encode()).hexdigest()
                if digest in seen or not text.strip():
                    continue  # exact duplicates (e.g. the same README in two packages) would leak across splits
                seen.add(digest)
                texts.append((str(item.path), text))
                if sum(len(t) for _, t in texts) >= max_per_source * max_chars:
                    break
            packed = _pack(texts, min_chars, max_chars)[:max_per_source]
            if packed:
                documents[source] = packed
        # Cap the subset by keeping a seeded sample of sources, so the cap never splits a source.
        sources = sorted(documents)
        rng.shuffle(sources)
        kept, n_docs = [], 0
        for source in sources:
            if n_docs >= max_per_subset:
                break
            kept.append(source)
            n_docs += len(documents[source])
        test_sources = split_sources({s: len(documents[s]) for s in kept}, test_fraction, rng)
        counts = {"train": 0, "test": 0}
        for source in sorted(kept):
            split = "test" if source in test_sources else "train"
            for paths, text in documents[source]:
                records.append({"text": text, "subset": subset, "source": source, "split": split, "path": paths})
                counts[split] += 1
        summary["subsets"][subset] = {
            **counts,
            "sources": len(kept),
            "test_sources": sorted(test_sources),
            "roots": [str(r) for r in roots[subset]],
        }
        logger.info("%s: %d train / %d test documents", subset, counts["train"], counts["test"])

    corpus_file = out_dir / "corpus.jsonl"
    with corpus_file.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary["documents"] = len(records)
    summary["sha256"] = hashlib.sha256(corpus_file.read_bytes()).hexdigest()
    (out_dir / "info.json").write_text(json.dumps(summary, indent=2))
    return summary
