"""LongBench: prompts split for the pipeline, samples from fixtures (directory, single file, data.zip), scoring."""

import json
import sys
import types
import zipfile
from pathlib import Path

import datasets
import pytest

from evaluation import longbench
from evaluation.benchmarks import BENCHMARKS, LoadRequest
from evaluation.longbench import ENGLISH_TASKS, JIEBA_TASKS, TASKS, build_sample, postprocess, score, split_prompt
from tests.conftest import char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
FIXTURE_TASKS = sorted(p.stem for p in FIXTURES.glob("*.jsonl"))


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _rows(task: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_task_table():
    assert len(TASKS) == 21 and len(ENGLISH_TASKS) == 16
    assert set(JIEBA_TASKS) == {"multifieldqa_zh", "dureader", "vcsum"}
    assert TASKS["gov_report"].max_new_tokens == 512 and TASKS["hotpotqa"].max_new_tokens == 32
    assert TASKS["trec"].metric == "classification" and TASKS["lcc"].metric == "code_sim"
    assert [t for t in TASKS if TASKS[t].first_line] == ["trec", "triviaqa", "samsum", "lsht"]


@pytest.mark.parametrize("task", list(TASKS))
def test_split_prompt_rebuilds_the_template(task):
    template = TASKS[task].prompt
    context, question, prefix = split_prompt(template)
    assert context + question + prefix == template
    assert "{context}" in context and "{input}" not in context and "{context}" not in question + prefix
    assert "{input}" not in prefix and prefix == prefix.lstrip("\n")


def test_split_prompt_examples():
    assert split_prompt(TASKS["narrativeqa"].prompt)[1:] == ("Question: {input}\n\n", "Answer:")
    context, question, prefix = split_prompt(TASKS["gov_report"].prompt)
    assert context.endswith("Report:\n{context}\n\n")
    assert (question, prefix) == ("Now, write a one-page summary of the report.\n\n", "Summary:")
    assert split_prompt(TASKS["lcc"].prompt)[1:] == ("", "Next line of code:\n")
    assert split_prompt(TASKS["repobench-p"].prompt)[1:] == ("{input}", "Next line of code:\n")
    assert split_prompt(TASKS["passage_count"].prompt)[2] == "The final answer is: "
    assert split_prompt(TASKS["trec"].prompt)[1:] == ("{input}", "")


def test_build_sample_rebuilds_longbench_prompt():
    row = _rows("narrativeqa")[0]
    sample = build_sample("narrativeqa", row, 0)
    full = TASKS["narrativeqa"].prompt.format(context=row["context"], input=row["input"])
    assert sample["context"] + sample["question"] + sample["answer_prefix"] == full
    assert sample["id"] == "narrativeqa-fixture-0" and sample["max_new_tokens"] == 128
    assert sample["answers"] == ["The old gardener", "the gardener"] and sample["all_classes"] == []


def test_few_shot_label_becomes_the_answer_prefix():
    sample = build_sample("trec", _rows("trec")[0], 0)
    assert sample["question"] == "Question: What is the capital of Peru ?\n" and sample["answer_prefix"] == "Type:"
    assert sample["all_classes"][:2] == ["City", "Country"]
    zh = build_sample("lsht", _rows("lsht")[0], 0)
    assert (zh["question"], zh["answer_prefix"]) == ("新闻：球队昨晚赢得了冠军。\n", "类别：")
    # Context with code braces is inserted verbatim.
    code = build_sample("lcc", _rows("lcc")[0], 0)
    assert code["context"].endswith('"""Sum of two numbers."""\n') and code["question"] == ""
    with pytest.raises(ValueError, match="lack the column"):
        build_sample("trec", {"context": "c"}, 0)
    with pytest.raises(ValueError, match="no list of answers"):
        build_sample("trec", {"context": "c", "input": "q", "answers": "City"}, 0)


def test_scores_per_task():
    # "gardener found it" against "gardener" (P 1/3, R 1: F1 0.5) beats "old gardener" (P 1/3, R 1/2: F1 0.4).
    assert score("narrativeqa", " The gardener found it.", ["The old gardener", "the gardener"]) == pytest.approx(50)
    # Few-shot tasks score the first line only (after leading newlines).
    assert postprocess("trec", "\n City\nQuestion: next") == " City"
    assert score("trec", "\nCity\nIndividual", ["City"], ["City", "Individual"]) == 100.0
    assert score("trec", "City or Individual", ["City"], ["City", "Individual"]) == 50.0
    assert score("triviaqa", "Thames\nAnswer: Seine", ["The Thames"]) == 100.0
    assert postprocess("narrativeqa", "a\nb") == "a\nb"
    assert score("passage_retrieval_en", "Paragraph 2", ["Paragraph 2"]) == 100.0
    assert score("passage_count", "3 or 2", ["2"]) == 50.0
    assert score("lcc", "    return a + b\n", ["    return a + b"]) == 100.0
    assert score("passage_retrieval_zh", "段落1", ["段落2"]) == 0.0


def test_loader_from_a_directory(tokenizer):
    tasks = ("narrativeqa", "trec", "passage_count", "lcc")
    samples = BENCHMARKS["longbench"].load(LoadRequest(tasks=tasks, path=str(FIXTURES)), tokenizer)
    assert [s["task"] for s in samples] == [t for t in tasks for _ in range(2)]
    assert [s["id"] for s in samples[:2]] == ["narrativeqa-fixture-0", "narrativeqa-fixture-1"]
    for sample in samples:
        row = next(r for r in _rows(sample["task"]) if r["_id"] == sample["id"])
        assert sample["answers"] == row["answers"]
        assert sample["n_tokens"] == len(f"{sample['context']}\n{sample['question']}\n{sample['answer_prefix']}")
        assert row["context"] in sample["context"]


def test_loader_truncates_contexts_in_the_middle(tokenizer):
    request = LoadRequest(tasks=("narrativeqa",), path=str(FIXTURES), max_context_length=60)
    sample = BENCHMARKS["longbench"].load(request, tokenizer)[0]
    assert len(sample["context"]) == 60
    full = build_sample("narrativeqa", _rows("narrativeqa")[0], 0)["context"]
    assert sample["context"] == full[:30] + full[-30:]  # the instruction's start and the text before the question
    assert sample["question"] == "Question: Who finds the lost key?\n\n"


def test_loader_from_one_file_with_every_task(tokenizer, tmp_path):
    lines = [line for task in FIXTURE_TASKS for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()]
    single = tmp_path / "longbench.jsonl"
    single.write_text("\n".join(lines) + "\n", encoding="utf-8")
    samples = BENCHMARKS["longbench"].load(LoadRequest(tasks=("trec", "lcc"), path=str(single)), tokenizer)
    assert [s["id"] for s in samples] == ["trec-fixture-0", "trec-fixture-1", "lcc-fixture-0", "lcc-fixture-1"]


def test_hub_falls_back_to_data_zip_for_the_script_repository(tokenizer, tmp_path, monkeypatch):
    """datasets >= 4 refuses THUDM/LongBench's loading script: the loader reads data/<task>.jsonl of data.zip."""
    archive = tmp_path / "blobs" / "0123456789abcdef0123"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as handle:
        for task in ("trec", "narrativeqa"):
            handle.write(FIXTURES / f"{task}.jsonl", f"data/{task}.jsonl")
    real_load_dataset = datasets.load_dataset
    hub_calls, downloads = [], []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        if path == "THUDM/LongBench":
            hub_calls.append((name, split))
            raise RuntimeError("Dataset scripts are no longer supported, but found LongBench.py")
        return real_load_dataset(path, name, split=split, **kwargs)

    def fake_download(repo_id, filename, repo_type=None, **kwargs):
        downloads.append((repo_id, filename, repo_type))
        return str(archive)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    samples = BENCHMARKS["longbench"].load(LoadRequest(tasks=("trec",)), tokenizer)
    assert hub_calls == [("trec", "test")] and downloads == [("THUDM/LongBench", "data.zip", "dataset")]
    assert [s["id"] for s in samples] == ["trec-fixture-0", "trec-fixture-1"]
    assert (tmp_path / "cache" / "kvzap_longbench" / "0123456789abcdef" / "data" / "trec.jsonl").is_file()
    with pytest.raises(FileNotFoundError, match="no data/qasper.jsonl"):
        BENCHMARKS["longbench"].load(LoadRequest(tasks=("qasper",)), tokenizer)

    def other_failure(path, name=None, split=None, **kwargs):
        raise ValueError("BuilderConfig 'nope' not found")

    monkeypatch.setattr(datasets, "load_dataset", other_failure)
    with pytest.raises(ValueError, match="BuilderConfig"):  # only the script refusal falls back
        BENCHMARKS["longbench"].load(LoadRequest(tasks=("trec",)), tokenizer)


def test_chinese_qa_uses_jieba_words(monkeypatch):
    # A stand-in segmenter (jieba is optional): one word per character pair.
    fake = types.ModuleType("jieba")
    fake.cut = lambda text, cut_all=False: [text[i : i + 2] for i in range(0, len(text), 2)]
    monkeypatch.setitem(sys.modules, "jieba", fake)
    # "老园丁。" -> ["老园", "丁。"] -> normalised ["老园", "丁"]; the reference gives the same words.
    assert longbench.score("multifieldqa_zh", "老园丁。", ["老园丁"]) == 100.0
    assert longbench.score("multifieldqa_zh", "园丁", ["老园丁"]) == 0.0
    assert longbench.score("vcsum", "会议决定", ["会议决定"]) == 100.0


def test_chinese_qa_without_jieba_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # import jieba raises ImportError
    with pytest.raises(ImportError, match="pip install jieba"):
        longbench.score("dureader", "a", ["b"])
