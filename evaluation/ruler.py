"""A deterministic, offline generator of RULER-style long-context tasks (Hsieh et al., 2024).

Every sample is a dict with the fields ``task``, ``id``, ``context``, ``question``, ``answer_prefix``,
``answers`` (list of str), ``length`` (the target), ``n_tokens`` (measured) and ``max_new_tokens``.
The prompt (``context`` + ``question`` + ``answer_prefix``) is grown with filler until it is as long as possible
without exceeding the target length, measured with the tokenizer of the model under test (chat-template tokens
are not counted).

Tasks
-----
``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``
    Needle(s) in a haystack: "the hidden number for <key> is <7 digits>". Multi-key adds three distractor needles
    with other keys, multi-value hides four numbers under the same key, multi-query asks for four keys at once.
    The plain names use a noise haystack (the same four short sentences repeated); the ``_text`` variants
    (``niah_single_text``, ...) hide the needles in real prose.
``vt``
    Variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (plus a distractor chain) spread over the
    noise haystack; list every variable that holds the value.
``cwe``
    Common-words extraction: a numbered list where a few words recur often and many only a few times; list the
    most common ones.
``fwe``
    Frequent-words extraction: made-up words drawn with Zipf-like frequencies; give the three most frequent.
``qa``
    Question answering over a real document: quote the words that follow a given passage of the document.

The real text is, by default, the prose of the Python language reference that ships with CPython
(``pydoc_data.topics``, the text behind ``help('if')``): available offline and identical for a given Python
version. Pass ``text=`` (a string or a path to a UTF-8 file) to use another document; paragraphs are separated by
blank lines, and indented lines (code) are dropped.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "TASKS",
    "DEFAULT_TASKS",
    "TaskSpec",
    "generate_samples",
    "generate_task",
    "load_sentences",
    "needle_values",
    "NEEDLE_PATTERN",
    "default_text_source",
    "to_dataset",
]

# The filler of the noise haystack: one unit, repeated.
NOISE = "The grass is green. The sky is blue. The sun is warm. Here we go, and there we go again."

_ADJECTIVES = (
    "amber brave calm dusty eager faint gentle hollow icy jolly kind lively misty noble odd pale quiet rapid "
    "silent tidy upper vivid wise young zesty bold crisp damp early fierce grand humble"
).split()
_NOUNS = (
    "anchor badger candle dolphin engine falcon garden harbor island jacket kettle ladder meadow needle orchard "
    "pepper quarry river saddle tunnel umbrella valley window yacht zebra bridge castle forest lantern mirror"
).split()
_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class TaskSpec:
    """How one task is built and scored.

    Parameters
    ----------
    name : task name.
    build : ``build(rng, n, sentences) -> (context, question, answer_prefix, answers)``; ``n`` is the amount of
        filler and the prompt must grow with it. ``rng`` is freshly seeded for every call, so the same sample is
        rebuilt with more or less filler.
    metric : ``"all"`` (share of the reference strings found) or ``"part"`` (any reference found).
    max_new_tokens : default generation budget for the answer.
    needs_text : whether the task reads the real-text source.
    """

    name: str
    build: Callable[[random.Random, int, Sequence[str]], tuple[str, str, str, list[str]]]
    metric: str
    max_new_tokens: int
    needs_text: bool = False


# --- text source -----------------------------------------------------------------------------------------------
def default_text_source() -> str:
    """Name of the default real-text source, recorded in run configs."""
    import sys

    return f"pydoc_data.topics (Python {sys.version_info.major}.{sys.version_info.minor})"


def _default_text() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some distributions split the stdlib; say how to get a document
        raise FileNotFoundError(
            "The default real-text haystack (pydoc_data.topics from the Python standard library) is missing: "
            "pass a text file instead (`text=` or `--haystack-file`)."
        ) from error
    return "\n\n".join(topics[name] for name in sorted(topics))


@lru_cache(maxsize=4)
def _sentences_from(text: str) -> tuple[str, ...]:
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.split("\n")
        # Drop code (indented) and section underlines; keep prose only.
        if any(line.startswith((" ", "\t")) for line in lines if line):
            continue
        if any(line.strip() and set(line.strip()) <= set("*=-~^#") for line in lines):
            continue
        joined = " ".join(line.strip() for line in lines if line.strip())
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", joined):
            if 6 <= len(sentence.split()) <= 60:
                sentences.append(sentence)
    return tuple(sentences)


def load_sentences(text: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Split a document into prose sentences (the real-text haystack).

    Parameters
    ----------
    text : the document itself, a path to a UTF-8 text file, or None for the default source
        (:func:`default_text_source`).

    Returns
    -------
    tuple of str, in document order.
    """
    if text is None:
        raw = _default_text()
    elif isinstance(text, os.PathLike) or (isinstance(text, str) and "\n" not in text and Path(text).is_file()):
        raw = Path(text).read_text(encoding="utf-8")
    else:
        raw = str(text)
    sentences = _sentences_from(raw)
    if len(sentences) < 20:
        raise ValueError(
            f"The real-text source yields only {len(sentences)} prose sentences; give a longer document "
            "(paragraphs separated by blank lines, sentences of 6-60 words)."
        )
    return sentences


class _TooShort(ValueError):
    """The prompt cannot be built at this amount of filler."""


# --- small helpers ---------------------------------------------------------------------------------------------
def _keys(rng: random.Random, k: int) -> list[str]:
    pairs = rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], k)
    return [f"{a}-{n}" for a, n in pairs]


def _numbers(rng: random.Random, k: int, digits: int = 7) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), k)]


def _made_up_words(rng: random.Random, k: int) -> list[str]:
    """``k`` distinct pronounceable made-up words of two or three syllables."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < k:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _text_filler(rng: random.Random, sentences: Sequence[str], n: int) -> list[str]:
    start = rng.randrange(len(sentences))
    return [sentences[(start + i) % len(sentences)] for i in range(n)]


def _insert(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert ``items`` into ``units`` at relative depths in [0, 1] (later items after earlier ones on ties)."""
    out = list(units)
    for item, depth in sorted(zip(items, depths, strict=True), key=lambda pair: pair[1], reverse=True):
        out.insert(round(depth * len(units)), item)
    return out


def _join_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# --- needle in a haystack --------------------------------------------------------------------------------------
_NIAH_INTRO = (
    "A long text follows. Some hidden numbers are placed in it; memorize them, you will be asked about them "
    "afterwards.\n\n"
)


def _needle(key: str, value: str) -> str:
    return f"Remember this: the hidden number for {key} is {value}."


#: Matches every needle :func:`_needle` writes; group 1 is the key, group 2 the number.
NEEDLE_PATTERN = re.compile(r"Remember this: the hidden number for (.+?) is (\d+)\.")


def needle_values(context: str) -> list[str]:
    """The numbers of every needle hidden in a ``niah_*`` sample's context (asked and distractors), in order."""
    return [match.group(2) for match in NEEDLE_PATTERN.finditer(context)]


def _niah(variant: str, text: bool):
    def build(rng: random.Random, n: int, sentences: Sequence[str]):
        if variant == "single":
            keys, values = _keys(rng, 1), _numbers(rng, 1)
            needles, asked, answers = [_needle(keys[0], values[0])], keys, values
        elif variant == "multikey":
            keys, values = _keys(rng, 4), _numbers(rng, 4)
            needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
            asked, answers = keys[:1], values[:1]  # the other three needles are distractors
        elif variant == "multivalue":
            keys, values = _keys(rng, 1), _numbers(rng, 4)
            needles = [_needle(keys[0], v) for v in values]
            asked, answers = keys, values
        else:  # multiquery
            keys, values = _keys(rng, 4), _numbers(rng, 4)
            needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
            asked, answers = keys, values
        depths = [rng.random() for _ in needles]
        filler = _text_filler(rng, sentences, n) if text else [NOISE] * n
        context = _NIAH_INTRO + " ".join(_insert(filler, needles, depths))
        names = _join_list(asked)
        if variant in ("single", "multikey"):
            question = f"What is the hidden number for {names} in the text above?"
            prefix = f"The hidden number for {names} is"
        elif variant == "multivalue":
            question = f"What are all the hidden numbers for {names} in the text above?"
            prefix = f"The hidden numbers for {names} are"
        else:
            question = f"What are the hidden numbers for {names} in the text above?"
            prefix = f"The hidden numbers for {names} are"
        return context, question, prefix, list(answers)

    return build


# --- variable tracking -----------------------------------------------------------------------------------------
def _build_vt(rng: random.Random, n: int, sentences: Sequence[str], hops: int = 4, chains: int = 2):
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        name = "".join(rng.choice(letters) for _ in range(5))
        if name not in names:
            names.append(name)
    values = _numbers(rng, chains, digits=5)
    statements, depths = [], []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        # Each chain is spread in order over the haystack, so every assignment follows the one it copies.
        chain_depths = sorted(rng.random() for _ in chain)
        statements.append(f"VAR {chain[0]} = {values[c]}.")
        statements.extend(f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain)))
        depths.extend(chain_depths)
    context = (
        "Memorize the variable assignments hidden in the text below; you will be asked about them.\n\n"
        + " ".join(_insert([NOISE] * n, statements, depths))
    )
    question = f"Which variables are assigned the value {values[0]}, directly or through other variables?"
    prefix = f"The variables that hold the value {values[0]} are:"
    return context, question, prefix, names[: hops + 1]


# --- common and frequent words ---------------------------------------------------------------------------------
# (occurrences of each common word, number of common words, occurrences of each rare word), largest first: short
# targets fall back to a smaller shape (see `_fit`).
CWE_SHAPES = ((30, 10, 3), (10, 10, 3), (6, 5, 2), (4, 3, 1))


def _build_cwe(rng: random.Random, n: int, sentences: Sequence[str], shape: tuple[int, int, int] = CWE_SHAPES[0]):
    common_freq, n_common, rare_freq = shape
    words = _made_up_words(rng, n_common + n)
    common, rare = words[:n_common], words[n_common:]
    items = [w for w in common for _ in range(common_freq)] + [w for w in rare for _ in range(rare_freq)]
    rng.shuffle(items)
    listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    context = f"Below is a numbered list of words.\n\n{listing}"
    question = f"What are the {n_common} most common words in the list above?"
    prefix = f"The {n_common} most common words in the list are:"
    return context, question, prefix, common


def _build_fwe(rng: random.Random, n: int, sentences: Sequence[str], alpha: float = 2.0):
    total = max(n, 1)
    vocab = _made_up_words(rng, max(10, total // 4))
    weights = [1 / (rank**alpha) for rank in range(1, len(vocab) + 1)]
    scale = total / sum(weights)
    counts = [max(1, round(w * scale)) for w in weights]
    items = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
    rng.shuffle(items)
    context = "Below is a text made of made-up words; keep track of how often each word appears.\n\n" + " ".join(items)
    question = "Which three made-up words appear most often in the text above?"
    prefix = "The three most frequent words are:"
    if not counts[0] > counts[1] > counts[2] > counts[3]:
        raise _TooShort("the three most frequent words are not distinct at this length")
    return context, question, prefix, vocab[:3]


# --- QA over a real document -----------------------------------------------------------------------------------
_PLAIN_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[.,;:]?")


def _build_qa(rng: random.Random, n: int, sentences: Sequence[str], prefix_words: int = 7, answer_words: int = 4):
    filler = _text_filler(rng, sentences, max(n, 1))
    # Pick the passage inside the document; try sentences from a random starting point until one is unique.
    order = list(range(len(filler)))
    rng.shuffle(order)
    body = " ".join(filler)
    for i in order:
        words = filler[i].split()
        # Plain words only, so that the answer can be quoted back without markup or escapes.
        if len(words) < prefix_words + answer_words or not all(
            _PLAIN_WORD.fullmatch(w) for w in words[: prefix_words + answer_words]
        ):
            continue
        passage = " ".join(words[:prefix_words])
        if body.lower().count(passage.lower()) == 1:
            answer = " ".join(words[prefix_words : prefix_words + answer_words]).rstrip(".,;:")
            break
    else:
        raise _TooShort("no sentence long enough and unique in the document")
    context = f"Read the following document.\n\n{body}"
    question = f'In the document above, which words come right after "{passage}"?'
    return context, question, "The words that follow are:", [answer]


TASKS: dict[str, TaskSpec] = {}
for _variant in ("single", "multikey", "multivalue", "multiquery"):
    for _text in (False, True):
        _name = f"niah_{_variant}" + ("_text" if _text else "")
        TASKS[_name] = TaskSpec(_name, _niah(_variant, _text), "all", 128, needs_text=_text)
TASKS["vt"] = TaskSpec("vt", _build_vt, "all", 30)
TASKS["cwe"] = TaskSpec("cwe", _build_cwe, "all", 120)
TASKS["fwe"] = TaskSpec("fwe", _build_fwe, "all", 50)
TASKS["qa"] = TaskSpec("qa", _build_qa, "part", 32, needs_text=True)

#: Every task, in a stable order (the default of a sweep).
DEFAULT_TASKS: tuple[str, ...] = tuple(TASKS)


# --- fitting to a length ---------------------------------------------------------------------------------------
def _count(tokenizer: Any, context: str, question: str, prefix: str) -> int:
    # Measured like the pipeline feeds the model: context, then question and answer prefix after a separator.
    return len(tokenizer.encode(f"{context}\n{question}\n{prefix}", add_special_tokens=False))


def _fit(spec: TaskSpec, tokenizer: Any, length: int, seed: str, sentences: Sequence[str]):
    """Build the sample with the most filler that fits in ``length`` tokens; returns ``(n_tokens, built)``."""
    if spec.name == "cwe":
        # The largest word-list shape whose common words alone take at most half of the budget.
        for shape in CWE_SHAPES:
            build = functools.partial(_build_cwe, shape=shape)
            built = build(random.Random(seed), 0, sentences)
            if _count(tokenizer, *built[:3]) <= length // 2:
                break
    else:
        build = spec.build

    def attempt(n: int):
        # A fresh generator for every attempt: the same sample, with more or less filler.
        try:
            built = build(random.Random(seed), n, sentences)
        except _TooShort:
            return None
        return _count(tokenizer, *built[:3]), built

    def fits(result) -> bool:
        return result is not None and result[0] <= length

    # Grow an upper bound geometrically, then bisect: about 2 log2(n) builds per sample. The prompt grows with n;
    # `None` (cannot be built yet, e.g. too few words to rank) only happens for small n.
    low, best, high = 0, None, 1
    while True:
        result = attempt(high)
        if result is not None and not fits(result):
            break
        if result is not None:
            low, best = high, result
        if high > 16 * length + 64:
            break
        high *= 2
    while high - low > 1:
        mid = (low + high) // 2
        result = attempt(mid)
        if fits(result):
            low, best = mid, result
        elif result is not None:
            high = mid
        else:
            low = mid
    if best is None:
        best = attempt(0)
    if not fits(best):
        raise ValueError(f"Task {spec.name!r} cannot fit in {length} tokens; use a longer target length.")
    return best


# --- public entry points ---------------------------------------------------------------------------------------
def generate_task(
    task: str,
    tokenizer: Any,
    length: int,
    n_samples: int,
    seed: int = 0,
    text: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """Generate ``n_samples`` samples of one task, each fitted to ``length`` tokens.

    Parameters
    ----------
    task : a key of :data:`TASKS`.
    tokenizer : a tokenizer with ``encode(text, add_special_tokens=False)`` (the model's).
    length : target prompt length in tokens (context + question + answer prefix, template excluded).
    n_samples : number of samples.
    seed : the same (task, length, seed, index, tokenizer, text) always gives the same sample.
    text : real-text source for the ``_text`` and ``qa`` tasks (see :func:`load_sentences`).

    Returns
    -------
    list of dict, see the module docstring for the fields.
    """
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}.")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0:
        raise ValueError(f"n_samples must be a non-negative int, got {n_samples!r}.")
    spec = TASKS[task]
    sentences = load_sentences(text) if spec.needs_text else ()
    samples = []
    for index in range(n_samples):
        # A string seed is hashed with SHA-512 by `random`, so it is stable across runs and PYTHONHASHSEED.
        n_tokens, (context, question, prefix, answers) = _fit(
            spec, tokenizer, length, f"{seed}/{task}/{length}/{index}", sentences
        )
        samples.append(
            {
                "task": task,
                "id": f"{task}-{length}-{index}",
                "context": context,
                "question": question,
                "answer_prefix": prefix,
                "answers": list(answers),
                "length": length,
                "n_tokens": n_tokens,
                "max_new_tokens": spec.max_new_tokens,
            }
        )
    logger.debug("Generated %d samples of %s at %d tokens", n_samples, task, length)
    return samples


def generate_samples(
    tokenizer: Any,
    tasks: Sequence[str] = DEFAULT_TASKS,
    length: int = 4096,
    n_samples: int = 10,
    seed: int = 0,
    text: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """Generate ``n_samples`` samples of every task in ``tasks`` at one target length (see :func:`generate_task`).

    Returns
    -------
    list of dict, grouped by task in the order given.
    """
    return [s for task in tasks for s in generate_task(task, tokenizer, length, n_samples, seed, text)]


def to_dataset(samples: list[dict[str, Any]]):
    """Wrap samples in a ``datasets.Dataset`` (needs the ``datasets`` package)."""
    from datasets import Dataset

    return Dataset.from_list(samples)
