"""Where the corpus's text comes from: a scanner per subset and the readers that turn a file into plain text.

A scanner (``scan_<subset>``) walks one root folder and yields a :class:`CorpusFile` for each file of its subset,
with the **source** the file belongs to (the unit the train/test split keeps whole) and the reader of its text:
troff markup stripped from man pages, chatterbot YAML and chitchat JSON flattened into dialogue, LaTeX kept only
where it holds maths, non-English dictionaries left out of ``prose-en`` (:func:`english_share`).
:mod:`train.corpus` names the subsets, where they are looked for, and builds the corpus from these files.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CorpusFile", "clear_caches", "english_share", "strip_troff"]


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


def scan_stdlib(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in {"site-packages", "dist-packages"} or "__pycache__" in rel.parts:
            continue
        source = rel.parts[0].removesuffix(".py")
        yield CorpusFile(path, "python-stdlib", source, _read_text)


def scan_package_docs(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("*.dist-info/METADATA")):
        source = path.parent.name.split("-")[0].lower()
        yield CorpusFile(path, "python-package-docs", source, _read_metadata)


def scan_man(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("man*/*")):
        if path.is_file():
            yield CorpusFile(path, "man-pages", _name_prefix(path.name), _read_man)


def scan_man_intl(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("*/man*/*")):
        lang = path.relative_to(root).parts[0]
        if lang.startswith("man") or not path.is_file():
            continue  # man1..man8 are the English pages
        yield CorpusFile(path, "man-pages-intl", f"{lang}/{_name_prefix(path.name)}", _read_man)


_DEBIAN_DOC = re.compile(r"^(README|NEWS|TODO|changelog|FAQ|HISTORY|CHANGES)|\.(md|txt)(\.gz)?$", re.IGNORECASE)


def scan_debian_docs(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.glob("*/**/*")):
        rel = path.relative_to(root)
        if not path.is_file() or path.is_symlink() or "copyright" in path.name.lower():
            continue  # license texts are identical across packages: they would leak between splits
        if _DEBIAN_DOC.search(path.name):
            yield CorpusFile(path, "debian-docs", rel.parts[0], _read_text)


def scan_rst(root: Path) -> Iterable[CorpusFile]:
    for path in sorted(root.rglob("*.rst")):
        rel = path.relative_to(root)
        source = f"{root.name}/{rel.parts[0]}" if len(rel.parts) > 1 else root.name
        yield CorpusFile(path, "rst-docs", source, _read_text)


def scan_c_headers(root: Path) -> Iterable[CorpusFile]:
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


def scan_perl(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, "*.pm"):
        first = path.relative_to(root).parts[0]
        yield CorpusFile(path, "perl-modules", first.removesuffix(".pm"), _read_text)


def scan_js(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root):
        if path.suffix not in {".js", ".mjs", ".cjs"} or path.name.endswith(".min.js"):
            continue  # minified bundles are not text a model reads
        parts = path.relative_to(root).parts
        # The innermost node_modules names the package (npm vendors its dependencies in nested node_modules).
        start = max((i + 1 for i, part in enumerate(parts[:-1]) if part == "node_modules"), default=0)
        name = parts[start : start + 2] if parts[start].startswith("@") else parts[start : start + 1]
        yield CorpusFile(path, "js-modules", "/".join(name), _read_text)


def scan_java(root: Path) -> Iterable[CorpusFile]:
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


def scan_rust(root: Path) -> Iterable[CorpusFile]:
    """``*.rs`` of the crates under ``root`` (Debian's ``librust-*-dev`` unpack them in /usr/share/cargo/registry)."""
    for path in _files(root, "*.rs"):
        crate = path.relative_to(root).parts[0]
        # regex-1.7.1 -> regex, value-bag-1.0.0-alpha.9 -> value-bag: versions of one crate share a source.
        yield CorpusFile(path, "rust-crates", re.sub(r"-\d+\.\d+.*$", "", crate), _read_text)


_SHELLS = re.compile(rb"^#! ?(?:/usr)?/bin/(?:env )?(?:sh|bash|dash)\b")


def scan_shell(root: Path) -> Iterable[CorpusFile]:
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


def scan_fortunes_en(root: Path) -> Iterable[CorpusFile]:
    # The English files lie at the top; other languages have folders (fortunes-it links its files to the top
    # too, but as symlinks, which _files leaves out).
    for path in _fortune_files(root):
        yield CorpusFile(path, "fortunes-en", path.name, _read_fortunes)


def scan_fortunes_intl(root: Path) -> Iterable[CorpusFile]:
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "off"):  # off/: rot13, offensive
        for path in _fortune_files(folder):
            yield CorpusFile(path, "fortunes-intl", f"{folder.name}/{path.name}", _read_fortunes)


def scan_dictionaries(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, recursive=False):
        if path.name.endswith((".dict", ".dict.dz")):
            name = path.name.removesuffix(".dz").removesuffix(".dict")
            yield CorpusFile(path, "dictionaries-en", name, _read_english_dictionary)


def scan_chat_en(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root / "english", "*.yml"):
        yield CorpusFile(path, "chat-en", path.stem, _read_chat)


def scan_chat_intl(root: Path) -> Iterable[CorpusFile]:
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "english"):
        for path in _files(folder, "*.yml"):
            yield CorpusFile(path, "chat-intl", folder.name, _read_chat_intl)


def scan_chitchat(root: Path) -> Iterable[CorpusFile]:
    """Conversations of ``root/dataset.json``; the first hex digit of their id makes 16 sources of ~450 each."""
    dataset = root / "dataset.json"
    if not dataset.is_file():
        return
    for conversation in sorted(_chitchat(str(dataset))):
        path = Path(f"{dataset}#{conversation}")
        yield CorpusFile(path, "chitchat-en", conversation[:1], _chitchat_reader(dataset, conversation))


def scan_plays(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root, "*.md"):
        yield CorpusFile(path, "plays-en", path.stem, _read_play)


def scan_latex(root: Path) -> Iterable[CorpusFile]:
    for path in _files(root):
        if path.name.endswith((".tex", ".tex.gz", ".ltx")):
            source = "/".join(path.relative_to(root).parts[:2])  # latex/amsmath: one CTAN package
            yield CorpusFile(path, "latex-math", source, _read_latex_math)


def clear_caches() -> None:
    """Drop the parsed chitchat JSON (40 MB) and the open zip archives, not needed once the corpus is scanned."""
    _chitchat.cache_clear()
    _zip_archive.cache_clear()
