"""The kv-press-text-generation pipeline against model.generate, multi-question isolation and bad input."""

import logging

import pytest
import torch
from transformers import DynamicCache, pipeline

import kvzap  # noqa: F401  (registers the task)
from kvzap import DMSThresholdPress, RandomScorer
from kvzap._compat import cache_kwarg_name
from kvzap.presses.baseline_scorers import KeyNormScorer
from tests.conftest import char_tokenizer, tiny_model

CONTEXT = "The secret code is 4921. " + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 3


@pytest.fixture
def pipe(llama, tokenizer):
    return pipeline("kv-press-text-generation", model=llama, tokenizer=tokenizer)


def press(decoding=False):
    return DMSThresholdPress(RandomScorer(7), threshold=0.0, sliding_window_size=8, decoding=decoding)


def generate_reference(model, tokenizer, pipe, context, question, the_press, max_new_tokens):
    """Prefill the context under the press, then let model.generate continue from the same cache."""
    inputs = pipe.preprocess(context, [question], "", None, False)
    context_ids, question_ids = inputs["context_ids"], inputs["question_ids"][0]
    cache = DynamicCache(config=model.config)
    with the_press(model):
        model(context_ids, **{cache_kwarg_name(model): cache})
        full = torch.cat([context_ids, question_ids], dim=1)
        out = model.generate(
            full,
            attention_mask=torch.ones_like(full),
            max_new_tokens=max_new_tokens,
            **{cache_kwarg_name(model): cache},
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, full.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("decoding", [False, True])
def test_answer_equals_model_generate_under_the_same_press(llama, tokenizer, pipe, decoding):
    answer = pipe(CONTEXT, question="What is the code?", press=press(decoding), max_new_tokens=12)["answer"]
    reference = generate_reference(llama, tokenizer, pipe, CONTEXT, "What is the code?", press(decoding), 12)
    assert answer == reference


def test_no_press_equals_model_generate(llama, tokenizer, pipe):
    answer = pipe(CONTEXT, question="Why?", max_new_tokens=10)["answer"]
    inputs = pipe.preprocess(CONTEXT, ["Why?"], "", None, False)
    full = torch.cat([inputs["context_ids"], inputs["question_ids"][0]], dim=1)
    out = llama.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=10, do_sample=False)
    assert answer == tokenizer.decode(out[0, full.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("decoding", [False, True])
def test_multiple_questions_equal_separate_calls(pipe, decoding):
    questions = ["What is the code?", "Who wrote this?", "Say something long about it please."]
    the_press = press(decoding)
    together = pipe(CONTEXT, questions=questions, press=the_press, max_new_tokens=8)["answers"]
    separate = [pipe(CONTEXT, question=q, press=press(decoding), max_new_tokens=8)["answer"] for q in questions]
    assert together == separate


def test_compression_ratio_after_the_pipeline(pipe):
    the_press = press()
    pipe(CONTEXT, question="?", press=the_press, max_new_tokens=3)
    assert 0.2 < the_press.compression_ratio < 0.8


def test_truncation_warns(pipe, caplog):
    with caplog.at_level(logging.WARNING, logger="kvzap.pipeline"):
        pipe(CONTEXT, question="?", max_context_length=20, max_new_tokens=2)
    assert "truncated" in caplog.text


def test_works_without_chat_template(llama):
    pipe = pipeline("kv-press-text-generation", model=llama, tokenizer=char_tokenizer(chat_template=False))
    assert isinstance(pipe(CONTEXT, question="Code?", press=press(), max_new_tokens=4)["answer"], str)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"question": "a", "questions": ["b"]}, ValueError, "not both"),
        ({"questions": "a"}, ValueError, "list"),
        ({"press": "kvzap"}, TypeError, "kvzap press"),
        ({"max_new_tokens": 0}, ValueError, "positive"),
        ({"cache": object()}, TypeError, "DynamicCache"),
        ({"temperature": 0.5}, TypeError, "Unknown"),
    ],
)
def test_bad_arguments(pipe, kwargs, error, match):
    with pytest.raises(error, match=match):
        pipe(CONTEXT, **kwargs)


def test_other_families_run_through_the_pipeline(tokenizer):
    for family in ("qwen3", "mistral", "gemma3_text"):
        model = tiny_model(family)
        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
        out = pipe(CONTEXT, questions=["a?", "b?"], press=press(True), max_new_tokens=3)
        assert len(out["answers"]) == 2


def test_chunked_prefill(pipe):
    dense = pipe(CONTEXT, question="Code?", press=press(), max_new_tokens=6)["answer"]
    one_chunk = pipe(CONTEXT, question="Code?", press=press(), max_new_tokens=6, prefill_chunk_size=10_000)["answer"]
    assert one_chunk == dense
    the_press = press()
    out = pipe(CONTEXT, question="Code?", press=the_press, max_new_tokens=6, prefill_chunk_size=32)
    assert isinstance(out["answer"], str) and the_press.compression_ratio > 0.2
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        pipe(CONTEXT, question="?", prefill_chunk_size=0)


def _prefill_forwards(model, call):
    """The widths of the forwards ``call()`` runs before its first one-token forward (prefill chunks, question)."""
    widths = []

    def record(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(ids.shape[1])

    hook = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        call()
    finally:
        hook.remove()
    return widths[: widths.index(1)] if 1 in widths else widths


def test_the_prefill_is_one_forward_unless_chunks_are_asked_for(pipe, llama):
    """Chunks lose needles at 4k (evaluation/results/smollm2-135m-4k-n40-chunked): every press's default is one
    forward, and an explicit size chunks."""
    from kvzap import KVzipPlusScorer, TopKPress

    n_context = pipe.preprocess(CONTEXT, ["Code?"], "", None, False)["context_ids"].shape[1]
    chunked = _prefill_forwards(
        llama, lambda: pipe(CONTEXT, question="Code?", press=press(), max_new_tokens=2, prefill_chunk_size=64)
    )
    assert chunked[:-1] == [64] * (n_context // 64) + ([n_context % 64] if n_context % 64 else [])
    # One forward: by default ("auto"), when asked (None), with no press, for a press that decides over the whole
    # prompt, and when the threshold evicts nothing.
    for kwargs in (
        dict(press=press()),
        dict(press=press(), prefill_chunk_size="auto"),
        dict(press=press(), prefill_chunk_size=None),
        dict(),
        dict(press=TopKPress(RandomScorer(0), target_compression=0.5)),
        dict(press=DMSThresholdPress(RandomScorer(0), threshold=float("-inf"))),
    ):
        widths = _prefill_forwards(llama, lambda kw=kwargs: pipe(CONTEXT, question="Code?", max_new_tokens=2, **kw))
        assert widths[0] == n_context, kwargs
    assert DMSThresholdPress(KVzipPlusScorer(), threshold=-3).default_prefill_chunk_size is None
    assert press().default_prefill_chunk_size is None
    # Without a press, an explicit size chunks the prefill in transformers' cache, with the one forward's answer.
    plain = _prefill_forwards(llama, lambda: pipe(CONTEXT, question="Code?", max_new_tokens=2, prefill_chunk_size=64))
    assert plain == chunked
    one = pipe(CONTEXT, question="Code?", max_new_tokens=4)["answer"]
    assert pipe(CONTEXT, question="Code?", max_new_tokens=4, prefill_chunk_size=64)["answer"] == one
    with pytest.raises(ValueError, match="'auto'"):
        pipe(CONTEXT, question="?", prefill_chunk_size="dense")


CONTEXTS = [
    "The cat sat on the mat while the dog slept by the fire, dreaming of bones.",
    "Paris is the capital of France.",
    "A long time ago, in a galaxy far away, rebels fought an empire across many stars and moons.",
]


@pytest.mark.parametrize("storage", ["compact", "masked"])
@pytest.mark.parametrize("decoding", [False, True])
@pytest.mark.parametrize("batch_size", [2, 3])
def test_a_list_of_contexts_equals_one_at_a_time_calls(pipe, storage, decoding, batch_size):
    questions = [["Who slept?", "Where?"], ["What is the capital?"], ["Who fought?", "Where?"]]
    p = DMSThresholdPress(KeyNormScorer(), threshold=-0.7, sliding_window_size=8, decoding=decoding, storage=storage)
    batched = pipe(CONTEXTS, questions=questions, press=p, max_new_tokens=6, batch_size=batch_size)
    alone = [pipe(c, questions=q, press=p, max_new_tokens=6) for c, q in zip(CONTEXTS, questions, strict=True)]
    assert batched == alone
    assert any(a for r in alone for a in r["answers"])  # the answers are not all empty


def test_a_list_of_contexts_shares_questions_and_runs_without_press(pipe):
    batched = pipe(CONTEXTS, question="Who?", max_new_tokens=5, batch_size=3)
    assert batched == [pipe(c, question="Who?", max_new_tokens=5) for c in CONTEXTS]
    p = DMSThresholdPress(KeyNormScorer(), threshold=-0.7, sliding_window_size=8)  # a per-pair scorer
    shared = pipe(CONTEXTS, questions=["Who?", "Why?"], press=p, max_new_tokens=4, batch_size=2)
    assert shared == [pipe(c, questions=["Who?", "Why?"], press=p, max_new_tokens=4) for c in CONTEXTS]


def test_every_forward_runs_without_autograd(pipe, llama):
    """A list of contexts and a handed-in cache reach the model past transformers' own no-grad wrapper: with
    autograd on, every cached pair would hold the graph of the forwards before it (an HQQ-cache evaluation grew
    ~350 MB a step on SmolLM2)."""
    assert any(p.requires_grad for p in llama.parameters())
    seen = []
    handle = llama.register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    try:
        pipe(CONTEXTS[:2], question="Who?", press=press(), max_new_tokens=3, batch_size=2)
        pipe(CONTEXTS[0], question="Who?", max_new_tokens=3, cache=DynamicCache())
        inputs = pipe.preprocess(CONTEXTS[1], ["Who?"], "", None, False)
        cache = DynamicCache()
        pipe._forward(inputs, press=press(), max_new_tokens=3, cache=cache)  # as kvzap evaluate's caches call it
    finally:
        handle.remove()
    assert seen and not any(seen)
    assert torch.is_grad_enabled()  # the caller's mode is restored


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"questions": [["a"], ["b"]]}, ValueError, "2 lists for 3 contexts"),
        ({"questions": [["a"], "b", ["c"]]}, TypeError, "mixes lists and strings"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive int"),
        ({"batch_size": 1.5}, TypeError, "batch_size must be an int"),
        ({"cache": DynamicCache()}, ValueError, "cannot be used with a list of contexts"),
    ],
)
def test_bad_list_arguments(pipe, kwargs, error, match):
    with pytest.raises(error, match=match):
        pipe(CONTEXTS, **kwargs)


def test_a_list_holding_a_non_string_is_refused(pipe):
    with pytest.raises(TypeError, match="contexts must be strings"):
        pipe(["a", 3])
    with pytest.raises(ValueError, match="empty"):
        pipe([])
