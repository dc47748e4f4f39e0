"""The kvzap model's arguments for lm-eval (``--model_args press=...,threshold=...``), checked without lm-eval.

The press is named the way ``kvzap evaluate`` names it (:data:`kvzap.evaluation.presses.PRESSES`) and built by
that registry's :func:`~kvzap.evaluation.presses.make_press`; the options it does not take (``variant``,
``storage``, ``kv_bits``) are set on the press it returns. Everything here runs before any model is loaded, so a
typo or a surrogate that cannot fit the model is refused first.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PressSettings", "KVZAP_ARGS", "parse_press_settings", "check_surrogate_fits"]

#: The model arguments the kvzap model adds to those of lm-eval's HF model.
KVZAP_ARGS = (
    "press",
    "threshold",
    "compression_ratio",
    "model_type",
    "variant",
    "surrogate",
    "window",
    "sink_size",
    "decoding",
    "storage",
    "kv_bits",
    "seed",
    "rolling_chunk",
)

_MODEL_TYPES = {"mlp": "kvzap_mlp", "linear": "kvzap_linear", "fastkvzip": "fastkvzip"}


@dataclass
class PressSettings:
    """What the kvzap model evaluates: a press name of ``kvzap evaluate`` and its options.

    Parameters
    ----------
    press : a name of :data:`kvzap.evaluation.presses.PRESSES` (``no_press`` for the full cache).
    value : the threshold (threshold presses) or target compression ratio (top-k presses); None for ``no_press``.
    surrogate : surrogate directory or Hub id (None: bundled or published), or a surrogate module.
    variant : a bundled variant of the KVzap surrogate (``average``), or None.
    window : sliding window size (tokens never evicted).
    sink_size : first tokens a threshold press never evicts; None leaves the press's default (4 in a chunked
        prefill, such as ``loglikelihood_rolling``'s forwards of ``rolling_chunk`` tokens; none in one forward).
    decoding : threshold presses also prune generated tokens.
    storage : ``"compact"`` (evicted pairs freed) or ``"masked"``.
    kv_bits : quantization of the kept pairs, for presses with a ``kv_bits`` field; None leaves the default.
    seed : seed of the random scorer.
    rolling_chunk : ``loglikelihood_rolling`` reads a text in forwards of this many tokens, each scored against
        the cache the press pruned after the ones before.
    """

    press: str = "kvzap_mlp"
    value: float | None = None
    surrogate: Any = None
    variant: str | None = None
    window: int = 128
    sink_size: int | None = None
    decoding: bool = False
    storage: str = "compact"
    kv_bits: int | None = None
    seed: int = 0
    rolling_chunk: int = 128

    def build(self):
        """A fresh press (None for ``no_press``), built by ``kvzap evaluate``'s registry."""
        from kvzap.evaluation.presses import PRESSES, make_press
        from kvzap.presses import KVzapScorer

        press = make_press(
            self.press,
            self.value,
            surrogate=self.surrogate,
            sliding_window_size=self.window,
            decoding=self.decoding,
            seed=self.seed,
            sink_size=self.sink_size,  # taken by threshold presses; refused below for the others
        )
        if press is None:
            return None
        if self.variant is not None:
            # make_press takes no variant: the registry's KVzap scorer, with the variant, in its place.
            press.scorer = KVzapScorer(PRESSES[self.press].surrogate_type, variant=self.variant)
        press.storage = self.storage
        if self.kv_bits is not None:
            if not _has_option(press, "kv_bits"):
                raise ValueError(
                    f"kv_bits={self.kv_bits}: the press {self.press!r} has no kv_bits option in this version of "
                    "kvzap; drop kv_bits."
                )
            press.kv_bits = self.kv_bits
        if self.sink_size is not None and not _has_option(press, "sink_size"):
            raise ValueError(
                f"sink_size={self.sink_size}: the press {self.press!r} is not a threshold press and keeps no "
                "sinks; drop sink_size."
            )
        return press

    def record(self) -> dict[str, Any]:
        """The settings as the results file records them (JSON-able)."""
        surrogate = self.surrogate if self.surrogate is None or isinstance(self.surrogate, str) else "module"
        return {
            "press": self.press,
            "value": self.value,
            "surrogate": str(surrogate) if isinstance(surrogate, os.PathLike) else surrogate,
            "variant": self.variant,
            "window": self.window,
            "sink_size": self.sink_size,
            "decoding": self.decoding,
            "storage": self.storage,
            "kv_bits": self.kv_bits,
            "seed": self.seed,
            "rolling_chunk": self.rolling_chunk,
        }


def _has_option(press: Any, name: str) -> bool:
    """Whether ``press`` has the dataclass field ``name`` (an option it can be given)."""
    return name in getattr(press, "__dataclass_fields__", {})


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number (or -inf), got {value!r}: pass e.g. {name}=-3.") from None
    if math.isnan(number):
        raise ValueError(f"{name} cannot be NaN: pass a number, or -inf to evict nothing.")
    return number


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip())):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.") from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {number}.")
    return number


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def parse_press_settings(args: dict[str, Any]) -> PressSettings:
    """The press settings among ``args`` (lm-eval's parsed ``--model_args``); other keys are ignored.

    Raises
    ------
    ValueError : an unknown press, a missing or non-numeric threshold, a model type that contradicts the
        press, an option the press does not take, or a value of the wrong kind; each message says the fix.
    """
    from kvzap.evaluation.presses import PRESSES

    model_type = args.get("model_type")
    if model_type is not None and model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(_MODEL_TYPES)}, got {model_type!r}.")
    name = args.get("press")
    if name is None:
        name = _MODEL_TYPES[model_type or "mlp"]
    if not isinstance(name, str) or name not in PRESSES:
        raise ValueError(
            f"Unknown press {name!r}: choose one of {', '.join(PRESSES)} (as `kvzap evaluate` names them)."
        )
    factory = PRESSES[name]
    if model_type is not None and factory.surrogate_type != model_type:
        raise ValueError(
            f"model_type={model_type} contradicts press={name} (whose surrogate is {factory.surrogate_type or 'none'})"
            f": pass press={_MODEL_TYPES[model_type]}, or drop model_type."
        )
    value = None
    if factory.knob == "threshold":
        if "compression_ratio" in args:
            raise ValueError(f"press={name} takes a threshold, not a compression_ratio: pass threshold=... instead.")
        if "threshold" not in args:
            raise ValueError(f"press={name} needs a threshold: pass e.g. threshold=-3 (or -inf to evict nothing).")
        value = _number("threshold", args["threshold"])
    elif factory.knob == "compression_ratio":
        if "threshold" in args:
            raise ValueError(f"press={name} takes a compression_ratio, not a threshold: pass compression_ratio=0.5.")
        if "compression_ratio" not in args:
            raise ValueError(f"press={name} needs a compression_ratio in [0, 1): pass e.g. compression_ratio=0.5.")
        value = _number("compression_ratio", args["compression_ratio"])
        if not 0 <= value < 1:
            raise ValueError(f"compression_ratio must be in [0, 1), got {value}.")
    elif "threshold" in args or "compression_ratio" in args:
        raise ValueError(f"press={name} evicts nothing and takes no threshold or compression_ratio: drop them.")
    surrogate = args.get("surrogate")
    if surrogate is not None and factory.surrogate_type is None:
        raise ValueError(f"press={name} reads no surrogate: drop surrogate=.")
    if isinstance(surrogate, str) and _looks_local(surrogate) and not Path(surrogate).expanduser().is_dir():
        raise ValueError(f"surrogate={surrogate!r} is not a directory: pass an existing directory or a Hub id.")
    variant = args.get("variant")
    if variant is not None:
        if factory.surrogate_type not in ("mlp", "linear"):
            raise ValueError(f"variant selects a bundled KVzap surrogate; press={name} has none: drop variant.")
        from kvzap.presses import KVzapScorer

        KVzapScorer(factory.surrogate_type, surrogate=surrogate, variant=variant)  # refuses an unknown variant
    storage = args.get("storage", "compact")
    if storage not in ("compact", "masked"):
        raise ValueError(f"storage must be 'compact' or 'masked', got {storage!r}.")
    settings = PressSettings(
        press=name,
        value=value,
        surrogate=surrogate,
        variant=variant,
        window=_integer("window", args.get("window", 128), 0),
        sink_size=None if args.get("sink_size") is None else _integer("sink_size", args["sink_size"], 0),
        decoding=_boolean("decoding", args.get("decoding", False)),
        storage=storage,
        kv_bits=None if args.get("kv_bits") is None else _integer("kv_bits", args["kv_bits"], 1),
        seed=_integer("seed", args.get("seed", 0), 0),
        rolling_chunk=_integer("rolling_chunk", args.get("rolling_chunk", 128), 1),
    )
    settings.build()  # the press's own checks (a window, a decoding the press cannot do, kv_bits), no weights read
    return settings


def _looks_local(text: str) -> bool:
    # A Hub id is "owner/name"; anything starting like a path, or with more parts, is a local path.
    return text.startswith((".", "/", "~")) or text.count("/") != 1 or Path(text).expanduser().exists()


def _model_config(pretrained: str) -> dict[str, Any] | None:
    """The model's config.json as a dict, when it can be read without loading (or converting) the model."""
    from kvzap import models

    try:
        known = models._known(pretrained)
    except (TypeError, ValueError):
        return None
    directory = models.default_cache_dir() / known.name if known is not None else Path(pretrained).expanduser()
    file = directory / "config.json"
    if not file.is_file():
        return None
    config = json.loads(file.read_text(encoding="utf-8"))
    return config.get("text_config", config)


def check_surrogate_fits(settings: PressSettings, pretrained: Any) -> None:
    """Refuse a local KVzap surrogate directory whose shapes cannot fit the model, before the model is loaded.

    Checked when both configs are on disk (a surrogate directory with ``config.json``, and a model directory or an
    already converted known model); otherwise the press checks the weights when it is applied.
    """
    surrogate = settings.surrogate
    if not isinstance(surrogate, (str, os.PathLike)) or settings.press not in ("kvzap_mlp", "kvzap_linear"):
        return
    surrogate_file = Path(surrogate).expanduser() / "config.json"
    if not surrogate_file.is_file() or not (pretrained is None or isinstance(pretrained, (str, os.PathLike))):
        return
    model = _model_config(str(pretrained) if pretrained is not None else None)
    if model is None:
        return
    found = json.loads(surrogate_file.read_text(encoding="utf-8"))
    expected = {
        "n_modules": model.get("num_hidden_layers"),
        "input_dim": model.get("hidden_size"),
        "output_dim": model.get("num_key_value_heads", model.get("num_attention_heads")),
    }
    wrong = [
        f"{key} {found.get(key)} (the model needs {want})" for key, want in expected.items() if found.get(key) != want
    ]
    if wrong:
        raise ValueError(
            f"surrogate={surrogate} does not fit the model {pretrained or 'smollm2-135m'}: {', '.join(wrong)}. "
            "Pass the surrogate trained for this model (`kvzap train all --model ...`), or none for the bundled one."
        )
