"""Prompt loading (local files through `datasets`) and the offline corpus builder."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from train.corpus import build_corpus, split_sources, strip_troff
from train.data import Document, load_documents, load_prompts, make_prompt_ids


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(n))


def test_load_local_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "x y", "subset": "s", "source": "src", "split": "test"}) + "\n"
    )
    (tmp_path / "b.txt").write_text("plain text")
    docs = load_documents(tmp_path)
    assert Document("x y", "s", "src", "test") in docs
    assert any(d.text == "plain text" and d.split is None for d in docs)
    import datasets

    datasets.Dataset.from_dict({"text": ["p q"], "subset": ["par"]}).to_parquet(str(tmp_path / "c.parquet"))
    assert Document("p q", "par", "c", None) in load_documents(tmp_path / "c.parquet")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="`text`"):
        load_documents(tmp_path / "bad.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no usable data file"):
        load_documents(tmp_path / "empty")


def test_offline_hub_error_names_the_fix(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "get_dataset_config_names", offline)
    with pytest.raises(RuntimeError, match="build-corpus"):
        load_documents("nvidia/Nemotron-Pretraining-Dataset-sample")


def test_make_prompt_ids_bounds():
    rng = random.Random(0)
    assert make_prompt_ids(list(range(10)), 20, 30, rng) is None
    for _ in range(20):
        window = make_prompt_ids(list(range(100)), 20, 30, rng)
        assert 20 <= len(window) <= 30 and window == list(range(window[0], window[0] + len(window)))


def test_prompts_per_subset_split(tiny_tokenizer):
    docs = [Document(words(60, i), subset=f"s{i % 2}", source=f"d{i}") for i in range(20)]
    docs.append(Document("too short", subset="s0", source="short"))
    kwargs = dict(documents=docs, n_train=3, n_test=2, min_tokens=50, max_tokens=80, seed=1)
    train = load_prompts(tiny_tokenizer, split="train", **kwargs)
    test = load_prompts(tiny_tokenizer, split="test", **kwargs)
    assert len(train) == 6 and len(test) == 4
    assert {p.source for p in train}.isdisjoint({p.source for p in test})
    assert all(50 <= len(p.ids) <= 80 for p in train + test)
    # Deterministic, and the test prompts do not depend on the size of the training set.
    assert [p.ids for p in test] == [p.ids for p in load_prompts(tiny_tokenizer, split="test", **kwargs)]
    more = load_prompts(tiny_tokenizer, split="test", **{**kwargs, "n_train": 5})
    assert [p.source for p in more] == [p.source for p in test]
    with pytest.raises(ValueError, match="split"):
        load_prompts(tiny_tokenizer, split="valid", documents=docs)


def test_fixed_split_field_is_respected(tiny_tokenizer):
    docs = [Document(words(60, i), "s", f"src{i}", "test" if i < 2 else "train") for i in range(6)]
    test = load_prompts(tiny_tokenizer, split="test", documents=docs, n_test=5, min_tokens=50, max_tokens=60)
    assert sorted(p.source for p in test) == ["src0", "src1"]


def test_strip_troff():
    page = '.\\" comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.PP\n.B \\-a\nall'
    text = strip_troff(page)
    assert "comment" not in text and "\\f" not in text
    assert "NAME" in text and "ls - list directory contents" in text and "-a" in text


def test_split_sources_whole_sources():
    rng = random.Random(0)
    test = split_sources({"a": 5, "b": 5, "c": 5, "d": 5}, 0.3, rng)
    assert 1 <= len(test) < 4
    assert split_sources({"only": 9}, 0.5, rng) == set()


def test_build_corpus_deterministic_and_split_by_source(tmp_path):
    root = tmp_path / "stdlib"
    for package in ["alpha", "beta", "gamma", "delta", "eps"]:
        (root / package).mkdir(parents=True)
        for i in range(3):
            (root / package / f"m{i}.py").write_text(f"# {package} {i}\n" + words(400, hash((package, i)) % 1000))
    man = tmp_path / "man" / "man1"
    man.mkdir(parents=True)
    for tool in ["git-a", "git-b", "ls", "cp"]:
        (man / f"{tool}.1.gz").write_bytes(gzip.compress(f".TH X 1\n.SH NAME\n{tool} {words(600, len(tool))}".encode()))
    roots = {"python-stdlib": [root], "man-pages": [tmp_path / "man"]}
    info = build_corpus(tmp_path / "out1", roots=roots, min_chars=1000, test_fraction=0.3, seed=3)
    again = build_corpus(tmp_path / "out2", roots=roots, min_chars=1000, test_fraction=0.3, seed=3)
    assert info["sha256"] == again["sha256"]
    records = [json.loads(line) for line in (tmp_path / "out1" / "corpus.jsonl").read_text().splitlines()]
    by_source = {}
    for r in records:
        by_source.setdefault((r["subset"], r["source"]), set()).add(r["split"])
    assert all(len(splits) == 1 for splits in by_source.values())  # no source on both sides
    assert {r["split"] for r in records} == {"train", "test"}
    assert {r["source"] for r in records if r["subset"] == "man-pages"} <= {"git", "ls", "cp"}
    assert all(".TH" not in r["text"] for r in records)
    with pytest.raises(ValueError, match="Unknown corpus subsets"):
        build_corpus(tmp_path / "x", roots={"novels": [root]})
