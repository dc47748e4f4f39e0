"""The ``kv-press-text-generation`` pipeline: prefill a long context under a press, then answer questions.

The context is prefilled once under the press; each question is then answered greedily against that same
compressed context, with true RoPE positions (a question starts at the context's length, whatever was evicted).
Between questions the cache and the press's per-sequence state are restored to their state right after the
prefill, so neither a question's tokens nor decoding-time evictions leak into the next answer.

A list of contexts is prefilled ``batch_size`` at a time as one left-padded batch (each row pruned on its own,
its padding never stored); each row's questions are then answered one at a time on that row of the cache
(restored, then selected), so the answers are those of one-at-a-time calls.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from kvzap import _compat, prompts
from kvzap.cache import restore_cache, snapshot_cache
from kvzap.presses.base import BasePress, as_bool, as_number

logger = logging.getLogger(__name__)

__all__ = ["KVPressTextGenerationPipeline", "TASK_NAME", "register_pipeline"]

TASK_NAME = "kv-press-text-generation"


class KVPressTextGenerationPipeline(Pipeline):
    """Answer questions about a long context whose KV cache is pruned by a press.

    Call with ``pipe(context, question=..., press=...)`` (returns ``{"answer": str}``) or
    ``pipe(context, questions=[...], press=...)`` (returns ``{"answers": list[str]}``).

    ``pipe([context, ...], ..., batch_size=N)`` answers several contexts and returns one such dict per context, in
    order; their contexts are prefilled ``N`` at a time (default 1) as a left-padded batch. ``question=`` (a
    string) or ``questions=[...]`` (strings) are asked of every context; ``questions=[[...], [...]]`` (one list
    of strings per context, as many lists as contexts) gives each context its own. ``cache=`` is refused with a
    list (each batch gets its own cache). The press's statistics afterwards are those of the last answer.

    Parameters (call-time)
    ----------------------
    question / questions : one question, or several answered against the same compressed context.
    answer_prefix : text the answer starts with (after the chat template's generation prompt).
    press : a kvzap press, or None for a full cache.
    max_new_tokens : int, default 50.
    max_context_length : int, the context is truncated (with a warning) beyond this many tokens.
    enable_thinking : bool, passed to chat templates that support it (Qwen3).
    cache : an empty ``transformers.DynamicCache`` to fill (one is created when None); a cache that already holds
        tokens is refused (ValueError), since the context starts at position 0.
    prefill_chunk_size : int, None or ``"auto"`` (default). An int prefills the context in chunks of this many
        tokens, each pruned after its forward, so that later chunks attend to the kept pairs only: the first
        token comes sooner on long contexts (:data:`~kvzap.presses.threshold.PREFILL_CHUNK_SIZE`, 1024, is the
        fastest measured), and the cache stays near its pruned size during prefill, but on the 4k needle suite
        it loses needles against one forward at the same threshold. None prefills densely in one forward (the
        paper's setting). ``"auto"`` takes the press's ``default_prefill_chunk_size``: one forward for every
        press kvzap ships. Without a press, an int chunks the prefill too (nothing is pruned; on sliding-window
        layers each chunk then reads only the window and itself), and ``"auto"`` is one forward.
    """

    def __call__(self, context, *args, batch_size: int | None = None, **kwargs):
        """One context (a string), or a list of them answered ``batch_size`` at a time (see the class docstring)."""
        if batch_size is not None:
            batch_size = as_number("batch_size", batch_size, integer=True)
            if batch_size < 1:
                raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        if not isinstance(context, (list, tuple)):
            return super().__call__(context, *args, **kwargs)
        if args:
            raise TypeError("Pass the pipeline's options by keyword (question=, press=, ...) with a list of contexts.")
        return self._call_many(list(context), batch_size or 1, kwargs)

    def _call_many(self, contexts: list, batch_size: int, kwargs: dict) -> list[dict]:
        if not contexts:
            raise ValueError("The list of contexts is empty: pass at least one context.")
        wrong = sorted({type(c).__name__ for c in contexts if not isinstance(c, str)})
        if wrong:
            raise TypeError(f"contexts must be strings, got {', '.join(wrong)} in the list.")
        if kwargs.get("cache") is not None:
            raise ValueError(
                "cache= cannot be used with a list of contexts (each batch of contexts gets its own cache): "
                "call the pipeline once per context to fill your own cache."
            )
        questions = kwargs.pop("questions", None)
        per_context: list[dict] = []
        if isinstance(questions, (list, tuple)) and questions and all(isinstance(q, (list, tuple)) for q in questions):
            if len(questions) != len(contexts):
                raise ValueError(
                    f"questions holds {len(questions)} lists for {len(contexts)} contexts: pass one list of questions "
                    "per context, or one list of strings asked of every context."
                )
            per_context = [{"questions": q} for q in questions]
        elif questions is not None:
            if any(isinstance(q, (list, tuple)) for q in questions):
                raise TypeError(
                    "questions mixes lists and strings: pass one list of questions per context, or one list of "
                    "strings asked of every context."
                )
            per_context = [{"questions": questions}] * len(contexts)
        else:
            per_context = [{}] * len(contexts)
        calls = []
        for context, extra in zip(contexts, per_context, strict=True):
            pre, forward, post = self._sanitize_parameters(**kwargs, **extra)
            calls.append((self.preprocess(context, **pre), forward, post))
        results = []
        for first in range(0, len(calls), batch_size):
            group = calls[first : first + batch_size]
            answers = self._forward_batch([inputs for inputs, _, _ in group], **group[0][1])
            results += [self.postprocess(a, **post) for a, (_, _, post) in zip(answers, group, strict=True)]
        return results

    @torch.no_grad()
    def _forward_batch(
        self,
        rows: list[dict],
        press: BasePress | None = None,
        max_new_tokens: int = 50,
        cache=None,
        prefill_chunk_size: int | str | None = "auto",
    ) -> list[list[str]]:
        """Prefill the rows' contexts as one left-padded batch, then answer each row's questions on its row."""
        model = self.model
        lengths = [r["context_ids"].shape[1] for r in rows]
        width = max(lengths)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - lengths[b] :] = r["context_ids"][0]
            mask[b, width - lengths[b] :] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # each row's own positions, as generate derives them
        cache = _compat.new_dynamic_cache(model)
        cache_kw = _compat.cache_kwarg_name(model)
        chunk = _chunk_size(press, prefill_chunk_size) or width
        chunked = chunk < width and press is not None
        # The first chunk holds all the padding (a row may not start with a chunk of padding only): the padding
        # is then evicted by that chunk's dense prefill, never stored.
        pad_max = width - min(lengths)
        bounds = [0, *range(min(pad_max + chunk, width), width, chunk), width]
        answers: list[list[str]] = []
        with press(model) if press is not None else contextlib.nullcontext():
            with press.prefilling() if chunked else contextlib.nullcontext():
                for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                    model(
                        input_ids=ids[:, start:end],
                        attention_mask=mask[:, :end],
                        position_ids=positions[:, start:end],
                        use_cache=True,
                        logits_to_keep=1,
                        **{cache_kw: cache},
                    )
            single = len(rows) == 1 and len(rows[0]["question_ids"]) == 1
            checkpoint = None if single else snapshot_cache(cache)
            for b, r in enumerate(rows):
                row_answers = []
                for question_ids in r["question_ids"]:
                    if checkpoint is not None:
                        restore_cache(cache, checkpoint)
                        if len(rows) > 1:
                            cache.batch_select_indices(torch.tensor([b], device=model.device))
                    question_ids = question_ids.to(model.device)
                    pad = width - lengths[b]
                    row_answers.append(self._answer(question_ids, cache, cache_kw, lengths[b], max_new_tokens, pad))
                answers.append(row_answers)
        return answers

    def _sanitize_parameters(
        self,
        question: str | None = None,
        questions: list[str] | None = None,
        answer_prefix: str | None = None,
        press: BasePress | None = None,
        max_new_tokens: int = 50,
        max_context_length: int | None = None,
        enable_thinking: bool = False,
        cache: DynamicCache | None = None,
        prefill_chunk_size: int | str | None = "auto",
        **kwargs: Any,
    ):
        if kwargs:
            raise TypeError(f"Unknown argument(s) for {TASK_NAME}: {', '.join(sorted(kwargs))}.")
        if question is not None and questions is not None:
            raise ValueError("Pass either `question` or `questions`, not both.")
        if question is not None and not isinstance(question, str):
            raise TypeError(f"question must be a string, got {type(question).__name__}.")
        if questions is not None:
            if isinstance(questions, str) or not isinstance(questions, (list, tuple)) or not questions:
                raise ValueError("`questions` must be a non-empty list of strings; use `question=` for a single one.")
            wrong = [type(q).__name__ for q in questions if not isinstance(q, str)]
            if wrong:
                raise TypeError(f"questions must hold strings only, got {', '.join(sorted(set(wrong)))}.")
        if answer_prefix is not None and not isinstance(answer_prefix, str):
            raise TypeError(f"answer_prefix must be a string, got {type(answer_prefix).__name__}.")
        if press is not None and not isinstance(press, BasePress):
            raise TypeError(f"press must be a kvzap press (e.g. DMSThresholdPress), got {type(press).__name__}.")
        max_new_tokens = as_number("max_new_tokens", max_new_tokens, integer=True)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
        max_context_length = as_number("max_context_length", max_context_length, integer=True, allow_none=True)
        if max_context_length is not None and max_context_length < 1:
            raise ValueError(f"max_context_length must be a positive int, got {max_context_length!r}.")
        if not isinstance(prefill_chunk_size, str):
            prefill_chunk_size = as_number("prefill_chunk_size", prefill_chunk_size, integer=True, allow_none=True)
        if prefill_chunk_size != "auto" and (
            isinstance(prefill_chunk_size, str) or (prefill_chunk_size is not None and prefill_chunk_size < 1)
        ):
            raise ValueError(
                f"prefill_chunk_size must be a positive int, None (one forward) or 'auto', got {prefill_chunk_size!r}."
            )
        enable_thinking = as_bool("enable_thinking", enable_thinking)
        if cache is not None and not isinstance(cache, DynamicCache):
            raise TypeError(f"cache must be a transformers.DynamicCache, got {type(cache).__name__}.")
        preprocess = {
            "questions": list(questions) if questions is not None else [question or ""],
            "answer_prefix": answer_prefix or "",
            "max_context_length": max_context_length,
            "enable_thinking": enable_thinking,
        }
        forward = {
            "press": press,
            "max_new_tokens": max_new_tokens,
            "cache": cache,
            "prefill_chunk_size": prefill_chunk_size,
        }
        postprocess = {"single_question": questions is None}
        return preprocess, forward, postprocess

    def preprocess(self, context: str, questions, answer_prefix, max_context_length, enable_thinking):
        if not isinstance(context, str):
            raise TypeError(f"context must be a string, got {type(context).__name__}.")
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise TypeError(
                "The pipeline has no tokenizer: pass the model's, pipeline('kv-press-text-generation', model=model, "
                "tokenizer=tokenizer)."
            )
        # The context turn (chat template, or bare text) opened by BOS as kvzap.prompts decides: the rule
        # collection and calibration follow too, so surrogates see the hidden states they were trained on.
        ids, suffix = prompts.context_ids(tokenizer, context, enable_thinking=enable_thinking)
        context_ids = torch.tensor([ids], dtype=torch.long)  # (1, n)
        limit = max_context_length or tokenizer.model_max_length
        if limit is not None and context_ids.shape[1] > limit:
            logger.warning("Context truncated from %d to %d tokens.", context_ids.shape[1], limit)
            context_ids = context_ids[:, :limit]
        question_ids = [
            tokenizer.encode(q + suffix + answer_prefix, return_tensors="pt", add_special_tokens=False)
            for q in questions
        ]
        return {"context_ids": context_ids, "question_ids": question_ids}

    @torch.no_grad()
    def _forward(
        self,
        inputs,
        press: BasePress | None = None,
        max_new_tokens: int = 50,
        cache=None,
        prefill_chunk_size: int | str | None = "auto",
    ):
        model = self.model
        context_ids = inputs["context_ids"].to(model.device)
        if cache is not None and any(layer.get_seq_length() > 0 for layer in cache.layers):
            # The context would be appended after the old tokens, with positions restarting at 0: refuse it.
            raise ValueError(
                "cache must be empty: the pipeline prefills the context into it from position 0. Pass a fresh "
                "`DynamicCache(config=model.config)` (or none: one is created), and read it after the call."
            )
        cache = cache if cache is not None else _compat.new_dynamic_cache(model)
        cache_kw = _compat.cache_kwarg_name(model)
        n_context = context_ids.shape[1]
        chunk = _chunk_size(press, prefill_chunk_size) or n_context
        chunked = chunk < n_context and press is not None
        with press(model) if press is not None else contextlib.nullcontext():
            with press.prefilling() if chunked else contextlib.nullcontext():
                for start in range(0, n_context, chunk):
                    end = min(start + chunk, n_context)
                    positions = torch.arange(start, end, device=context_ids.device)[None]
                    # Only the cache is needed: skip the vocabulary projection of all but one token.
                    model(
                        input_ids=context_ids[:, start:end],
                        position_ids=positions,
                        use_cache=True,
                        logits_to_keep=1,
                        **{cache_kw: cache},
                    )
            questions = inputs["question_ids"]
            checkpoint = snapshot_cache(cache) if len(questions) > 1 else None
            answers = []
            for i, question_ids in enumerate(questions):
                if i > 0:
                    restore_cache(cache, checkpoint)
                answers.append(self._answer(question_ids.to(model.device), cache, cache_kw, n_context, max_new_tokens))
        return answers

    def _answer(
        self, question_ids: torch.Tensor, cache, cache_kw: str, start: int, max_new_tokens: int, pad: int = 0
    ) -> str:
        """Greedy decoding from ``question_ids`` placed right after ``start`` context tokens, which follow ``pad``
        padding columns in the cache (a row of a padded batch: a mask hides them when no press evicted them)."""
        model = self.model
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        ids = question_ids
        if ids.shape[1] == 0:  # no question and no template suffix: continue from the context's last token
            raise ValueError("The question is empty and the tokenizer has no chat template: pass a question.")
        position = start
        generated: list[int] = []
        for _ in range(max_new_tokens):
            positions = torch.arange(position, position + ids.shape[1], device=ids.device)[None]
            masking = {}
            if pad:
                mask = torch.ones(1, pad + position + ids.shape[1], dtype=torch.long, device=ids.device)
                mask[:, :pad] = 0
                masking["attention_mask"] = mask
            logits = model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **masking,
                **{cache_kw: cache},
            ).logits
            position += ids.shape[1]
            token = int(logits[0, -1].argmax())
            generated.append(token)
            if token in eos:
                break
            ids = torch.tensor([[token]], device=ids.device)
        return self.tokenizer.decode(generated, skip_special_tokens=True)

    def postprocess(self, answers, single_question: bool):
        return {"answer": answers[0]} if single_question else {"answers": answers}


def register_pipeline() -> None:
    """Register the task with transformers' pipeline registry (done when ``kvzap`` is imported)."""
    PIPELINE_REGISTRY.register_pipeline(
        TASK_NAME, pipeline_class=KVPressTextGenerationPipeline, pt_model=AutoModelForCausalLM
    )


def _chunk_size(press: BasePress | None, prefill_chunk_size: int | str | None) -> int | None:
    """Tokens per prefill forward: the caller's, or the press's default for ``"auto"`` (None: one forward)."""
    if isinstance(prefill_chunk_size, str) and prefill_chunk_size == "auto":
        return press.default_prefill_chunk_size if press is not None else None
    return prefill_chunk_size
