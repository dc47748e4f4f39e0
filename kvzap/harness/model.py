"""The ``kvzap`` model of lm-evaluation-harness: its Hugging Face model (``HFLM``) with a kvzap press applied.

How each request type meets the press
-------------------------------------
``loglikelihood`` (context, continuation): lm-eval's HF model scores ``(context + continuation)[:-1]`` in one
forward (left-truncated to ``max_length + 1`` tokens) and reads the continuation's log-probs from its last
``len(continuation)`` logits. Here the same tokens are split in two forwards: the context without its last token
is prefilled under the press (and pruned), then ``[last context token] + continuation[:-1]`` is run against the
pruned cache, whose logits give the continuation's log-probs. So pruning changes what the continuation sees.
Requests with the same context share one prefill (the cache is snapshotted and restored between them).

``loglikelihood_rolling`` (a whole text): lm-eval cuts the text into windows of ``max_length`` tokens whose
context is one token; each window is read in forwards of ``rolling_chunk`` tokens (default 128) under the press's
chunked prefill, each forward scored against the cache pruned after the ones before.

``generate_until``: the prompt is prefilled under the press and generation runs under it (``generate`` inside
``with press(model):``; ``decoding=true`` prunes the generated tokens too). Documents of kvzap's own offline
tasks (those with ``kvzap_pipeline: true``) are answered as ``kvzap evaluate`` answers them: the context is
prefilled alone under the press, then the question and the answer, greedily, by the ``kv-press-text-generation``
pipeline, so both give the same predictions.

The compression ratio (share of KV pairs evicted) is measured per request and its mean is recorded in the
results (``config.kvzap``) with the press's settings.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvzap import _compat
from kvzap.cache import restore_cache, snapshot_cache
from kvzap.presses.base import BasePress

from .args import KVZAP_ARGS, PressSettings, check_surrogate_fits, parse_press_settings

logger = logging.getLogger(__name__)

__all__ = ["KVzapLM", "PIPELINE_FIELD", "check_model_args"]

#: A document field: true when the document holds ``context``, ``question``, ``answer_prefix`` and
#: ``max_new_tokens`` to be answered through the pipeline, as ``kvzap evaluate`` answers them.
PIPELINE_FIELD = "kvzap_pipeline"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
_HFLM_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}


def check_model_args(args: dict[str, Any]) -> PressSettings | None:
    """Check the kvzap model's arguments (lm-eval's parsed ``--model_args``) before any model is loaded.

    Returns the press settings (None when ``press`` is a press object). Raises ValueError for an unknown
    argument, press or option, a bad value, or a local surrogate whose shapes do not fit the model.
    """
    unknown = sorted(set(args) - _HFLM_ARGS - set(KVZAP_ARGS))
    if unknown:
        raise ValueError(
            f"Unknown model argument(s) for --model kvzap: {', '.join(unknown)}. kvzap takes "
            f"{', '.join(KVZAP_ARGS)}, besides lm-eval's HF model arguments (pretrained, dtype, batch_size, ...)."
        )
    if isinstance(args.get("press"), BasePress):
        return None
    dtype = args.get("dtype", "float32")
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    settings = parse_press_settings(args)
    check_surrogate_fits(settings, args.get("pretrained"))
    return settings


@register_model("kvzap")
class KVzapLM(HFLM):
    """lm-eval's HF model with a kvzap press applied to every request (see the module docstring).

    Parameters
    ----------
    pretrained : a Hub id, a local directory, a ``.gguf`` file or a kvzap short name (``smollm2-135m``, the
        default; ``gemma3-270m``), loaded by :func:`kvzap.models.load_model`; or a model object.
    press : a press name of ``kvzap evaluate`` (``kvzap_mlp`` by default; ``no_press`` for the full cache), or a
        press object. threshold / compression_ratio, model_type, variant, surrogate, window, sink_size, decoding,
        storage, kv_bits, seed: its options (:class:`kvzap.harness.args.PressSettings`).
    rolling_chunk : tokens per forward of ``loglikelihood_rolling`` (default 128).
    Every other argument is lm-eval's HF model's (``dtype``, ``batch_size``, ``max_length``, ...).
    """

    def __init__(self, pretrained: Any = None, *, device: str | None = None, dtype: Any = "float32", **kwargs):
        press = kwargs.get("press")
        settings = check_model_args({"pretrained": pretrained, "dtype": dtype, **kwargs})
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in KVZAP_ARGS}
        self._settings = settings
        self._press: BasePress | None = press if isinstance(press, BasePress) else settings.build()
        self._rolling_chunk = settings.rolling_chunk if settings is not None else int(options.get("rolling_chunk", 128))
        self._ratios: dict[str, list[float]] = {}
        self._rolling = False
        self._pipe = None

        accelerator = _data_parallel_accelerator()
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's CLI passes --device cuda by default: the CPU, on a machine without one
        if device is None or accelerator is not None:
            device = (
                str(accelerator.device) if accelerator is not None else ("cuda" if torch.cuda.is_available() else "cpu")
            )
        if pretrained is None or isinstance(pretrained, (str, os.PathLike)):
            from kvzap.models import load_model

            model, tokenizer = load_model(
                pretrained, dtype=_DTYPES[dtype] if isinstance(dtype, str) else dtype, device=device
            )
            kwargs.setdefault("tokenizer", tokenizer)
            pretrained = model
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        if accelerator is not None:
            # lm-eval's HF model spreads requests over processes on GPUs only, and never for a model object:
            # the processes `accelerate launch` started share the requests here, on any device.
            self.accelerator = accelerator
            self._rank = accelerator.process_index
            self._world_size = accelerator.num_processes

    # --- the press -------------------------------------------------------------------------------------------
    @property
    def press(self) -> BasePress | None:
        """The press applied to every request (None: the full cache)."""
        return self._press

    def _applied(self):
        return self._press(self.model) if self._press is not None else contextlib.nullcontext()

    def _ratio(self) -> float:
        return float(self._press.compression_ratio) if self._press is not None else 0.0

    def _record(self, request_type: str, ratios: list[float]) -> None:
        self._ratios.setdefault(request_type, []).extend(float(r) for r in ratios)

    def _gather(self, request_type: str) -> None:
        """Rank 0 collects every process's ratios of ``request_type`` (called by every process)."""
        if self.world_size <= 1:
            return
        mine = self._ratios.pop(request_type, [])
        gathered = self.gather_object(mine, dst=0)
        if self.rank == 0:
            self._ratios[request_type] = [r for part in gathered for r in part]

    def compression_summary(self) -> dict[str, Any]:
        """The mean compression ratio over every request run so far, overall and per request type."""
        every = [r for ratios in self._ratios.values() for r in ratios]
        return {
            "compression_ratio": sum(every) / len(every) if every else None,
            "requests": len(every),
            "by_request_type": {
                k: {"compression_ratio": sum(v) / len(v), "requests": len(v)} for k, v in self._ratios.items() if v
            },
        }

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        settings = self._settings.record() if self._settings is not None else {"press": repr(self._press)}
        info["kvzap"] = {**settings, "press_repr": repr(self._press), **self.compression_summary()}
        return info

    # --- loglikelihood ---------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        results = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._gather("loglikelihood")
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self._rolling = True
        try:
            results = super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._rolling = False
        self._gather("loglikelihood_rolling")
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(log-prob, greedy) of each continuation, scored against the cache the press pruned after its context.

        ``requests``: ``(strings or None, context tokens, continuation tokens)``, as lm-eval's HF model takes them.
        """
        if self.backend != "causal":
            raise ValueError("The kvzap model scores causal language models only.")
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"Request {index}: context and continuation must be non-empty and the continuation at most "
                    f"max_length ({self.max_length}) tokens."
                )
            window = (context + continuation)[-(self.max_length + 1) :]  # lm-eval's left truncation
            head = window[: len(window) - len(continuation)]  # the (truncated) context, at least one token
            scored = head[-1:] + continuation[:-1]  # (len(continuation),): each predicts the next token
            groups.setdefault(tuple(head[:-1]), []).append((index, scored))
        chunk = self._rolling_chunk if self._rolling else None
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        ratios: list[float] = []
        # Longest first, as lm-eval orders them (a memory error shows at once).
        for prefix, members in sorted(groups.items(), key=lambda item: -len(item[0])):
            with self._applied():
                cache, checkpoint, ratio = None, None, 0.0
                for index, scored in members:
                    if cache is None or not prefix:
                        cache = self._prefill(list(prefix))
                        ratio = self._ratio() if prefix else 0.0
                        checkpoint = snapshot_cache(cache) if prefix and len(members) > 1 else None
                    elif checkpoint is not None:
                        restore_cache(cache, checkpoint)
                    continuation = requests[index][2]
                    logprobs = self._score(cache, scored, len(prefix), chunk)  # (len(continuation), vocab)
                    target = torch.tensor(continuation, device=logprobs.device)
                    answer = (
                        float(logprobs.gather(1, target[:, None]).sum()),
                        bool((logprobs.argmax(-1) == target).all()),
                    )
                    results[index] = answer
                    ratios.append(ratio if prefix else self._ratio())
                    if requests[index][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
        self._record("loglikelihood_rolling" if self._rolling else "loglikelihood", ratios)
        return results

    def _prefill(self, ids: list[int]):
        """A new cache holding ``ids`` prefilled under the applied press (pruned after the forward)."""
        cache = _compat.new_dynamic_cache(self.model)
        if ids:
            tokens = torch.tensor([ids], device=self.device)  # (1, n)
            positions = torch.arange(len(ids), device=self.device)[None]
            with torch.no_grad():
                self.model(
                    input_ids=tokens,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=1,  # only the cache is needed
                    **{_compat.cache_kwarg_name(self.model): cache},
                )
        return cache

    def _score(self, cache, ids: list[int], start: int, chunk: int | None) -> torch.Tensor:
        """Log-probs ``(len(ids), vocab)`` of the tokens after each of ``ids``, placed from position ``start``.

        ``chunk``: run ``ids`` in forwards of this many tokens under the press's chunked prefill, each pruned
        before the next reads the cache; None runs them in one forward.
        """
        kw = _compat.cache_kwarg_name(self.model)
        size = chunk or len(ids)
        chunked = chunk is not None and self._press is not None
        parts = []
        with torch.no_grad(), self._press.prefilling() if chunked else contextlib.nullcontext():
            for first in range(0, len(ids), size):
                piece = ids[first : first + size]
                tokens = torch.tensor([piece], device=self.device)
                positions = torch.arange(start + first, start + first + len(piece), device=self.device)[None]
                logits = self.model(input_ids=tokens, position_ids=positions, use_cache=True, **{kw: cache}).logits
                parts.append(F.log_softmax(logits[0], dim=-1, dtype=self.softmax_dtype))
        return torch.cat(parts)

    # --- generation ------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False):
        results: list[str | None] = [None] * len(requests)
        through_pipeline = [i for i, r in enumerate(requests) if _pipeline_doc(r)]
        others = [i for i in range(len(requests)) if i not in set(through_pipeline)]
        if others:
            for i, text in zip(
                others, super().generate_until([requests[i] for i in others], disable_tqdm), strict=True
            ):
                results[i] = text
        for i in through_pipeline:
            results[i] = self._answer(requests[i])
        self._gather("generate_until")
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        # The prompt (a left-padded batch) is prefilled under the press, and generation runs under it.
        with self._applied():
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        if self._press is not None:
            self._record("generate_until", self._press.sample_compression_ratios.tolist())
        else:
            self._record("generate_until", [0.0] * context.shape[0])
        return out

    def _answer(self, request) -> str:
        """A kvzap task's document answered as ``kvzap evaluate`` answers it (greedy; its budget, or a smaller
        ``max_gen_toks``)."""
        from transformers import pipeline

        doc, (prompt, gen_kwargs) = request.doc, request.args
        if self._pipe is None:
            self._pipe = pipeline("kv-press-text-generation", model=self.model, tokenizer=self.tokenizer)
        answer = self._pipe(
            doc["context"],
            question=doc["question"],
            answer_prefix=doc["answer_prefix"],
            press=self._press,
            prefill_chunk_size=None,  # one forward, as `kvzap evaluate` prefills by default
            max_new_tokens=min(int(doc["max_new_tokens"]), int((gen_kwargs or {}).get("max_gen_toks", 1 << 30))),
        )["answer"]
        self._record("generate_until", [self._ratio()])
        for stop in (gen_kwargs or {}).get("until") or []:
            if stop:
                answer = answer.split(stop)[0]
        self.cache_hook.add_partial("generate_until", (prompt, gen_kwargs), answer)
        return answer


def _pipeline_doc(request) -> bool:
    doc = getattr(request, "doc", None)
    if not (isinstance(doc, dict) and doc.get(PIPELINE_FIELD) is True):
        return False
    gen_kwargs = request.args[1] if len(request.args) > 1 else {}
    return not (gen_kwargs or {}).get("do_sample", False)


def _data_parallel_accelerator():
    """The Accelerator of a run started by ``accelerate launch`` with several processes, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import Accelerator, InitProcessGroupKwargs

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])
    return accelerator if accelerator.num_processes > 1 else None
