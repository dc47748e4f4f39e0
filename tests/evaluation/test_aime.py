"""AIME 2025: samples, seeded sampled decoding under a press that prunes while decoding, boxed scoring."""

import pytest
import torch

from evaluation.aime import SamplingSettings, build_sample, generate, prompt_ids, sample_seed, score
from kvzap import DMSThresholdPress, KVzapScorer
from kvzap.surrogates import KVzapSurrogate
from tests.conftest import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


SAMPLE = build_sample({"id": "p1", "question": "What is 6 times 7?", "answer": 42}, 0)


def test_build_sample():
    assert SAMPLE == {
        "task": "aime25",
        "id": "p1",
        "context": "What is 6 times 7?",
        "question": "",
        "answer_prefix": "",
        "answers": ["42"],
        "max_new_tokens": 32000,
    }
    assert build_sample({"question": "q", "answer": " 7 "}, 3)["id"] == "aime25-3"
    with pytest.raises(ValueError, match="question and answer"):
        build_sample({"problem": "q", "answer": 1}, 0)


def test_prompt_is_the_chat_turn(tokenizer):
    ids = prompt_ids(tokenizer, SAMPLE)[0].tolist()
    assert tokenizer.decode(ids) == "<|user|>What is 6 times 7?<|end|><|assistant|>"
    plain = char_tokenizer(chat_template=False)
    # Its `tokenizer(text)` never prepends its bos_token "<s>", so neither does the prompt (kvzap.prompts).
    assert plain.decode(prompt_ids(plain, SAMPLE)[0].tolist()) == "What is 6 times 7?\n"


def test_sampling_settings_validation():
    SamplingSettings().validate()
    for bad in (dict(temperature=0), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0)):
        with pytest.raises(ValueError):
            SamplingSettings(**bad).validate()


def test_seed_depends_on_seed_and_id_only():
    assert sample_seed(0, "p1") == sample_seed(0, "p1") != sample_seed(1, "p1") != sample_seed(0, "p2")
    assert 0 <= sample_seed(5, "x") < 2**63


def test_generate_is_seeded_and_samples(model, tokenizer):
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0)
    first = generate(model, tokenizer, SAMPLE, None, max_new_tokens=12, sampling=settings, seed=0)
    torch.manual_seed(123)  # the global random state before the call does not matter
    assert generate(model, tokenizer, SAMPLE, None, max_new_tokens=12, sampling=settings, seed=0) == first
    others = {generate(model, tokenizer, SAMPLE, None, max_new_tokens=12, sampling=settings, seed=s) for s in (1, 2, 3)}
    assert len(others | {first}) > 1  # sampling, not greedy decoding


def test_press_prunes_while_generating(model, tokenizer, tmp_path):
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2).save_pretrained(tmp_path)
    # Every score is below 100: everything outside the 4-token window is evicted, generated tokens included.
    press = DMSThresholdPress(KVzapScorer("linear", surrogate=tmp_path), 100.0, sliding_window_size=4, decoding=True)
    settings = SamplingSettings()
    answer = generate(model, tokenizer, SAMPLE, press, max_new_tokens=16, sampling=settings, seed=0)
    assert isinstance(answer, str) and press.compression_ratio > 0.5
    full = generate(model, tokenizer, SAMPLE, None, max_new_tokens=16, sampling=settings, seed=0)
    assert answer != full  # the pruned cache changes what is sampled


def test_score():
    assert score("so \\boxed{042}", ["42"]) == 100.0
    assert score("\\boxed{41}", ["42"]) == 0.0
    assert score("42", ["42"]) == 0.0
