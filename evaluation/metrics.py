"""Scores of the evaluation's benchmarks, written from each benchmark's definition.

RULER: is each reference string in the prediction (case-insensitive)? ``string_match_all`` scores a sample by the
share of its references found (needle, variable tracking, common and frequent words tasks); ``string_match_part``
gives full marks if any reference is found (QA). Both average over samples and are reported in percent, as RULER
reports them.

LongBench: per-sample scores in [0, 1] (QA F1 with SQuAD normalisation, ROUGE-L, classification, passage
retrieval and count scores, code edit similarity), the best over a sample's reference answers
(:func:`best_over_references`).

Math (AIME): exact match of the last ``\\boxed{...}`` answer, normalised as an integer (:func:`boxed_match`).
"""

from __future__ import annotations

import difflib
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "string_match_all",
    "string_match_part",
    "sample_score",
    "METRICS",
    "normalize_answer",
    "normalize_zh_answer",
    "token_f1",
    "qa_f1_score",
    "qa_f1_zh_score",
    "rouge_l_score",
    "rouge_zh_score",
    "classification_score",
    "retrieval_score",
    "retrieval_zh_score",
    "count_score",
    "code_sim_score",
    "LONGBENCH_METRICS",
    "best_over_references",
    "last_boxed",
    "normalize_integer_answer",
    "boxed_match",
]


def _check(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if isinstance(predictions, str):
        raise TypeError("predictions must be a sequence of strings, one per sample, not a single string.")
    if len(predictions) != len(references):
        raise ValueError(f"Got {len(predictions)} predictions but {len(references)} reference lists.")
    for refs in references:
        if isinstance(refs, str) or not refs:
            raise ValueError("Each sample needs a non-empty list of reference strings.")


def _all(prediction: str, refs: Sequence[str]) -> float:
    text = prediction.lower()
    return sum(ref.lower() in text for ref in refs) / len(refs)


def _part(prediction: str, refs: Sequence[str]) -> float:
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in refs))


def _mean_percent(per_sample, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """100 x the mean of ``per_sample(prediction, references)`` over samples (0.0 for no samples)."""
    _check(predictions, references)
    if not predictions:
        return 0.0
    return 100.0 * sum(per_sample(p, r) for p, r in zip(predictions, references, strict=True)) / len(predictions)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the share of references contained in the prediction, in percent.

    Parameters
    ----------
    predictions : one generated string per sample.
    references : one non-empty list of reference strings per sample.

    Returns
    -------
    float in [0, 100]; 0.0 for no samples.
    """
    return _mean_percent(_all, predictions, references)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Share of samples whose prediction contains at least one reference, in percent.

    Parameters
    ----------
    predictions : one generated string per sample.
    references : one non-empty list of reference strings per sample.

    Returns
    -------
    float in [0, 100]; 0.0 for no samples.
    """
    return _mean_percent(_part, predictions, references)


#: Metric name (as in :class:`evaluation.ruler.TaskSpec`) -> corpus-level function.
METRICS = {"all": string_match_all, "part": string_match_part}


def sample_score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """Score one sample with its task's metric, in percent (0-100).

    Parameters
    ----------
    task : a task of :data:`evaluation.ruler.TASKS` (``qa`` uses ``part``, every other task ``all``).
    prediction : the generated answer.
    answers : the reference strings.
    """
    from .ruler import TASKS

    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    return METRICS[TASKS[task].metric]([prediction], [list(answers)])


# --- LongBench (Bai et al., 2023): one score in [0, 1] per (prediction, reference) ------------------------------
# The task -> metric mapping, the normalisations and the post-processing follow LongBench's eval.py / metrics.py;
# the functions are written here from those definitions (no dependency on rouge, fuzzywuzzy or jieba unless a
# Chinese task needs jieba's word segmentation).
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation used by LongBench's English QA F1.

    Lower-cases, deletes ASCII punctuation (without inserting a space, so ``"e-mail"`` becomes ``"email"``),
    deletes the articles *a*, *an*, *the* as whole words and collapses whitespace, in that order.
    """
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _is_zh_punctuation(ch: str) -> bool:
    # ASCII punctuation, any Unicode punctuation (CJK and full-width marks: 。，！？、“”《》…) and the full-width
    # forms of ASCII symbols (＄＋＜＝＞＾｀｜～).
    if ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P"):
        return True
    return 0xFF01 <= ord(ch) <= 0xFF5E and not ch.isalnum()


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalisation: lower-case, delete punctuation and every whitespace character."""
    return "".join(ch for ch in text.lower() if not _is_zh_punctuation(ch) and not ch.isspace())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0.0 when nothing overlaps)."""
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str, **_: Any) -> float:
    """Token F1 between the normalised prediction and reference (:func:`normalize_answer`)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _jieba_words(text: str) -> list[str]:
    try:
        import jieba
    except ImportError as error:
        raise ImportError(
            "The Chinese LongBench tasks (multifieldqa_zh, dureader, vcsum) segment words with jieba: "
            "pip install jieba."
        ) from error
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, reference: str, **_: Any) -> float:
    """Token F1 over jieba words, each normalised with :func:`normalize_zh_answer` (empty words dropped)."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(word) for word in _jieba_words(text)) if w]

    return token_f1(words(prediction), words(reference))


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, by dynamic programming over one row at a time."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def _rouge_tokens(text: str) -> list[str]:
    # Whitespace tokens; periods separate sentences in LongBench's ROUGE package and are not tokens.
    return text.replace(".", " ").split()


def rouge_l_score(prediction: str, reference: str, **_: Any) -> float:
    """ROUGE-L F1: the longest common subsequence of the two token sequences over their lengths.

    Tokens are whitespace-separated words with periods removed; matching is case-sensitive, as in LongBench.
    This is the textbook ROUGE-L of two token sequences; the ``rouge`` package LongBench calls computes a
    summary-level variant (per-sentence union LCS, counting distinct words), so summarisation scores can
    differ from published LongBench tables by a few points. 0.0 when either text has no token.
    """
    pred, ref = _rouge_tokens(prediction), _rouge_tokens(reference)
    if not pred or not ref:
        return 0.0
    lcs = _lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_zh_score(prediction: str, reference: str, **_: Any) -> float:
    """:func:`rouge_l_score` over jieba words (Chinese summarisation and DuReader)."""
    return rouge_l_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(reference)))


def classification_score(prediction: str, reference: str, *, all_classes: Sequence[str], **_: Any) -> float:
    """LongBench's few-shot classification score (TREC, LSHT).

    The classes named in the prediction are collected; a class that is a strict substring of the reference
    class is dropped (naming "city" inside "city or town" is not a competing guess). The score is
    ``1 / number of classes named`` when the reference class is among them, else 0. (LongBench's loop removes
    from the list it iterates over, which can skip an element; here every such class is dropped.)
    """
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in reference and c != reference)]
    return 1.0 / len(named) if reference in named else 0.0


def _share_equal(numbers: Sequence[str], target: str) -> float:
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, reference: str, **_: Any) -> float:
    """PassageRetrieval-en: share of the numbers in the prediction that equal the paragraph number of
    ``reference`` (``"Paragraph 12"``); 0 when the prediction has no number."""
    match = re.search(r"Paragraph (\d+)", reference)
    if match is None:
        raise ValueError(f"A PassageRetrieval-en reference names a paragraph ('Paragraph 3'), got {reference!r}.")
    return _share_equal(re.findall(r"\d+", prediction), match.group(1))


def retrieval_zh_score(prediction: str, reference: str, **_: Any) -> float:
    """PassageRetrieval-zh: as :func:`retrieval_score`, with references written ``"段落12"``."""
    match = re.search(r"段落(\d+)", reference)
    if match is None:
        raise ValueError(f"A PassageRetrieval-zh reference names a paragraph ('段落3'), got {reference!r}.")
    return _share_equal(re.findall(r"\d+", prediction), match.group(1))


def count_score(prediction: str, reference: str, **_: Any) -> float:
    """PassageCount: share of the numbers in the prediction equal to the reference count (0 if none)."""
    return _share_equal(re.findall(r"\d+", prediction), str(reference))


def code_sim_score(prediction: str, reference: str, **_: Any) -> float:
    """LCC / RepoBench-P edit similarity of the predicted next line of code.

    The predicted line is the first line (after leading newlines) that holds no backtick, ``#`` or ``//``
    (markdown fences and comments are skipped); the score is difflib's similarity ratio ``2 M / T`` of that line
    and the reference (LongBench reports fuzzywuzzy's ratio, the same quantity rounded to whole percents).
    """
    line = next((ln for ln in prediction.lstrip("\n").split("\n") if not any(m in ln for m in ("`", "#", "//"))), "")
    return difflib.SequenceMatcher(None, line, reference).ratio()


#: LongBench metric name -> ``metric(prediction, reference, all_classes=...)`` in [0, 1].
LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge_l": rouge_l_score,
    "rouge_l_zh": rouge_zh_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}


def best_over_references(
    metric: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """A LongBench sample's score: the best of ``metric`` over its reference answers, in [0, 1].

    Parameters
    ----------
    metric : a key of :data:`LONGBENCH_METRICS`.
    prediction : the (post-processed) generated answer.
    references : the sample's reference answers (non-empty).
    all_classes : the label set of classification tasks.
    """
    if metric not in LONGBENCH_METRICS:
        raise ValueError(f"Unknown LongBench metric {metric!r}; choose from {', '.join(LONGBENCH_METRICS)}.")
    if isinstance(references, str) or not references:
        raise ValueError("Each sample needs a non-empty list of reference strings.")
    function = LONGBENCH_METRICS[metric]
    return max(function(prediction, ref, all_classes=list(all_classes or ())) for ref in references)


# --- math answers (AIME) -----------------------------------------------------------------------------------------
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included.

    Returns None when there is none, or when the last one is never closed (a generation cut off by the token
    budget).
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")


def normalize_integer_answer(answer: str) -> str:
    """Canonical form of a final answer: an integer without sign noise, leading zeros or separators if it is one.

    Strips ``$``, ``\\text{...}``-style wrappers, spaces and LaTeX spacing (``\\,`` ``\\!`` ``~``), thousands
    separators (``1,000``, ``1{,}000``), a degree sign or a trailing period; ``"042"``, ``"42.0"`` and ``"+42"``
    all become ``"42"``. Anything that is not an integer after this is returned with the same clean-up only.
    """
    text = str(answer).strip()
    previous = None
    while previous != text:  # unwrap nested \text{\textbf{..}}
        previous, text = text, _LATEX_WRAPPERS.sub(r"\1", text)
    for token in ("$", "\\,", "\\!", "\\;", "\\ ", "~", "{,}", "^\\circ", "^{\\circ}", "\\%", "%", "°"):
        text = text.replace(token, "")
    text = "".join(text.split()).rstrip(".")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    match = re.fullmatch(r"([+-]?)(\d+)(?:\.0*)?", text)
    if match is None:
        return text
    value = int(match.group(2))
    return str(-value if match.group(1) == "-" and value else value)


def boxed_match(prediction: str, answer: str) -> float:
    """1.0 when the last ``\\boxed{}`` of ``prediction`` equals ``answer`` after :func:`normalize_integer_answer`."""
    boxed = last_boxed(prediction)
    if boxed is None:
        return 0.0
    return float(normalize_integer_answer(boxed) == normalize_integer_answer(answer))
