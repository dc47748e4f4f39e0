"""The RULER-style generator: deterministic, answers in the context, lengths close to the target."""

import pytest

from evaluation.ruler import TASKS, generate_samples, generate_task, load_sentences
from tests.conftest import char_tokenizer

LENGTH = 1200  # characters = tokens with the char tokenizer; every task fits


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def samples(tokenizer):
    return generate_samples(tokenizer, list(TASKS), LENGTH, n_samples=2, seed=3)


def test_fields_and_every_task(samples):
    assert {s["task"] for s in samples} == set(TASKS)
    for s in samples:
        assert set(s) >= {"task", "id", "context", "question", "answer_prefix", "answers", "length", "n_tokens"}
        assert isinstance(s["answers"], list) and s["answers"] and all(isinstance(a, str) for a in s["answers"])
    assert len({s["id"] for s in samples}) == len(samples)


def test_deterministic(tokenizer, samples):
    again = generate_samples(tokenizer, list(TASKS), LENGTH, n_samples=2, seed=3)
    assert again == samples
    other = generate_task("niah_single", tokenizer, LENGTH, 2, seed=4)
    assert [s["context"] for s in other] != [s["context"] for s in samples if s["task"] == "niah_single"]
    assert samples[0]["context"] != samples[1]["context"]  # two samples of a task differ


def test_answers_are_in_the_context(samples):
    for s in samples:
        for answer in s["answers"]:
            assert answer.lower() in s["context"].lower(), (s["task"], answer)


def test_distractors_and_counts(samples):
    by_task = {s["task"]: s for s in samples}
    assert by_task["niah_multikey"]["context"].count("the hidden number for") == 4
    assert len(by_task["niah_multivalue"]["answers"]) == 4
    assert len(by_task["niah_multiquery"]["answers"]) == 4
    assert len(by_task["vt"]["answers"]) == 5
    # fwe: the three answers are the three most frequent words, in order.
    words = by_task["fwe"]["context"].split("\n\n", 1)[1].split()
    counts = sorted({w: words.count(w) for w in set(words)}.items(), key=lambda kv: -kv[1])
    assert [w for w, _ in counts[:3]] == by_task["fwe"]["answers"]
    assert counts[2][1] > counts[3][1]
    # cwe: every common word appears more often than any other word.
    lines = by_task["cwe"]["context"].split("\n\n", 1)[1].splitlines()
    listed = [line.split(". ", 1)[1] for line in lines]
    common = set(by_task["cwe"]["answers"])
    assert min(listed.count(w) for w in common) > max(listed.count(w) for w in set(listed) - common)


@pytest.mark.parametrize("length", [600, 2000])
def test_lengths_fit_the_target(tokenizer, length):
    for task in ("niah_single", "niah_single_text", "vt", "cwe", "fwe", "qa"):
        if length == 600 and task in ("vt", "qa"):
            continue
        for s in generate_task(task, tokenizer, length, 1):
            prompt = f"{s['context']}\n{s['question']}\n{s['answer_prefix']}"
            n_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
            assert n_tokens == s["n_tokens"] <= length
            # One filler unit is a sentence of up to 60 words: within 25% with characters as tokens.
            assert n_tokens >= 0.75 * length, (task, n_tokens)


def test_custom_text_source(tokenizer, tmp_path):
    text = "\n\n".join(
        f"Paragraph {i} says that the river number {i} flows north into the quiet lake." for i in range(40)
    )
    path = tmp_path / "doc.txt"
    path.write_text(text)
    assert load_sentences(path) == load_sentences(text)
    sample = generate_task("niah_single_text", tokenizer, 800, 1, text=path)[0]
    assert "flows north" in sample["context"]


def test_bad_input(tokenizer):
    with pytest.raises(ValueError, match="Unknown task"):
        generate_task("nope", tokenizer, 100, 1)
    with pytest.raises(ValueError, match="cannot fit"):
        generate_task("niah_multikey", tokenizer, 50, 1)
    with pytest.raises(ValueError, match="only"):
        load_sentences("Too short. Really.")
