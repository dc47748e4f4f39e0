"""One BOS/chat-template rule for collection, calibration, the pipeline and evaluation (issue 14 part 3).

Three kinds of tokenizer, built offline: SmolLM2-like (its chat template opens with ``<|im_start|>``, its
``bos_token``), Gemma-3-like (``add_bos_token`` False, but a post-processor prepends ``<bos>``; with and without
a template that writes ``{{ bos_token }}`` itself), and one without a chat template whose ``bos_token`` is never
prepended. Each place that builds a prompt must open it with the same token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evaluation import aime
from evaluation.runner import load_config, run_evaluation
from kvzap import KVzapScorer, KVzapSurrogate
from kvzap.calibrate import collect_scores
from kvzap.kvzip import build_prefill_repeat_prompt, build_repeat_prompt
from kvzap.pipeline import KVPressTextGenerationPipeline
from kvzap.prompts import context_ids, starts_with_bos, with_bos
from tests.conftest import char_tokenizer, tiny_model

TEXT = "The launch code is 7384. Keep it safe."

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else "
    "m['role']) + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _char_level(specials: list[str], bos: str, eos: str, *, prepend_bos: bool, chat_template: str | None):
    """A character-level fast tokenizer (ids < 128, as the tiny models' vocabulary); specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=specials[0])
    tokenizer.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in (bos, eos)]})
    if prepend_bos:
        # What Gemma 3's tokenizer does: add_bos_token says False, its post-processor prepends BOS anyway. The flag
        # is set first: setting it rebuilds the post-processor in recent transformers.
        tokenizer.add_bos_token = False
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def smollm2_like():
    return _char_level(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>", prepend_bos=False,
        chat_template=CHATML,
    )  # fmt: skip


def gemma3_like(chat_template: str | None):
    specials = ["<unk>", "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
    return _char_level(specials, "<bos>", "<eos>", prepend_bos=True, chat_template=chat_template)


TOKENIZERS = {
    "smollm2-like": (smollm2_like, True),
    "gemma3-like base (no template)": (lambda: gemma3_like(None), True),
    "gemma3-like with template": (lambda: gemma3_like(GEMMA), True),
    "no template, bos never prepended": (lambda: char_tokenizer(chat_template=False), False),
}


def first_tokens(tokenizer, model, tmp_path: Path, monkeypatch) -> dict[str, list[int]]:
    """The opening token ids of the same text as each part of kvzap builds its prompt."""
    opened: dict[str, list[int]] = {}
    prompt = tokenizer.encode(TEXT, add_special_tokens=False)  # train/data.py's prompt ids
    opened["collection"] = build_repeat_prompt(tokenizer, prompt).input_ids.tolist()

    seen: list[list[int]] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"][0].tolist()), with_kwargs=True
    )
    try:
        collect_scores(model, tokenizer, KVzapScorer("linear", KVzapSurrogate(64, 2, 2)), [TEXT])
    finally:
        hook.remove()
    opened["calibration"] = seen[0]

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    inputs = pipe.preprocess(TEXT, ["Code?"], "", None, None)
    opened["pipeline"] = inputs["context_ids"][0].tolist()

    sample = {"context": TEXT, "question": "", "answer_prefix": ""}
    opened["evaluation (aime25)"] = aime.prompt_ids(tokenizer, sample)[0].tolist()
    # The greedy benchmarks go through the pipeline: spy on what a real sweep prefills.
    prefills: list[list[int]] = []
    original = KVPressTextGenerationPipeline._forward

    def spy(self, inputs, *args, **kwargs):
        prefills.append(inputs["context_ids"][0].tolist())
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward", spy)
    config = load_config(
        output_dir=str(tmp_path / "eval"), presses=["no_press"], tasks=["niah_single"], lengths=[400], n_samples=1,
        max_new_tokens=1,
    )  # fmt: skip
    run_evaluation(config, model, tokenizer)
    opened["evaluation (ruler_offline)"] = prefills[0]
    return opened


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_first_token_agrees_everywhere(name, tmp_path, monkeypatch):
    build, expects_bos = TOKENIZERS[name]
    tokenizer = build()
    if "gemma3" in name:  # the fixture has the property that misled the old rule
        assert not tokenizer.add_bos_token and tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    assert starts_with_bos(tokenizer) is expects_bos
    opened = first_tokens(tokenizer, tiny_model("llama"), tmp_path, monkeypatch)
    firsts = {where: ids[0] for where, ids in opened.items()}
    bos = tokenizer.bos_token_id
    assert all((first == bos) is expects_bos for first in firsts.values()), firsts
    if tokenizer.chat_template or expects_bos:  # without either, each prompt opens with its own text
        assert len(set(firsts.values())) == 1, firsts
    for where, ids in opened.items():  # never a doubled BOS (a template that writes it + the rule)
        assert ids[:2] != [bos, bos], where
    if tokenizer.chat_template:
        # Stronger: the repeat prompt of the pipeline's prefill is the collection's prompt, token for token, so
        # surrogates are trained on exactly the pairs they score.
        pipeline_prompt = build_prefill_repeat_prompt(tokenizer, opened["pipeline"]).input_ids.tolist()
        assert pipeline_prompt == opened["collection"]
        assert opened["calibration"] == opened["pipeline"]


def test_with_bos_adds_it_once():
    gemma = gemma3_like(None)
    bos = gemma.bos_token_id
    assert with_bos(gemma, [5, 6]) == [bos, 5, 6] and with_bos(gemma, [bos, 5]) == [bos, 5] and with_bos(gemma, [])
    plain = char_tokenizer(chat_template=False)
    assert with_bos(plain, [5, 6]) == [5, 6]
    ids, suffix = context_ids(plain, "abc")
    assert plain.decode(ids) == "abc" and suffix == "\n"


REAL_SMOLLM2 = Path.home() / ".cache" / "kvzap" / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.slow
@pytest.mark.skipif(not (REAL_SMOLLM2 / "tokenizer_config.json").is_file(), reason=f"no {REAL_SMOLLM2}")
def test_real_smollm2_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REAL_SMOLLM2)
    model = tiny_model("llama", vocab_size=len(tokenizer))  # random weights: only the prompts matter here
    opened = first_tokens(tokenizer, model, tmp_path, monkeypatch)
    firsts = {where: ids[0] for where, ids in opened.items()}
    assert set(firsts.values()) == {tokenizer.convert_tokens_to_ids("<|im_start|>")}, firsts
    assert build_prefill_repeat_prompt(tokenizer, opened["pipeline"]).input_ids.tolist() == opened["collection"]


def test_pipeline_prefill_is_a_long_tensor():
    inputs = KVPressTextGenerationPipeline(model=tiny_model("llama"), tokenizer=smollm2_like()).preprocess(
        TEXT, ["q"], "", None, None
    )
    assert inputs["context_ids"].dtype == torch.long and inputs["context_ids"].shape[0] == 1
