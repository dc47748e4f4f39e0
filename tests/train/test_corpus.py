"""Offline corpus: every scanner on a tiny folder made here (nothing read from what this machine has installed),
kinds recorded per document, long files cut into pieces, byte-identical output."""

from __future__ import annotations

import gzip
import json
import random
import zipfile

import pytest

from train.corpus import KINDS, SUBSETS, _pieces, build_corpus, english_share, kind_of


def words(n: int, seed: int, vocabulary=("the", "cat", "and", "of", "a", "dog", "sat", "on", "mat", "is")) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(n))


GERMAN = ("der", "die", "und", "Katze", "Hund", "sitzt", "auf", "Matte", "ist", "nicht")


def scan(subset, root):
    """(source, file name, text) of everything a subset's scanner yields under root."""
    return [(f.source, f.path.name, f.reader(f.path)) for f in SUBSETS[subset].scanner(root)]


def test_every_subset_has_a_kind_and_kinds_list_them():
    assert {name for subsets in KINDS.values() for name in subsets} == set(SUBSETS)
    assert {
        "code-python",
        "code-c",
        "code-js",
        "code-rust",
        "docs-en",
        "prose-en",
        "dialogue",
        "non-english",
        "math",
    } <= set(KINDS)
    assert kind_of("man-pages") == "docs-en" and kind_of("c-headers") == "code-c"
    assert kind_of("nemotron-code") == "nemotron-code"  # unknown subsets (Hub configs) are their own kind


def test_c_headers(tmp_path):
    (tmp_path / "linux").mkdir()
    (tmp_path / "x86_64-linux-gnu" / "bits").mkdir(parents=True)
    (tmp_path / "stdio.h").write_text("int printf(const char *, ...);")
    (tmp_path / "linux" / "types.h").write_text("typedef int x;")
    (tmp_path / "x86_64-linux-gnu" / "bits" / "types.h").write_text("typedef long y;")
    (tmp_path / "notes.txt").write_text("not a header")
    found = scan("c-headers", tmp_path)
    assert sorted((s, n) for s, n, _ in found) == [
        ("linux", "types.h"),
        ("stdio", "stdio.h"),
        ("x86_64-linux-gnu/bits", "types.h"),
    ]


def test_perl_modules(tmp_path):
    (tmp_path / "Foo").mkdir()
    (tmp_path / "Foo" / "Bar.pm").write_text("package Foo::Bar; 1;")
    (tmp_path / "Foo.pm").write_text("package Foo; 1;")
    (tmp_path / "Baz.pm").write_text("package Baz; 1;")
    (tmp_path / "README").write_text("x")
    assert sorted((s, n) for s, n, _ in scan("perl-modules", tmp_path)) == [
        ("Baz", "Baz.pm"),
        ("Foo", "Bar.pm"),
        ("Foo", "Foo.pm"),
    ]


def test_js_modules_innermost_package(tmp_path):
    files = [
        "npm/lib/cli.js",
        "npm/node_modules/abbrev/index.js",
        "npm/node_modules/@npmcli/arborist/lib/x.mjs",
        "npm/node_modules/abbrev/node_modules/nested/a.cjs",
        "npm/dist/bundle.min.js",
        "npm/package.json",
    ]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("module.exports = 1;")
    assert sorted((s, n) for s, n, _ in scan("js-modules", tmp_path)) == [
        ("@npmcli/arborist", "x.mjs"),
        ("abbrev", "index.js"),
        ("nested", "a.cjs"),
        ("npm", "cli.js"),
    ]


def test_java_sources_from_src_zip(tmp_path):
    (tmp_path / "lib").mkdir()
    with zipfile.ZipFile(tmp_path / "lib" / "src.zip", "w") as archive:
        archive.writestr("java.base/java/util/List.java", "package java.util; interface List {}")
        archive.writestr("java.base/java/util/Map.java", "package java.util; interface Map {}")
        archive.writestr("jdk.jfr/jdk/jfr/Event.java", "package jdk.jfr; class Event {}")
        archive.writestr("java.base/module-info.txt", "not java")
    found = scan("java-sources", tmp_path)
    assert [(s, n) for s, n, _ in found] == [
        ("java.base/java.util", "List.java"),
        ("java.base/java.util", "Map.java"),
        ("jdk.jfr/jdk.jfr", "Event.java"),
    ]
    assert found[1][2] == "package java.util; interface Map {}"
    assert list(SUBSETS["java-sources"].scanner(tmp_path / "lib")) == []  # a folder without lib/src.zip


def test_rust_crates(tmp_path):
    for name in ["regex-1.7.1/src/lib.rs", "regex-1.7.1/src/re/mod.rs", "value-bag-1.0.0-alpha.9/src/lib.rs"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("pub fn f() {}")
    (tmp_path / "regex-1.7.1" / "Cargo.toml").write_text("[package]")
    assert sorted((s, n) for s, n, _ in scan("rust-crates", tmp_path)) == [
        ("regex", "lib.rs"),
        ("regex", "mod.rs"),
        ("value-bag", "lib.rs"),
    ]


def test_shell_scripts_by_shebang(tmp_path):
    (tmp_path / "git-sh-setup").write_text("#!/bin/sh\necho setup\n")
    (tmp_path / "git-rebase").write_text("#! /bin/bash\necho rebase\n")
    (tmp_path / "update").write_text("#!/usr/bin/env bash\necho update\n")
    (tmp_path / "tool").write_text("#!/usr/bin/perl\nprint 1;\n")
    (tmp_path / "binary").write_bytes(b"\x7fELF\x02\x01")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner").write_text("#!/bin/sh\n")  # not recursive: /usr/bin is flat
    assert sorted((s, n) for s, n, _ in scan("shell-scripts", tmp_path)) == [
        ("git", "git-rebase"),
        ("git", "git-sh-setup"),
        ("update", "update"),
    ]


def test_fortunes_english_top_level_and_languages_in_folders(tmp_path):
    (tmp_path / "it").mkdir()
    (tmp_path / "de").mkdir()
    (tmp_path / "off").mkdir()
    (tmp_path / "wisdom").write_text("First cookie.\n%\nSecond cookie.\n%\n")
    (tmp_path / "wisdom.dat").write_bytes(b"\x00\x02")
    (tmp_path / "wisdom.u8").symlink_to("wisdom")
    (tmp_path / "ascii-art").write_text("  /\\_/\\ \n%\n")
    (tmp_path / "it" / "adams").write_text("Biscotto italiano.\n%\n")
    (tmp_path / "adams").symlink_to("it/adams")  # fortunes-it links its files to the top
    (tmp_path / "de" / "witze").write_text("Ein Witz.\n%\nNoch einer.\n")
    (tmp_path / "off" / "rude").write_text("Ebg13.\n")
    assert scan("fortunes-en", tmp_path) == [("wisdom", "wisdom", "First cookie.\n\nSecond cookie.")]
    assert scan("fortunes-intl", tmp_path) == [
        ("de/witze", "witze", "Ein Witz.\n\nNoch einer."),
        ("it/adams", "adams", "Biscotto italiano."),
    ]


def test_english_dictionaries_only(tmp_path):
    devil = "00-database-url\nhttp://example\n" + words(300, 1)
    (tmp_path / "devil.dict.dz").write_bytes(gzip.compress(devil.encode()))
    (tmp_path / "devil.index").write_text("index")
    (tmp_path / "de-en.dict.dz").write_bytes(gzip.compress(words(300, 2, GERMAN).encode()))
    found = {s: text for s, _, text in scan("dictionaries-en", tmp_path)}
    assert set(found) == {"devil", "de-en"}
    assert found["de-en"] == "" and "00-database" not in found["devil"] and found["devil"].startswith("http")
    assert english_share(words(200, 3)) > 0.3 and english_share(words(200, 4, GERMAN)) == 0


def test_chat_dialogue_and_languages(tmp_path):
    (tmp_path / "english").mkdir()
    (tmp_path / "german").mkdir()
    (tmp_path / "english" / "greetings.yml").write_text(
        "categories:\n- greetings\nconversations:\n- - Hello\n  - Hi\n  - How are you?\n- - Good morning\n  - Morning\n"
    )
    (tmp_path / "german" / "greetings.yml").write_text(
        "conversations:\n- - Hallo\n  - Guten Tag\n- - Good morning, how are you?\n  - I am fine, and you?\n"
    )  # the second conversation was left untranslated: it is not non-English text
    (tmp_path / "german" / "empty.yml").write_text("categories:\n- none\n")
    assert scan("chat-en", tmp_path) == [
        ("greetings", "greetings.yml", "A: Hello\nB: Hi\nA: How are you?\n\nA: Good morning\nB: Morning")
    ]
    assert scan("chat-intl", tmp_path) == [
        ("german", "empty.yml", ""),
        ("german", "greetings.yml", "A: Hallo\nB: Guten Tag"),
    ]


def test_man_pages_of_other_languages(tmp_path):
    page = ".TH LS 1\n.SH NAME\nls \\- Verzeichnisinhalte auflisten"
    for folder in ["man1", "de/man1", "fr/man8"]:
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "man1" / "ls.1.gz").write_bytes(gzip.compress(b".TH LS 1\nEnglish"))
    (tmp_path / "de" / "man1" / "ls.1.gz").write_bytes(gzip.compress(page.encode()))
    (tmp_path / "fr" / "man8" / "apt-get.8").write_text(".TH APT 8\nPage en fran\u00e7ais")
    found = scan("man-pages-intl", tmp_path)
    assert [(s, n) for s, n, _ in found] == [("de/ls", "ls.1.gz"), ("fr/apt", "apt-get.8")]
    assert found[0][2].endswith("ls - Verzeichnisinhalte auflisten")
    assert [s for s, _, _ in scan("man-pages", tmp_path)] == ["ls"]


def test_latex_with_maths_only(tmp_path):
    (tmp_path / "latex" / "amsmath").mkdir(parents=True)
    (tmp_path / "latex" / "geometry").mkdir(parents=True)
    maths = "\\begin{equation} a^2 + b^2 = c^2 \\end{equation}\n" * 5 + "Let $x$ and $y$ be reals. " * 8
    (tmp_path / "latex" / "amsmath" / "testmath.tex").write_text(maths)
    (tmp_path / "latex" / "amsmath" / "short.tex.gz").write_bytes(gzip.compress(maths.encode()))
    (tmp_path / "latex" / "geometry" / "layout.tex").write_text("\\documentclass{article}\\usepackage{geometry}")
    (tmp_path / "latex" / "geometry" / "manual.tex").write_text(
        maths + "Margins and paper sizes. " * 2000
    )  # sparse maths
    found = scan("latex-math", tmp_path)
    assert [(s, n) for s, n, _ in found] == [
        ("latex/amsmath", "short.tex.gz"),
        ("latex/amsmath", "testmath.tex"),
        ("latex/geometry", "layout.tex"),
        ("latex/geometry", "manual.tex"),
    ]
    assert found[0][2] == maths and found[1][2] == maths and found[2][2] == found[3][2] == ""


def test_pieces_cut_long_text_at_line_breaks():
    text = "\n".join(f"line {i:03d} " + "x" * 20 for i in range(100))  # 100 lines of 29 characters
    pieces = _pieces(text, 300)
    assert all(len(p) <= 300 for p in pieces) and len(pieces) == 10
    assert "\n".join(pieces) == text  # nothing lost: every cut is at a line break
    assert _pieces("y" * 700, 300) == ["y" * 300, "y" * 300, "y" * 100]  # no line break: hard cuts
    assert _pieces("short", 300) == ["short"] and _pieces("  ", 300) == []


def test_build_corpus_records_kinds_and_is_deterministic(tmp_path):
    include, fortunes, chat = tmp_path / "include", tmp_path / "fortunes", tmp_path / "chat"
    for lib in ["alpha", "beta", "gamma", "delta"]:
        (include / lib).mkdir(parents=True)
        for i in range(2):
            (include / lib / f"h{i}.h").write_text(f"/* {lib} {i} */\n" + words(300, 10 * len(lib) + i))
    fortunes.mkdir()
    # One long fortune file: cut into pieces, it gives several documents of one source instead of its head only.
    (fortunes / "literature").write_text("\n%\n".join(words(40, i) for i in range(60)))
    (fortunes / "people").write_text("\n%\n".join(words(40, 100 + i) for i in range(30)))
    (chat / "english").mkdir(parents=True)
    for topic in ["food", "sports"]:
        turns = "".join(f"- - {words(8, len(topic) + i)}\n  - {words(8, 50 + len(topic) + i)}\n" for i in range(40))
        (chat / "english" / f"{topic}.yml").write_text("conversations:\n" + turns)
    roots = {"c-headers": [include], "fortunes-en": [fortunes], "chat-en": [chat]}
    kwargs = dict(roots=roots, min_chars=1000, max_chars=3000, test_fraction=0.3, seed=2)
    info = build_corpus(tmp_path / "out1", **kwargs)
    assert build_corpus(tmp_path / "out2", **kwargs)["sha256"] == info["sha256"]
    assert (tmp_path / "out1" / "corpus.jsonl").read_bytes() == (tmp_path / "out2" / "corpus.jsonl").read_bytes()
    records = [json.loads(line) for line in (tmp_path / "out1" / "corpus.jsonl").read_text().splitlines()]
    assert {(r["subset"], r["kind"]) for r in records} == {
        ("c-headers", "code-c"),
        ("fortunes-en", "prose-en"),
        ("chat-en", "dialogue"),
    }
    assert all(len(r["text"]) <= 3000 for r in records)
    literature = [r for r in records if r["source"] == "literature"]
    assert len(literature) >= 3 and all("%" not in r["text"] for r in literature)
    assert info["kinds"]["code-c"]["subsets"] == ["c-headers"]
    assert info["kinds"]["prose-en"]["train"] + info["kinds"]["prose-en"]["test"] == sum(
        r["kind"] == "prose-en" for r in records
    )
    assert info["subsets"]["c-headers"]["kind"] == "code-c"
    for subset in ["c-headers", "fortunes-en", "chat-en"]:
        sources = {r["source"]: r["split"] for r in records if r["subset"] == subset}
        assert set(sources.values()) == {"train", "test"}  # at least one held-out source per subset
    with pytest.raises(ValueError, match="Unknown corpus subsets"):
        build_corpus(tmp_path / "x", roots={"novels": [include]})


def test_chitchat_conversations_in_16_sources(tmp_path):
    def message(sender, *lines):
        return [{"text": line, "timestamp": "", "sender": sender} for line in lines]

    dataset = {
        "a1": {"messages": [message("u1", "Hello", "how are you?"), message("u2", "fine"), message("u1", "good")]},
        "a2": {"messages": [message("u9", "Hi")]},
        "f0": {"messages": [[], message("u3", "Hey")]},
    }
    (tmp_path / "dataset.json").write_text(json.dumps(dataset))
    found = scan("chitchat-en", tmp_path)
    assert [(s, n) for s, n, _ in found] == [
        ("a", "dataset.json#a1"),
        ("a", "dataset.json#a2"),
        ("f", "dataset.json#f0"),
    ]
    assert found[0][2] == "A: Hello how are you?\nB: fine\nA: good" and found[2][2] == "A: Hey"
    assert list(SUBSETS["chitchat-en"].scanner(tmp_path / "missing")) == []


def test_plays_as_dialogue(tmp_path):
    (tmp_path / "tragedies").mkdir()
    play = "# Hamlet\n\n**BERNARDO**  \nWho's there?\n\n**FRANCISCO**  \nNay, answer me:  \nstand.\n"
    (tmp_path / "tragedies" / "hamlet.md").write_text(play)
    assert scan("plays-en", tmp_path) == [
        ("hamlet", "hamlet.md", "# Hamlet\n\nBERNARDO:\nWho's there?\n\nFRANCISCO:\nNay, answer me:\nstand.\n")
    ]
