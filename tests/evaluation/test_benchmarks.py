"""The dataset registry: Hub and local reading, fractions, RULER from the Hub, AIME loading; all offline."""

import json
from pathlib import Path

import datasets
import pytest

from evaluation.benchmarks import (
    BENCHMARKS,
    RULER_HUB_TASKS,
    LoadRequest,
    check_local_path,
    count_tokens,
    local_data_file,
    read_rows,
    select_fraction,
    truncate_middle,
)
from tests.conftest import char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
RULER_DIR = FIXTURES / "ruler"
AIME_DIR = FIXTURES / "aime25"


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_registry():
    assert list(BENCHMARKS) == ["ruler_offline", "ruler", "longbench", "aime25"]
    assert BENCHMARKS["ruler"].hub_id == "simonjegou/ruler" and BENCHMARKS["ruler"].uses_lengths
    assert len(RULER_HUB_TASKS) == 13 and BENCHMARKS["ruler"].default_tasks == RULER_HUB_TASKS
    assert BENCHMARKS["longbench"].hub_id == "THUDM/LongBench" and BENCHMARKS["longbench"].truncation == "middle"
    assert len(BENCHMARKS["longbench"].default_tasks) == 16 and len(BENCHMARKS["longbench"].tasks) == 21
    assert BENCHMARKS["aime25"].sampled and not BENCHMARKS["longbench"].sampled
    assert BENCHMARKS["ruler_offline"].hub_id is None


def test_local_data_file(tmp_path):
    assert local_data_file(RULER_DIR, "512") == RULER_DIR / "512.jsonl"
    assert local_data_file(RULER_DIR / "512.jsonl", "4096") == RULER_DIR / "512.jsonl"  # a file serves any config
    (tmp_path / "8192.parquet").write_bytes(b"")
    assert local_data_file(tmp_path, "8192") == tmp_path / "8192.parquet"
    with pytest.raises(FileNotFoundError, match=r"4096\.jsonl, 4096\.json, 4096\.parquet"):
        local_data_file(RULER_DIR, "4096")
    with pytest.raises(FileNotFoundError, match="No dataset file or directory"):
        local_data_file(tmp_path / "missing", "x")


def test_read_rows_local_and_hub(monkeypatch):
    rows = read_rows("simonjegou/ruler", "512", RULER_DIR)
    assert rows == _jsonl(RULER_DIR / "512.jsonl")
    # Without a path, the Hub is read with load_dataset(hub_id, config, split="test"): intercepted here.
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        return datasets.Dataset.from_list(rows[:2])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert read_rows("simonjegou/ruler", "4096", None) == rows[:2]
    assert calls == [("simonjegou/ruler", "4096", "test", {})]


def test_parquet_is_read_like_jsonl(tmp_path):
    rows = _jsonl(AIME_DIR / "aime25.jsonl")
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "aime25.parquet")
    assert read_rows("alessiodevoto/aime25", None, tmp_path) == rows


def test_select_fraction_is_deterministic_per_key():
    assert select_fraction(10, 1.0, "k") == list(range(10))
    picked = select_fraction(10, 0.3, "0/ruler/4096/vt")
    assert len(picked) == 3 and picked == sorted(picked) and picked == select_fraction(10, 0.3, "0/ruler/4096/vt")
    assert len({tuple(select_fraction(10, 0.3, f"{seed}/x")) for seed in range(8)}) > 1  # the seed matters
    assert select_fraction(3, 0.01, "k") != []  # at least one sample per task
    assert len(select_fraction(4, 0.5, "k")) == 2


def test_ruler_hub_loader(tokenizer):
    request = LoadRequest(tasks=("niah_single_1", "vt", "qa_1"), length=512, path=str(RULER_DIR))
    samples = BENCHMARKS["ruler"].load(request, tokenizer)
    rows = _jsonl(RULER_DIR / "512.jsonl")
    assert [s["task"] for s in samples] == ["niah_single_1"] * 4 + ["vt"] * 2 + ["qa_1"] * 2
    assert [s["id"] for s in samples[:2]] == ["niah_single_1-512-0", "niah_single_1-512-1"]
    for sample, row in zip(samples, rows, strict=True):
        assert sample["context"] == row["context"] and sample["question"] == row["question"]
        assert sample["answer_prefix"] == row["answer_prefix"] and sample["answers"] == row["answer"]
        assert sample["max_new_tokens"] == row["max_new_tokens"]
        assert (
            sample["n_tokens"]
            == count_tokens(tokenizer, sample)
            == len(f"{row['context']}\n{row['question']}\n{row['answer_prefix']}")
        )  # one token per character
    # Task subset and fraction: half of each task, at least one, the same for the same seed.
    half = BENCHMARKS["ruler"].load(
        LoadRequest(tasks=("vt", "niah_single_1"), length=512, path=str(RULER_DIR), fraction=0.5, seed=3), tokenizer
    )
    assert [s["task"] for s in half] == ["vt", "niah_single_1", "niah_single_1"]
    again = BENCHMARKS["ruler"].load(
        LoadRequest(tasks=("vt", "niah_single_1"), length=512, path=str(RULER_DIR), fraction=0.5, seed=3), tokenizer
    )
    assert [s["id"] for s in again] == [s["id"] for s in half]


def test_ruler_hub_loader_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no sample of the task"):
        BENCHMARKS["ruler"].load(LoadRequest(tasks=("cwe",), length=512, path=str(RULER_DIR)), tokenizer)
    bad = tmp_path / "512.jsonl"
    bad.write_text(json.dumps({"context": "c", "question": "q", "task": "vt"}) + "\n")
    with pytest.raises(ValueError, match="lack the column"):
        BENCHMARKS["ruler"].load(LoadRequest(tasks=("vt",), length=512, path=str(tmp_path)), tokenizer)


def test_ruler_hub_scores_like_ruler():
    score = BENCHMARKS["ruler"].score
    niah = {"task": "niah_multikey_2", "answers": ["123", "456"]}
    assert score(niah, " 123 and 456.") == 100.0 and score(niah, "123") == 50.0
    # QA tasks: any reference counts; control characters become line breaks and do not join numbers.
    assert score({"task": "qa_2", "answers": ["Paris", "Rome"]}, "rome") == 100.0
    assert score({"task": "niah_single_1", "answers": ["1234"]}, "12\x0034") == 0.0
    assert score({"task": "vt", "answers": ["ABC"]}, "\x01abc\x02") == 100.0


def test_aime_loader(tokenizer):
    samples = BENCHMARKS["aime25"].load(LoadRequest(tasks=("aime25",), path=str(AIME_DIR)), tokenizer)
    assert [s["id"] for s in samples] == ["fixture-1", "fixture-2", "fixture-3"]
    assert samples[0]["context"].startswith("Find the remainder") and samples[0]["question"] == ""
    assert samples[2]["answers"] == ["400"] and samples[0]["max_new_tokens"] == 32000
    assert BENCHMARKS["aime25"].score(samples[2], "so \\boxed{400}.") == 100.0
    subset = BENCHMARKS["aime25"].load(LoadRequest(tasks=("aime25",), path=str(AIME_DIR), fraction=0.34), tokenizer)
    assert len(subset) == 1


def test_check_local_path():
    check_local_path(BENCHMARKS["ruler"], str(RULER_DIR), RULER_HUB_TASKS, [512])
    with pytest.raises(ValueError, match="4096.jsonl"):
        check_local_path(BENCHMARKS["ruler"], str(RULER_DIR), RULER_HUB_TASKS, [512, 4096])
    with pytest.raises(ValueError, match="holds one length"):
        check_local_path(BENCHMARKS["ruler"], str(RULER_DIR / "512.jsonl"), RULER_HUB_TASKS, [512, 4096])
    with pytest.raises(ValueError, match="qasper"):
        check_local_path(BENCHMARKS["longbench"], str(FIXTURES / "longbench"), ("narrativeqa", "qasper"), [None])
    with pytest.raises(ValueError, match="generated offline"):
        check_local_path(BENCHMARKS["ruler_offline"], str(RULER_DIR), ("vt",), [512])


def test_truncate_middle(tokenizer):
    text = "abcdefghij"
    assert truncate_middle(tokenizer, text, 20) == text
    assert truncate_middle(tokenizer, text, 4) == "abij"
    assert truncate_middle(tokenizer, text, 5) == "abhij"
