"""One rule for how a prompt opens, shared by collection, calibration, the pipeline and evaluation.

Surrogates are trained on the hidden states of the prompts the collection builds and applied to those of the
prompts the pipeline builds, so both must open with the same tokens. Tokenizers disagree on how to say that a
model expects a BOS token: Gemma 3's sets ``add_bos_token=False`` although its post-processor prepends ``<bos>``
whenever ``tokenizer(text)`` is called; Llama 3's and Gemma's chat templates write the BOS themselves; SmolLM2's
template opens with ``<|im_start|>``, which is also its ``bos_token``; GPT-2-style tokenizers define a
``bos_token`` that they never prepend. The rule here reads the tokenizer's behaviour instead of its flags:

    a prompt starts with ``bos_token_id`` iff ``tokenizer(probe)`` starts with it, or the chat template
    renders it first; it is then prepended once, unless the text already starts with it.

:func:`context_ids` is what the ``kv-press-text-generation`` pipeline prefills for a context (the chat turn
around it when the tokenizer has a template, the bare text otherwise), and :func:`with_bos` is the rule alone,
for callers that build the rest of the prompt themselves (the KVzip+ repeat prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CONTEXT_MARKER", "starts_with_bos", "with_bos", "context_text", "context_ids"]

# A short text of ordinary characters: any tokenizer encodes it to a few regular tokens.
_PROBE = "Hello world"

#: Stands for the question while the chat template is rendered around a context (never a real token).
CONTEXT_MARKER = "\x00KVZAP_QUESTION\x00"


def starts_with_bos(tokenizer) -> bool:
    """Whether the model's prompts start with its BOS token.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.

    Returns
    -------
    bool
        True iff the tokenizer has a ``bos_token_id`` and either its own encoding of a probe text
        (``tokenizer(text)``, special tokens included) starts with it, or its chat template renders a user turn
        that starts with it.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    encoded = tokenizer(_PROBE)["input_ids"]
    if encoded and encoded[0] == bos:
        return True
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        return bool(ids) and ids[0] == bos
    return False


def with_bos(tokenizer, ids: Sequence[int]) -> list[int]:
    """``ids`` opened by the BOS token when the model expects one (:func:`starts_with_bos`), never twice.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.
    ids : sequence of int
        ``(n,)`` token ids encoded without special tokens (a chat template may have written a BOS already).

    Returns
    -------
    list of int
        ``(n,)`` or ``(n + 1,)`` token ids.
    """
    ids = [int(i) for i in ids]
    if starts_with_bos(tokenizer) and (not ids or ids[0] != tokenizer.bos_token_id):
        return [tokenizer.bos_token_id, *ids]
    return ids


def context_text(tokenizer, context: str, *, enable_thinking: bool | None = None) -> tuple[str, str]:
    """The text of a context turn and the text that follows each question after it.

    With a chat template, the context is a user turn left open: the template is rendered around
    ``context + CONTEXT_MARKER`` with the generation prompt, what precedes the marker is the context turn and
    what follows it (the end of the user turn, the start of the assistant turn) goes after each question.
    Without one, the context is the bare text and a newline follows each question.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.
    context : str
        The context text.
    enable_thinking : bool, optional
        Passed to the chat template (Qwen3-style templates read it).

    Returns
    -------
    tuple of str
        ``(context turn, suffix)``; the context turn holds no BOS unless the template writes one.
    """
    if not getattr(tokenizer, "chat_template", None):
        return context, "\n"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + CONTEXT_MARKER}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=enable_thinking,
    )
    before, after = rendered.split(CONTEXT_MARKER)
    return before, after


def context_ids(tokenizer, context: str, *, enable_thinking: bool | None = None) -> tuple[list[int], str]:
    """Token ids of a context as the pipeline prefills it, and the text that follows each question.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.
    context : str
        The context text.
    enable_thinking : bool, optional
        Passed to the chat template.

    Returns
    -------
    ids : list of int
        ``(n,)`` ids of :func:`context_text`'s context turn, encoded without special tokens and opened by the BOS
        token by the rule of :func:`starts_with_bos`.
    suffix : str
        Text to encode after each question (without special tokens).
    """
    text, suffix = context_text(tokenizer, context, enable_thinking=enable_thinking)
    return with_bos(tokenizer, tokenizer.encode(text, add_special_tokens=False)), suffix
