"""The KVzip+ scores of a context: one forward pass of the "repeat" prompt, scored inside attention.

One concern, at this length: the repeat prompt, the registered attention function that scores inside it, and the
checks of what a caller hands in all serve one forward pass whose state (the scores being filled) they share.

For a context ``x`` the model reads the chat ``user: x + "Repeat the previous context exactly."`` /
``assistant: x``. While it re-reads its own copy of ``x``, the attention that each repeated token pays
to the original tokens tells how much each original KV pair is needed to reconstruct the context
(KVzip, arXiv 2505.23416). KVzip+ (KVzap, arXiv 2601.07891) normalises that attention by what the pair
contributes to the output:

    s+_i = max_{j in repeat} a_ji * ||W_O^h v_i|| / ||h_j||        (per query head h)

then takes the max over the query heads of each GQA group; ``log(s+)`` is what KVzap surrogates predict.

The scores are computed by a registered attention function that runs the normal sdpa kernel for the
layer output and, on the side, the exact softmax rows of the repeated copy (normalised over every key
the row attends to) restricted to the columns of the original context, chunked over rows. Nothing else
(no ``output_attentions``, no eager attention over the full square) is materialised.

Used by the training scripts (``train.collect`` collects these scores as regression targets) and by
:class:`kvzap.presses.KVzipPlusScorer` (the oracle: the exact scores of a prefill, served to a press).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kvzap.prompts import with_bos

SCORING_ATTENTION_NAME = "kvzap_kvzip_plus"
"""Name under which the scoring attention function is registered in transformers (while scoring only)."""

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
_SENTINEL = "\u2063KVZAP_PROMPT\u2063"  # never produced by real text; marks where the prompt goes in the template

__all__ = [
    "SCORING_ATTENTION_NAME",
    "REPEAT_INSTRUCTION",
    "KVzipPlusOutput",
    "RepeatPrompt",
    "build_repeat_prompt",
    "build_prefill_repeat_prompt",
    "kvzip_plus_scores",
    "scoring_attention",
]


# --------------------------------------------------------------------------------------------------------------
# The repeat prompt
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of the repeat prompt and where the two copies of the prompt sit in it.

    Attributes
    ----------
    input_ids : torch.LongTensor
        ``(seq_len,)`` ids of ``prefix + prompt + middle + prompt`` (:func:`build_repeat_prompt`), or of
        ``prefill + middle + copy`` (:func:`build_prefill_repeat_prompt`).
    prompt : slice
        Positions of the original prompt (the keys that get scored).
    repeat : slice
        Positions of the repeated copy (the query rows the score is taken over); it ends the sequence.
    """

    input_ids: torch.Tensor
    prompt: slice
    repeat: slice

    @property
    def prompt_len(self) -> int:
        return self.prompt.stop - self.prompt.start


def _template_parts(tokenizer) -> tuple[str, str]:
    """Split the rendered chat template into the text before the prompt and between the two copies."""
    messages = [
        {"role": "user", "content": _SENTINEL + REPEAT_INSTRUCTION},
        {"role": "assistant", "content": _SENTINEL},
    ]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        # Base models without a chat template: a plain transcript with the same roles.
        rendered = f"user: {_SENTINEL}{REPEAT_INSTRUCTION}\nassistant: {_SENTINEL}"
    parts = rendered.split(_SENTINEL)
    if len(parts) != 3:
        raise ValueError(f"The chat template must place each message's content exactly once; got {len(parts)} parts.")
    # parts[2] (end-of-turn tokens after the copy) is dropped: causal attention means it cannot change the scores.
    return parts[0], parts[1]


def _as_ids(ids: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    """``ids`` as a non-empty 1-D CPU LongTensor, or a ValueError naming ``name``."""
    ids = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids.detach().cpu(), dtype=torch.long)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}.")
    return ids


def _check_tokenizer(tokenizer) -> None:
    """Refuse a missing tokenizer before anything runs (it frames the repeat prompt)."""
    if tokenizer is None or not callable(tokenizer) or not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer must be the model's tokenizer (AutoTokenizer.from_pretrained(...)), got "
            f"{type(tokenizer).__name__}: it frames the repeat prompt."
        )


def _template_ids(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the repeat chat before the prompt (BOS included when the model expects one) and between
    the two copies (the repeat instruction, the end of the user turn and the start of the assistant turn)."""
    _check_tokenizer(tokenizer)
    prefix_text, middle_text = _template_parts(tokenizer)
    prefix = torch.tensor(tokenizer(prefix_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    middle = torch.tensor(tokenizer(middle_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    # The prompt opens as the pipeline's prefill does (kvzap.prompts: BOS iff `tokenizer(text)` or the chat
    # template writes one), so surrogates train on the hidden states inference produces.
    prefix = torch.tensor(with_bos(tokenizer, prefix.tolist()), dtype=torch.long)
    return prefix, middle


def build_repeat_prompt(tokenizer, prompt_ids: Sequence[int] | torch.Tensor) -> RepeatPrompt:
    """Wrap prompt token ids in the repeat chat, keeping both copies token-identical.

    The template text around the prompt is tokenized on its own and concatenated with the prompt ids, so the
    spans are known exactly (no search for a sub-sequence) and the repeated copy is the same token sequence.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        Tokenizer of the model; its chat template is used when it has one.
    prompt_ids : sequence of int or torch.Tensor
        ``(prompt_len,)`` token ids of the prompt, without special tokens.

    Returns
    -------
    RepeatPrompt
    """
    prompt_ids = _as_ids(prompt_ids, "prompt_ids")
    prefix, middle = _template_ids(tokenizer)
    p0 = prefix.numel()
    p1 = p0 + prompt_ids.numel()
    r0 = p1 + middle.numel()
    input_ids = torch.cat([prefix, prompt_ids, middle, prompt_ids])  # (seq_len,)
    return RepeatPrompt(input_ids=input_ids, prompt=slice(p0, p1), repeat=slice(r0, input_ids.numel()))


def build_prefill_repeat_prompt(tokenizer, prefill_ids: Sequence[int] | torch.Tensor) -> RepeatPrompt:
    """The repeat prompt of a sequence's prefill: its own token ids, the repeat request, then the copy.

    The original is the prefill itself, token for token and at the same positions (``0 .. n-1``), so every
    pair the prefill writes to the cache gets a score (``prompt`` is ``slice(0, n)``) and each scored key is the
    key the cache holds. The repeat request is the text :func:`build_repeat_prompt` puts between the two copies
    (the instruction, the end of the user turn, the start of the assistant turn), so a prefill that is an open
    user turn (as the ``kv-press-text-generation`` pipeline prefills a context) becomes a well-formed chat.
    The copy is the prefill without its leading chat-template prefix when it starts with exactly the prefix
    :func:`build_repeat_prompt` writes (KVzip repeats the context, not the template), and the whole prefill
    otherwise. Hence for a prefill ``prefix + ids`` the sequence is exactly ``build_repeat_prompt(tokenizer,
    ids)``, and the scores of ``ids`` are the training targets of KVzap surrogates; the prefix tokens are
    scored too, by the same rule.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        Tokenizer of the model (chat template and repeat instruction).
    prefill_ids : sequence of int or torch.Tensor
        ``(n,)`` token ids of the prefill, special and template tokens included.

    Returns
    -------
    RepeatPrompt
    """
    prefill_ids = _as_ids(prefill_ids, "prefill_ids")
    prefix, middle = _template_ids(tokenizer)
    n, k = prefill_ids.numel(), prefix.numel()
    starts_with_prefix = 0 < k < n and torch.equal(prefill_ids[:k], prefix)
    copy = prefill_ids[k:] if starts_with_prefix else prefill_ids
    input_ids = torch.cat([prefill_ids, middle, copy])  # (seq_len,)
    r0 = n + middle.numel()
    return RepeatPrompt(input_ids=input_ids, prompt=slice(0, n), repeat=slice(r0, input_ids.numel()))


# --------------------------------------------------------------------------------------------------------------
# The scoring attention function
# --------------------------------------------------------------------------------------------------------------


@dataclass
class _ScoringState:
    """What the hooks and the attention function share during one forward pass."""

    prompt: slice
    repeat: slice
    chunk_size: int
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, seq_len, D) attention input
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (kv_heads, prompt_len) log s+
    # Also the plain KVzip score (max attention weight, the target of Fast KVzip gates) when asked for.
    with_kvzip: bool = False
    kvzip: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (kv_heads, prompt_len) log a
    # False: a layer's attention input is dropped once the layer is scored (only the scores are wanted).
    keep_hidden: bool = True
    # The layers to score (None: every layer); the others run plain sdpa and keep nothing.
    layers: frozenset[int] | None = None


_ACTIVE_STATE: _ScoringState | None = None


def _kvzip_plus_log_scores(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    hidden: torch.Tensor,
    scaling: float,
    state: _ScoringState,
) -> torch.Tensor:
    """KVzip+ log-scores of the original prompt's KV pairs for one layer.

    Parameters
    ----------
    module : nn.Module
        The attention module (its ``o_proj`` gives W_O).
    query : torch.Tensor
        ``(1, q_heads, seq_len, head_dim)``.
    key, value : torch.Tensor
        ``(1, kv_heads, seq_len, head_dim)``.
    attention_mask : torch.Tensor or None
        The mask transformers built (``None`` means plain causal), ``(1, 1 or q_heads, seq_len, seq_len)``.
    hidden : torch.Tensor
        ``(1, seq_len, D)`` input of the attention layer (after the input layernorm).
    scaling : float
        Softmax scale of the logits.
    state : _ScoringState
        Spans and chunk size.

    Returns
    -------
    torch.Tensor
        ``(kv_heads, prompt_len)`` float32 log s+.
    """
    _, q_heads, seq_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    p0, p1 = state.prompt.start, state.prompt.stop
    r0, r1 = state.repeat.start, state.repeat.stop
    # Keys after the last repeated row are never attended (causal), so no chunk needs keys beyond r1.
    keys_t = key[0, :, :r1].float().transpose(-1, -2)  # (kv_heads, head_dim, r1)
    inv_hidden_norm = hidden[0, r0:r1].float().norm(dim=-1).clamp_min(1e-12).reciprocal()  # (repeat_len,)

    best = torch.full((kv_heads, groups, p1 - p0), -math.inf, device=query.device)  # max_j a_ji / ||h_j||
    best_plain = torch.full_like(best, -math.inf) if state.with_kvzip else None  # max_j a_ji
    for c0 in range(r0, r1, state.chunk_size):
        c1 = min(c0 + state.chunk_size, r1)
        rows = c1 - c0
        # Scale the queries rather than the logits: rows * head_dim multiplications instead of rows * keys.
        q = query[0, :, c0:c1].float() * scaling  # (q_heads, rows, head_dim)
        q = q.reshape(kv_heads, groups * rows, head_dim)  # (kv_heads, G * rows, head_dim), GQA group-major
        # Keys at or after c1 are in every row's future: the chunk only needs keys [0, c1).
        logits = torch.bmm(q, keys_t[:, :, :c1]).view(kv_heads, groups, rows, c1)  # (kv_heads, G, rows, c1)
        if attention_mask is None:
            # Only the block of keys [c0, c1) holds future positions for these rows (upper triangle).
            future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)  # (rows, rows)
            logits[..., c0:c1].masked_fill_(future, -math.inf)
        else:
            mask = attention_mask[0, :, c0:c1, :c1]  # (1 or q_heads, rows, c1)
            mask = mask.reshape(-1, 1, rows, c1) if mask.shape[0] == 1 else mask.reshape(kv_heads, groups, rows, c1)
            if mask.dtype == torch.bool:
                logits.masked_fill_(~mask, -math.inf)
            else:
                logits += mask.float()
        # Exact softmax over every key of the row, in place: the normaliser needs all keys, the score only the
        # prompt columns, so the exponentials are computed once and reused.
        logits -= logits.amax(dim=-1, keepdim=True)
        logits.exp_()
        normaliser = logits.sum(dim=-1, keepdim=True)  # (kv, G, rows, 1)
        weight = inv_hidden_norm[c0 - r0 : c1 - r0, None] / normaliser
        attn = logits[..., p0:p1] * weight  # (kv_heads, G, rows, prompt_len): a_ji / ||h_j||
        best = torch.maximum(best, attn.amax(dim=2))
        if best_plain is not None:
            best_plain = torch.maximum(best_plain, (logits[..., p0:p1] / normaliser).amax(dim=2))

    # ||W_O^h v_i||: the slice of o_proj that reads head h, applied to the value of pair i.
    # ||W v||^2 = v^T (W^T W) v, with a head_dim x head_dim Gram matrix per head instead of a D-wide product.
    o_weight = module.o_proj.weight.float()  # (D, q_heads * head_dim)
    o_weight = o_weight.view(o_weight.shape[0], q_heads, head_dim).transpose(0, 1)  # (q_heads, D, head_dim)
    gram = (o_weight.transpose(1, 2) @ o_weight).view(kv_heads, groups, head_dim, head_dim)  # (kv, G, hd, hd)
    values = value[0, :, p0:p1].float()  # (kv_heads, prompt_len, head_dim)
    squared = torch.einsum("kpd,kgde,kpe->kgp", values, gram, values)  # (kv_heads, G, prompt_len)
    value_norm = squared.clamp_min(0).sqrt()

    scores = (best * value_norm).amax(dim=1)  # (kv_heads, prompt_len), max over the GQA group
    if best_plain is not None:
        tiny = torch.finfo(torch.float32).tiny
        state.kvzip[module.layer_idx] = best_plain.amax(dim=1).clamp_min(tiny).log()  # (kv_heads, prompt_len)
    return scores.clamp_min(torch.finfo(torch.float32).tiny).log()


def scoring_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvzap_kvzip_plus"``: sdpa output plus KVzip+ scores on the side.

    Follows the transformers attention-interface signature; the scores are stored in the active scoring
    state (set by :func:`_scoring_context`), keyed by ``module.layer_idx``.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    output = ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    state = _ACTIVE_STATE
    if state is None or (state.layers is not None and module.layer_idx not in state.layers):
        return output
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(
            "KVzip+ scoring needs one sequence in a single forward pass without a cache "
            f"(got query {tuple(query.shape)}, key {tuple(key.shape)})."
        )
    layer_idx = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with torch.no_grad():
        state.scores[layer_idx] = _kvzip_plus_log_scores(
            module, query, key, value, attention_mask, state.hidden[layer_idx], scale, state
        )
    if not state.keep_hidden:
        del state.hidden[layer_idx]  # (1, seq_len, D) per layer adds up over a deep model: free it now
    return output


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Self-attention modules of the decoder layers, in layer order."""
    modules = [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with `o_proj` and `layer_idx`; "
            "KVzip+ scoring supports Llama-style decoders (Llama, Qwen2/3, Mistral, ...)."
        )
    return sorted(modules, key=lambda m: m.layer_idx)


@contextmanager
def _scoring_context(model: nn.Module, state: _ScoringState) -> Iterator[None]:
    """Register the scoring attention and the hidden-state hooks; restore the model on exit, even on error.

    The attention implementation found on entry is set back on exit, whatever it was (``"sdpa"``, or the
    ``"kvzap_sdpa"`` of a press applied around this scoring).
    """
    global _ACTIVE_STATE
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SCORING_ATTENTION_NAME, scoring_attention)
    # Without a registered mask function a custom attention name receives attention_mask=None.
    AttentionMaskInterface.register(SCORING_ATTENTION_NAME, sdpa_mask)

    def capture_hidden(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        state.hidden[module.layer_idx] = hidden.detach()

    original = model.config._attn_implementation
    modules = [m for m in _attention_modules(model) if state.layers is None or m.layer_idx in state.layers]
    handles = [m.register_forward_pre_hook(capture_hidden, with_kwargs=True) for m in modules]
    previous_state, _ACTIVE_STATE = _ACTIVE_STATE, state
    try:
        model.set_attn_implementation(SCORING_ATTENTION_NAME)
        yield
    finally:
        _ACTIVE_STATE = previous_state
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(original)


# --------------------------------------------------------------------------------------------------------------
# Public scoring entry point
# --------------------------------------------------------------------------------------------------------------


@dataclass
class KVzipPlusOutput:
    """Result of :func:`kvzip_plus_scores`.

    Attributes
    ----------
    log_scores : torch.Tensor
        ``(n_layers, kv_heads, prompt_len)`` float32 log s+ of every KV pair of the original prompt (``n_layers``:
        the layers scored, see ``layers``).
    hidden_states : torch.Tensor or None
        ``(n_layers, prompt_len, D)`` inputs of the attention layers at the prompt positions (the surrogate's
        features), when requested.
    log_kvzip : torch.Tensor or None
        ``(n_layers, kv_heads, prompt_len)`` log of the plain KVzip score (max attention weight over the
        repeated rows and the GQA group), the distillation target of Fast KVzip gates, when requested.
    repeat_prompt : RepeatPrompt
        The sequence that was run.
    layers : tuple of int
        The model layers scored, in order: row ``j`` of every tensor above is layer ``layers[j]``.
    """

    log_scores: torch.Tensor
    hidden_states: torch.Tensor | None
    repeat_prompt: RepeatPrompt
    log_kvzip: torch.Tensor | None = None
    layers: tuple[int, ...] = ()


@torch.no_grad()
def kvzip_plus_scores(
    model: nn.Module,
    tokenizer,
    prompt_ids: Sequence[int] | torch.Tensor | RepeatPrompt,
    *,
    return_hidden_states: bool = False,
    chunk_size: int = 64,
    return_kvzip: bool = False,
    layers: Sequence[int] | None = None,
) -> KVzipPlusOutput:
    """KVzip+ log-scores of every KV pair of a prompt, from one forward pass of the repeat prompt.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A Llama-style causal LM (attention modules with ``o_proj``).
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer (for the chat template); unused when ``prompt_ids`` is already a :class:`RepeatPrompt`.
    prompt_ids : sequence of int, torch.Tensor or RepeatPrompt
        ``(prompt_len,)`` token ids of the prompt, or a prebuilt repeat prompt.
    return_hidden_states : bool, default False
        Also return the attention inputs at the prompt positions.
    chunk_size : int, default 64
        Query rows scored at once; bounds the extra memory to ``q_heads * chunk_size * seq_len`` floats.
    return_kvzip : bool, default False
        Also return the plain KVzip log-scores (the target of Fast KVzip gates).
    layers : sequence of int, optional
        Score only these model layers (the others run plain attention: no extra cost, nothing kept). Default:
        every layer. Collection passes :func:`kvzap.layers.prunable_layers`, which leaves out the sliding-window
        layers, whose pairs a press does not prune (and which a window hides from most repeated rows anyway).

    Returns
    -------
    KVzipPlusOutput
    """
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        raise TypeError(
            f"model must be a transformers causal LM (e.g. from kvzap.models.load_model()), got {type(model).__name__}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be a positive integer, got {type(chunk_size).__name__} ({chunk_size!r}).")
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    if layers is not None:
        n_layers = len(_attention_modules(model))
        layers = sorted(set(layers))
        if not layers or not all(isinstance(i, int) and 0 <= i < n_layers for i in layers):
            raise ValueError(
                f"layers must be a non-empty list of layer indices in [0, {n_layers}), got {layers!r}. A model whose "
                "layers all use a sliding window has no layer to collect unless sliding layers are pruned too."
            )
    repeat_prompt = prompt_ids if isinstance(prompt_ids, RepeatPrompt) else build_repeat_prompt(tokenizer, prompt_ids)
    state = _ScoringState(
        prompt=repeat_prompt.prompt,
        repeat=repeat_prompt.repeat,
        chunk_size=chunk_size,
        with_kvzip=return_kvzip,
        keep_hidden=return_hidden_states,
        layers=None if layers is None else frozenset(layers),
    )
    device = next(model.parameters()).device
    with _scoring_context(model, state):
        # logits_to_keep=1: the vocabulary projection of every position is wasted work here.
        model(input_ids=repeat_prompt.input_ids[None].to(device), use_cache=False, logits_to_keep=1)
    layers = sorted(state.scores)
    log_scores = torch.stack([state.scores[i] for i in layers])  # (n_layers, kv_heads, prompt_len)
    hidden = None
    if return_hidden_states:
        p = repeat_prompt.prompt
        hidden = torch.stack([state.hidden[i][0, p].float() for i in layers])  # (n_layers, prompt_len, D)
    log_kvzip = torch.stack([state.kvzip[i] for i in layers]) if return_kvzip else None
    return KVzipPlusOutput(
        log_scores=log_scores,
        hidden_states=hidden,
        repeat_prompt=repeat_prompt,
        log_kvzip=log_kvzip,
        layers=tuple(layers),
    )
