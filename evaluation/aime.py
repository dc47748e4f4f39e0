"""AIME 2025: 30 competition math problems, answered with sampled decoding under a press that prunes while decoding.

The problems come from ``alessiodevoto/aime25`` (split ``test``, columns ``question`` and ``answer``, the dataset
KVzap's ``evaluate_aime.py`` uses) or a local file with the same columns. Each problem is the user turn of the
chat template (the problem text alone, as in KVzap's script); the answer is generated with
``model.generate(do_sample=True, ...)`` inside ``with press(model):``, so a threshold press built with
``decoding=True`` prunes the reasoning tokens as they are generated, which is where the cache grows for this
benchmark. The default sampling settings are those of KVzap's script (Qwen3's recommended thinking-mode
settings): temperature 0.6, top-p 0.95, top-k 20, min-p 0, at most 32,000 new tokens.

A sample is scored 100 when the last ``\\boxed{...}`` of the generation equals the reference answer as an integer
(:func:`evaluation.metrics.boxed_match`), else 0.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any

from kvzap.prompts import context_ids

from .metrics import boxed_match

__all__ = ["HUB_ID", "TASK", "MAX_NEW_TOKENS", "SamplingSettings", "build_sample", "generate", "score"]

#: The Hub dataset (split ``test``; columns ``question``, ``answer``).
HUB_ID = "alessiodevoto/aime25"
#: The benchmark's only task.
TASK = "aime25"
#: Default generation budget (reasoning models think for thousands of tokens).
MAX_NEW_TOKENS = 32000


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling parameters of ``model.generate``.

    Parameters
    ----------
    temperature : softmax temperature, > 0.
    top_p : nucleus mass in (0, 1].
    top_k : keep the k most likely tokens; 0 disables it.
    min_p : drop tokens below ``min_p`` times the top probability; 0 disables it.
    """

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` for a value ``generate`` would reject or misread."""
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampled decoding, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}.")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}.")


def build_sample(row: dict[str, Any], index: int) -> dict[str, Any]:
    """One problem as an evaluation sample (without ``n_tokens``): the problem is the context, no question.

    Parameters
    ----------
    row : ``question`` (the problem), ``answer`` (int or str) and optionally ``id``.
    index : position in the dataset, used in the id when ``id`` is missing.
    """
    missing = [c for c in ("question", "answer") if c not in row]
    if missing:
        raise ValueError(f"AIME rows need the columns question and answer; missing: {', '.join(missing)}.")
    return {
        "task": TASK,
        "id": str(row.get("id") if row.get("id") not in (None, "") else f"{TASK}-{index}"),
        "context": str(row["question"]),
        "question": "",
        "answer_prefix": "",
        "answers": [str(row["answer"]).strip()],
        "max_new_tokens": MAX_NEW_TOKENS,
    }


def prompt_ids(tokenizer: Any, sample: dict[str, Any]):
    """Token ids ``(1, n)`` of the prompt: the chat template around the problem, then the answer prefix."""
    import torch

    # The chat turn and BOS rule of the pipeline (kvzap.prompts), with the problem as the context.
    ids, suffix = context_ids(tokenizer, sample["context"] + sample["question"])
    ids += tokenizer.encode(suffix + sample["answer_prefix"], add_special_tokens=False)
    return torch.tensor([ids], dtype=torch.long)


def sample_seed(seed: int, sample_id: str) -> int:
    """A 63-bit seed from the sweep seed and the sample id (stable across runs, processes and sample order)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{sample_id}".encode()).digest()[:8], "big") >> 1


def generate(
    model: Any,
    tokenizer: Any,
    sample: dict[str, Any],
    press: Any,
    *,
    max_new_tokens: int,
    sampling: SamplingSettings,
    seed: int,
) -> str:
    """Sample one answer with ``model.generate`` while ``press`` (or none) is applied to the model.

    The random state is seeded from ``(seed, sample id)`` before generating, so a sample's answer does not
    depend on which samples ran before it.

    Parameters
    ----------
    model, tokenizer : the model under test.
    sample : from :func:`build_sample`.
    press : a kvzap press (threshold presses should have ``decoding=True``), or None for the full cache.
    max_new_tokens : generation budget.
    sampling : temperature, top-p, top-k, min-p.
    seed : the sweep's seed.

    Returns
    -------
    str, the decoded generated tokens (special tokens skipped).
    """
    import torch

    ids = prompt_ids(tokenizer, sample).to(model.device)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    torch.manual_seed(sample_seed(seed, sample["id"]))
    with press(model) if press is not None else contextlib.nullcontext():
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=int(sampling.top_k),
            min_p=sampling.min_p or None,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
        )
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def score(prediction: str, answers: list[str]) -> float:
    """100.0 when the last boxed answer of ``prediction`` equals the reference (as an integer), else 0.0."""
    return 100.0 * max(boxed_match(prediction, answer) for answer in answers)
