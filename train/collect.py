"""KVzip+ target collection: one forward pass of the "repeat" prompt per text, scored inside attention.

For a prompt ``x`` the model reads the chat ``user: x + "Repeat the previous context exactly."`` /
``assistant: x``. While it re-reads its own copy of ``x``, the attention that each repeated token pays
to the original tokens tells how much each original KV pair is needed to reconstruct the context.
KVzip+ normalises that attention by what the pair contributes to the output:

    s+_i = max_{j in repeat} a_ji * ||W_O^h v_i|| / ||h_j||        (per query head h)

then takes the max over the query heads of each GQA group, and ``log(s+)`` is the regression target.

The scores are computed by a registered attention function that runs the normal sdpa kernel for the
layer output and, on the side, the exact softmax rows of the repeated copy (normalised over every key
the row attends to) restricted to the columns of the original prompt, chunked over rows. Nothing else
(no ``output_attentions``, no eager attention over the full square) is materialised.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

ATTENTION_NAME = "kvzap_kvzip_plus"
"""Name under which the scoring attention function is registered in transformers."""

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
_SENTINEL = "\u2063KVZAP_PROMPT\u2063"  # never produced by real text; marks where the prompt goes in the template

__all__ = [
    "ATTENTION_NAME",
    "KVzipPlusOutput",
    "RepeatPrompt",
    "build_repeat_prompt",
    "collect",
    "kvzip_plus_scores",
    "sample_positions",
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
        ``(seq_len,)`` ids of ``prefix + prompt + middle + prompt``.
    prompt : slice
        Positions of the original prompt (the keys that get scored).
    repeat : slice
        Positions of the repeated copy (the query rows the score is taken over).
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
    prompt_ids = torch.as_tensor(list(prompt_ids) if not torch.is_tensor(prompt_ids) else prompt_ids, dtype=torch.long)
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {tuple(prompt_ids.shape)}."
        )
    prefix_text, middle_text = _template_parts(tokenizer)
    prefix = torch.tensor(tokenizer(prefix_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    middle = torch.tensor(tokenizer(middle_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    bos = getattr(tokenizer, "bos_token_id", None)
    # Models that expect a BOS token and whose template does not write one get it here.
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (prefix.numel() == 0 or prefix[0] != bos):
        prefix = torch.cat([torch.tensor([bos]), prefix])
    p0 = prefix.numel()
    p1 = p0 + prompt_ids.numel()
    r0 = p1 + middle.numel()
    input_ids = torch.cat([prefix, prompt_ids, middle, prompt_ids])  # (seq_len,)
    return RepeatPrompt(input_ids=input_ids, prompt=slice(p0, p1), repeat=slice(r0, input_ids.numel()))


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

    Follows the transformers attention-interface signature; the scores are stored in the active collection
    state (set by :func:`_scoring_context`), keyed by ``module.layer_idx``.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    output = ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    state = _ACTIVE_STATE
    if state is None:
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
    return output


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Self-attention modules of the decoder layers, in layer order."""
    modules = [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with `o_proj` and `layer_idx`; "
            "KVzip+ collection supports Llama-style decoders (Llama, Qwen2/3, Mistral, ...)."
        )
    return sorted(modules, key=lambda m: m.layer_idx)


@contextmanager
def _scoring_context(model: nn.Module, state: _ScoringState) -> Iterator[None]:
    """Register the scoring attention and the hidden-state hooks; restore the model on exit, even on error."""
    global _ACTIVE_STATE
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, scoring_attention)
    # Without a registered mask function a custom attention name receives attention_mask=None.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

    def capture_hidden(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        state.hidden[module.layer_idx] = hidden.detach()

    original = model.config._attn_implementation
    handles = [m.register_forward_pre_hook(capture_hidden, with_kwargs=True) for m in _attention_modules(model)]
    previous_state, _ACTIVE_STATE = _ACTIVE_STATE, state
    try:
        model.set_attn_implementation(ATTENTION_NAME)
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
        ``(n_layers, kv_heads, prompt_len)`` float32 log s+ of every KV pair of the original prompt.
    hidden_states : torch.Tensor or None
        ``(n_layers, prompt_len, D)`` inputs of the attention layers at the prompt positions (the surrogate's
        features), when requested.
    log_kvzip : torch.Tensor or None
        ``(n_layers, kv_heads, prompt_len)`` log of the plain KVzip score (max attention weight over the
        repeated rows and the GQA group), the distillation target of Fast KVzip gates, when requested.
    repeat_prompt : RepeatPrompt
        The sequence that was run.
    """

    log_scores: torch.Tensor
    hidden_states: torch.Tensor | None
    repeat_prompt: RepeatPrompt
    log_kvzip: torch.Tensor | None = None


@torch.no_grad()
def kvzip_plus_scores(
    model: nn.Module,
    tokenizer,
    prompt_ids: Sequence[int] | torch.Tensor | RepeatPrompt,
    *,
    return_hidden_states: bool = False,
    chunk_size: int = 64,
    return_kvzip: bool = False,
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

    Returns
    -------
    KVzipPlusOutput
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    repeat_prompt = prompt_ids if isinstance(prompt_ids, RepeatPrompt) else build_repeat_prompt(tokenizer, prompt_ids)
    state = _ScoringState(
        prompt=repeat_prompt.prompt, repeat=repeat_prompt.repeat, chunk_size=chunk_size, with_kvzip=return_kvzip
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
        log_scores=log_scores, hidden_states=hidden, repeat_prompt=repeat_prompt, log_kvzip=log_kvzip
    )


def sample_positions(prompt_len: int, n_tokens: int, seed: int) -> torch.Tensor:
    """Seeded random prompt positions (sorted, without replacement).

    Parameters
    ----------
    prompt_len : int
        Number of prompt tokens.
    n_tokens : int
        Positions wanted; all positions when the prompt is shorter.
    seed : int
        Seed of this draw (the collection uses ``seed + prompt index``, so the draw does not depend on which
        process handles the prompt).

    Returns
    -------
    torch.LongTensor
        ``(min(n_tokens, prompt_len),)`` positions in ``[0, prompt_len)``.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens}.")
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randperm(prompt_len, generator=generator)[:n_tokens]
    return positions.sort().values


# --------------------------------------------------------------------------------------------------------------
# Sharded, resumable, data-parallel collection
# --------------------------------------------------------------------------------------------------------------

MANIFEST_NAME = "manifest.json"
SETTINGS_NAME = "settings.json"


def shard_path(out_dir: Path, shard: int) -> Path:
    """File of shard number ``shard``."""
    return out_dir / f"shard-{shard:05d}.safetensors"


def _write_shard(path: Path, rows: list[dict[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Concatenate per-prompt rows and write them atomically (temporary file + rename)."""
    from safetensors.torch import save_file

    tensors = {name: torch.cat([r[name] for r in rows]).contiguous() for name in rows[0]}
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def collect(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    out_dir: str | os.PathLike,
    *,
    n_tokens: int = 500,
    shard_size: int = 8,
    seed: int = 0,
    feature_dtype: torch.dtype = torch.float16,
    chunk_size: int = 64,
    accelerator=None,
    extra_settings: dict | None = None,
    with_kvzip: bool = False,
) -> dict:
    """Collect (hidden state, KVzip+ log-score) pairs for a list of prompts, in resumable shards.

    Prompts are grouped in shards of ``shard_size`` consecutive prompts; shard ``k`` is handled by process
    ``k % num_processes``. A shard file is written atomically once all its prompts are done, so a rerun with
    the same settings skips finished shards. The main process writes ``manifest.json`` at the end.

    Each shard holds ``X`` ``(rows, n_layers, D)`` (``feature_dtype``), ``y`` ``(rows, n_layers, kv_heads)``
    float32, ``prompt_index`` and ``position`` ``(rows,)`` int64, with ``rows = sum(min(n_tokens, len))``.

    Parameters
    ----------
    model, tokenizer
        The model to score (see :func:`kvzip_plus_scores`).
    prompts : sequence of sequences of int
        Token ids of each prompt (without special tokens).
    out_dir : str or PathLike
        Output directory.
    n_tokens : int, default 500
        Random prompt positions kept per prompt.
    shard_size : int, default 8
        Prompts per shard file.
    seed : int, default 0
        Seed of the position draws.
    feature_dtype : torch.dtype, default torch.float16
        Storage dtype of the hidden states.
    chunk_size : int, default 64
        See :func:`kvzip_plus_scores`.
    accelerator : accelerate.Accelerator, optional
        For data-parallel runs; ``None`` runs everything in this process.
    extra_settings : dict, optional
        Stored in ``settings.json`` (e.g. the data source) and checked on resume.
    with_kvzip : bool, default False
        Also store ``y_kvzip`` ``(rows, n_layers, kv_heads)``, the plain KVzip log-scores that Fast KVzip gates
        are distilled from.

    Returns
    -------
    dict
        The manifest (also written to ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    if shard_size < 1:
        raise ValueError(f"shard_size must be a positive integer, got {shard_size}.")
    out_dir = Path(out_dir)
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    is_main = rank == 0

    config = model.config
    settings = {
        "model": str(getattr(config, "_name_or_path", "")),
        "n_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "n_prompts": len(prompts),
        "n_tokens": n_tokens,
        "shard_size": shard_size,
        "seed": seed,
        "feature_dtype": str(feature_dtype).removeprefix("torch."),
        "target": "log KVzip+ score" + (" and log KVzip score (y_kvzip)" if with_kvzip else ""),
        **(extra_settings or {}),
    }
    settings_file = out_dir / SETTINGS_NAME
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if settings_file.exists():
            previous = json.loads(settings_file.read_text())
            if previous != settings:
                changed = sorted(k for k in settings.keys() | previous.keys() if previous.get(k) != settings.get(k))
                raise ValueError(
                    f"{out_dir} holds a collection made with other settings ({', '.join(changed)}); "
                    "use another output directory or delete it."
                )
        else:
            settings_file.write_text(json.dumps(settings, indent=2))
    if accelerator is not None:
        accelerator.wait_for_everyone()

    n_shards = math.ceil(len(prompts) / shard_size)
    mine = [k for k in range(n_shards) if k % world == rank]
    todo = [k for k in mine if not shard_path(out_dir, k).exists()]
    if len(todo) < len(mine):
        logger.info("Process %d: %d of its %d shards already done, resuming", rank, len(mine) - len(todo), len(mine))
    n_todo_prompts = sum(min(shard_size, len(prompts) - k * shard_size) for k in todo)
    progress = tqdm(total=n_todo_prompts, desc=f"collect[{rank}]", unit="prompt", position=rank, disable=None)
    start = time.perf_counter()
    for k in todo:
        rows = []
        for index in range(k * shard_size, min((k + 1) * shard_size, len(prompts))):
            prompt = torch.as_tensor(list(prompts[index]), dtype=torch.long)
            result = kvzip_plus_scores(
                model, tokenizer, prompt, return_hidden_states=True, chunk_size=chunk_size, return_kvzip=with_kvzip
            )
            positions = sample_positions(prompt.numel(), n_tokens, seed + index)
            row = {
                "X": result.hidden_states[:, positions].transpose(0, 1).to(feature_dtype),  # (n, n_layers, D)
                "y": result.log_scores[:, :, positions].permute(2, 0, 1).float(),  # (n, n_layers, kv_heads)
                "prompt_index": torch.full((positions.numel(),), index, dtype=torch.long),
                "position": positions,
            }
            if with_kvzip:
                row["y_kvzip"] = result.log_kvzip[:, :, positions].permute(2, 0, 1).float()  # (n, n_layers, H)
            rows.append(row)
            progress.update(1)
        _write_shard(shard_path(out_dir, k), rows, {"shard": str(k), "process": str(rank)})
    progress.close()
    logger.info("Process %d collected %d prompts in %.1f s", rank, n_todo_prompts, time.perf_counter() - start)

    if accelerator is not None:
        accelerator.wait_for_everyone()
    manifest = _write_manifest(out_dir, settings, n_shards) if is_main else {}
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return manifest if is_main else json.loads((out_dir / MANIFEST_NAME).read_text())


def _write_manifest(out_dir: Path, settings: dict, n_shards: int) -> dict:
    """Describe the finished shards in ``manifest.json``."""
    from safetensors import safe_open

    shards = []
    for k in range(n_shards):
        path = shard_path(out_dir, k)
        if not path.exists():
            raise RuntimeError(f"Shard {path} is missing after collection; rerun the same command to resume.")
        with safe_open(str(path), framework="pt") as f:
            n_rows = f.get_slice("y").get_shape()[0]
        shards.append({"file": path.name, "rows": n_rows})
    manifest = {**settings, "n_rows": sum(s["rows"] for s in shards), "shards": shards}
    tmp = out_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out_dir / MANIFEST_NAME)
    return manifest


def load_collection(out_dir: str | os.PathLike, target: str = "y") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Read a finished collection.

    Parameters
    ----------
    out_dir : str or PathLike
        Directory written by :func:`collect`.
    target : ``"y"`` (log KVzip+, default) or ``"y_kvzip"`` (log KVzip, collected with ``with_kvzip=True``).

    Returns
    -------
    X : torch.Tensor
        ``(rows, n_layers, D)`` hidden states (storage dtype).
    y : torch.Tensor
        ``(rows, n_layers, kv_heads)`` float32 log-scores.
    manifest : dict
        The manifest, plus ``prompt_index`` ``(rows,)`` under the key ``"prompt_index"``.
    """
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    manifest_file = out_dir / MANIFEST_NAME
    if not manifest_file.exists():
        raise FileNotFoundError(f"{manifest_file} not found: the collection in {out_dir} is missing or unfinished.")
    manifest = json.loads(manifest_file.read_text())
    parts = [load_file(str(out_dir / s["file"])) for s in manifest["shards"]]
    X = torch.cat([p["X"] for p in parts])  # (rows, n_layers, D)
    if target not in parts[0]:
        raise ValueError(
            f"The collection in {out_dir} has no {target!r} targets; collect with `--with-kvzip` for Fast KVzip gates."
        )
    y = torch.cat([p[target] for p in parts])  # (rows, n_layers, kv_heads)
    manifest["prompt_index"] = torch.cat([p["prompt_index"] for p in parts])
    return X, y, manifest
