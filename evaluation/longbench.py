"""LongBench (Bai et al., 2023, arXiv 2308.14508): tasks, prompts, generation budgets and scoring.

Rows have LongBench's own format, whether they come from the Hub (``THUDM/LongBench``, one configuration per
task, split ``test``), from the ``data.zip`` archive of that repository (``data/<task>.jsonl``) or from a local
copy: ``input`` (the question or few-shot query, may be empty), ``context`` (the long document), ``answers``
(list of str), ``all_classes`` (label set of classification tasks, else null), ``_id``, plus ``length``,
``dataset`` and ``language``.

Each task's prompt is LongBench's template (``config/dataset2prompt.json`` of the LongBench repository), cut in
three parts for the ``kv-press-text-generation`` pipeline: the *context* (instruction and document, what the press
compresses), the *question* (the part that holds ``{input}``, or the instruction that follows the document) and
the *answer prefix* (the template's last line, e.g. ``"Answer:"``), which the pipeline places after the chat
template's generation prompt. Generation budgets are LongBench's ``config/dataset2maxlen.json``; the metric of
each task is the one of LongBench's ``eval.py`` (see :mod:`evaluation.metrics`).

Differences from LongBench's ``pred.py``: the chat template is applied to every task (LongBench skips it for
the few-shot and code tasks), and SAMSum generation is not stopped at the first newline (only the first line is
scored anyway).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .metrics import best_over_references

__all__ = [
    "LongBenchTask",
    "TASKS",
    "ENGLISH_TASKS",
    "CHINESE_TASKS",
    "JIEBA_TASKS",
    "HUB_ID",
    "split_prompt",
    "build_sample",
    "postprocess",
    "score",
]

#: The Hub repository of LongBench (one configuration per task, split ``test``).
HUB_ID = "THUDM/LongBench"


@dataclass(frozen=True)
class LongBenchTask:
    """One LongBench task.

    Parameters
    ----------
    name : LongBench's dataset name (Hub configuration and ``data/<name>.jsonl``).
    prompt : LongBench's prompt template, with ``{context}`` and (most tasks) ``{input}``.
    max_new_tokens : LongBench's generation budget for the task.
    metric : a key of :data:`evaluation.metrics.LONGBENCH_METRICS`.
    first_line : only the first line of the prediction is scored (few-shot tasks, as in LongBench's eval.py).
    """

    name: str
    prompt: str
    max_new_tokens: int
    metric: str
    first_line: bool = False


_QA_BRIEF = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
)
# The prompts are LongBench's templates, word for word: they define the benchmark (including the missing space
# of "asconcisely" in NarrativeQA's).
_PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
        '"unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the '
        "above article as concisely as you can, using a single phrase or sentence if possible. If the question "
        'cannot be answered based on the information in the article, write "unanswerable". If the question is a '
        'yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
        "\n\n问题：{input}\n回答："
    ),
    "hotpotqa": f"{_QA_BRIEF}\n\nThe following are given passages.\n{{context}}\n\n{_QA_BRIEF}\n\n"
    "Question: {input}\nAnswer:",
    "2wikimqa": f"{_QA_BRIEF}\n\nThe following are given passages.\n{{context}}\n\n{_QA_BRIEF}\n\n"
    "Question: {input}\nAnswer:",
    "musique": f"{_QA_BRIEF}\n\nThe following are given passages.\n{{context}}\n\n{_QA_BRIEF}\n\n"
    "Question: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n"
    "问题：{input}\n回答：",
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n"
    "{context}\n{input}",
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
    "{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# name: (max_new_tokens, metric, first_line)
_SPECS = {
    "narrativeqa": (128, "qa_f1", False),
    "qasper": (128, "qa_f1", False),
    "multifieldqa_en": (64, "qa_f1", False),
    "multifieldqa_zh": (64, "qa_f1_zh", False),
    "hotpotqa": (32, "qa_f1", False),
    "2wikimqa": (32, "qa_f1", False),
    "musique": (32, "qa_f1", False),
    "dureader": (128, "rouge_l_zh", False),
    "gov_report": (512, "rouge_l", False),
    "qmsum": (512, "rouge_l", False),
    "multi_news": (512, "rouge_l", False),
    "vcsum": (512, "rouge_l_zh", False),
    "trec": (64, "classification", True),
    "triviaqa": (32, "qa_f1", True),
    "samsum": (128, "rouge_l", True),
    "lsht": (64, "classification", True),
    "passage_count": (32, "count", False),
    "passage_retrieval_en": (32, "retrieval", False),
    "passage_retrieval_zh": (32, "retrieval_zh", False),
    "lcc": (64, "code_sim", False),
    "repobench-p": (64, "code_sim", False),
}

#: Every LongBench task, in LongBench's order.
TASKS: dict[str, LongBenchTask] = {name: LongBenchTask(name, _PROMPTS[name], *_SPECS[name]) for name in _SPECS}

#: The five Chinese tasks.
CHINESE_TASKS: tuple[str, ...] = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
#: The 16 English and code tasks (the default; the set the KVpress leaderboard reports).
ENGLISH_TASKS: tuple[str, ...] = tuple(n for n in TASKS if n not in CHINESE_TASKS)
#: Chinese tasks whose metric segments words with jieba (an optional dependency).
JIEBA_TASKS: tuple[str, ...] = tuple(n for n, t in TASKS.items() if t.metric in ("qa_f1_zh", "rouge_l_zh"))


def split_prompt(template: str) -> tuple[str, str, str]:
    """Cut a LongBench template into (context part, question part, answer prefix), placeholders kept.

    The answer prefix is the template's last line after its last placeholder (``"Answer:"``,
    ``"The answer is: "``, ``"Next line of code:\\n"``; empty when the template ends with ``{input}``). The
    question part starts at the line that holds ``{input}`` (or right after ``{context}`` when ``{input}``
    follows it on the same line), or, without ``{input}``, after the newlines that follow the document; the
    context part is everything before it.
    """
    context_end = template.index("{context}") + len("{context}")
    last_placeholder = max(context_end, template.rfind("{input}") + len("{input}") if "{input}" in template else 0)
    tail = template[last_placeholder:]
    cut = tail.rstrip("\n").rfind("\n") + 1
    answer_prefix = tail[cut:]
    body = template[: last_placeholder + cut]
    if "{input}" in body:
        question_start = max(context_end, body.rfind("\n", 0, body.index("{input}")) + 1)
    else:
        question_start = context_end + len(body[context_end:]) - len(body[context_end:].lstrip("\n"))
    return body[:question_start], body[question_start:], answer_prefix


# A few-shot query ends with the label line the model must complete ("Type:", "Answer:", "Summary:").
_LABEL_LINE = re.compile(r"(?:^|\n)([^\n]{1,20}[:：])[ \t]*$")


def build_sample(task: str, row: dict[str, Any], index: int) -> dict[str, Any]:
    """Turn one LongBench row into an evaluation sample (without ``n_tokens``, measured by the caller).

    Parameters
    ----------
    task : a key of :data:`TASKS`.
    row : LongBench fields ``context``, ``input``, ``answers``, ``all_classes`` and ``_id``.
    index : position of the row in its task, used as the id when ``_id`` is missing.

    Returns
    -------
    dict with ``task``, ``id``, ``context``, ``question``, ``answer_prefix``, ``answers``, ``all_classes``,
    ``max_new_tokens``.
    """
    spec = TASKS[task]
    missing = [c for c in ("context", "input", "answers") if c not in row]
    if missing:
        raise ValueError(f"LongBench rows of {task!r} lack the column(s) {', '.join(missing)}.")
    context_part, question_part, answer_prefix = split_prompt(spec.prompt)
    query = row["input"] or ""
    if not answer_prefix and question_part.endswith("{input}"):
        # Few-shot tasks: the query's own label line ("Type:") becomes the answer prefix, after the chat turn.
        label = _LABEL_LINE.search(query)
        if label is not None:
            answer_prefix = label.group(1)
            query = query[: label.start(1)]
    answers = row["answers"]
    if isinstance(answers, str) or not answers:
        raise ValueError(f"A LongBench row of {task!r} has no list of answers: {answers!r}.")
    return {
        "task": task,
        "id": str(row.get("_id") or f"{task}-{index}"),
        "context": context_part.replace("{context}", row["context"]),
        "question": question_part.replace("{input}", query),
        "answer_prefix": answer_prefix,
        "answers": [str(a) for a in answers],
        "all_classes": list(row.get("all_classes") or []),
        "max_new_tokens": spec.max_new_tokens,
    }


def postprocess(task: str, prediction: str) -> str:
    """The part of a prediction LongBench scores: the first line for the few-shot tasks, else all of it."""
    if TASKS[task].first_line:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score(task: str, prediction: str, answers: list[str], all_classes: list[str] | None = None) -> float:
    """A sample's LongBench score in percent (0-100): the task metric, best over the reference answers."""
    return 100.0 * best_over_references(TASKS[task].metric, postprocess(task, prediction), answers, all_classes)
