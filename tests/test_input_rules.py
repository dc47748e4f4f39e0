"""The four input rules every public entry point holds (issue 50 item 6), each a property over all of them.

1. A user's objects (models, surrogates, tensors, configs) are never changed in place unless that is the documented
   purpose, and one scorer used with two models of different dtypes gives each the scores it would get alone.
2. Every tensor a user or a custom scorer hands in has its shape checked before anything changes.
3. Every numeric argument is range-checked (NaN, negative sizes), attributes set after construction included.
4. An input with nothing to work on, or None where an object is needed, gets a clear TypeError/ValueError.

The entry points are enumerated from the packages' ``__all__`` and the presses' and scorers' public attributes:
a new one fails :func:`test_every_entry_point_is_covered` until it is listed here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from transformers import DynamicCache, pipeline

import kvzap
import kvzap.cache
import kvzap.calibrate
import kvzap.kvzip
import kvzap.memory
import kvzap.models
import kvzap.surrogates
from kvzap import (
    BasePress,
    ConstantScorer,
    DMSThresholdPress,
    FastKVzipGates,
    FastKVzipScorer,
    KeyNormScorer,
    KVzapScorer,
    KVzapSurrogate,
    KVzipPlusScorer,
    RandomScorer,
    RecencyScorer,
    Scorer,
    TopKPress,
)
from kvzap.calibrate import calibrate, collect_scores, compression_curve
from tests.adversarial._probe import model_fingerprint, refused
from tests.conftest import char_tokenizer, random_ids, tiny_model

TEXT = "The launch code is 7384. " * 8  # ~200 characters: longer than a window of 8 tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def model_bf16():
    return tiny_model("llama").to(torch.bfloat16)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _surrogate() -> KVzapSurrogate:
    torch.manual_seed(3)
    return KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2, hidden_dim=8)


def _gates() -> FastKVzipGates:
    torch.manual_seed(4)
    return FastKVzipGates(input_dim=64, n_kv_heads=2, n_groups=2, n_modules=2, gate_dim=4, n_sinks=2)


#: One way to build every public scorer, with weights handed in by the user where it takes any.
SCORERS = {
    "KVzapScorer": lambda: KVzapScorer(surrogate=_surrogate()),
    "FastKVzipScorer": lambda: FastKVzipScorer(surrogate=_gates()),
    "KVzipPlusScorer": lambda: KVzipPlusScorer(char_tokenizer(), chunk_size=16),
    "RandomScorer": lambda: RandomScorer(seed=5),
    "KeyNormScorer": KeyNormScorer,
    "RecencyScorer": RecencyScorer,
    "ConstantScorer": lambda: ConstantScorer(0.5),
}
#: One way to build every public press.
PRESSES = {
    "DMSThresholdPress": lambda: DMSThresholdPress(KeyNormScorer(), threshold=-0.6, sliding_window_size=8),
    "TopKPress": lambda: TopKPress(KeyNormScorer(), target_compression=0.5),
}


def _public_classes(base: type) -> dict[str, type]:
    classes = {}
    for name in kvzap.__all__:
        obj = getattr(kvzap, name)
        if inspect.isclass(obj) and issubclass(obj, base) and not inspect.isabstract(obj):
            classes[obj.__name__] = obj
    return classes


# --------------------------------------------------------------------------------------------------------------
# Coverage: every public name is one of the entry points below, or takes no user input
# --------------------------------------------------------------------------------------------------------------

#: Public names that take no input of their own (aliases, types, constants, interfaces implemented by users), or
#: whose inputs are covered by their own test file (named).
NO_INPUT = {
    "kvzap": {"KVzapPress", "DMSPress", "BasePress", "Scorer", "SurrogateNotFoundError", "PrunableLayer"}
    | {"MaskedLayer", "MaskedSlidingWindowLayer"},  # built by presses; their evict is covered below
    "kvzap.cache": {"KVBytes", "LayerState", "PrunableLayer", "masked_sdpa", "own_window", "prunable_layer_like"},
    "kvzap.kvzip": {"SCORING_ATTENTION_NAME", "REPEAT_INSTRUCTION", "KVzipPlusOutput", "RepeatPrompt"},
    "kvzap.models": {"KNOWN_MODELS", "KnownModel", "DEFAULT_MODEL_NAME", "CACHE_ENV_VAR"},
    "kvzap.surrogates": {"SurrogateNotFoundError", "BUNDLED_DIR"},
}
#: Entry points whose inputs the tests below exercise (by name).
COVERED = {
    "kvzap": set(SCORERS) | set(PRESSES) | {"KVzapSurrogate", "FastKVzipGates", "KVPressTextGenerationPipeline"},
    "kvzap.calibrate": {"calibrate", "collect_scores", "compression_curve"},
    "kvzap.cache": {"snapshot_cache", "restore_cache", "kv_bytes", "MaskedLayer", "MaskedSlidingWindowLayer"},
    "kvzap.memory": {"cache_bytes", "freed_share"},
    "kvzap.kvzip": {"kvzip_plus_scores", "build_repeat_prompt", "build_prefill_repeat_prompt", "scoring_attention"},
    "kvzap.models": {"load_model", "resolve_model", "model_name"},
    "kvzap.surrogates": {"KVzapSurrogate", "FastKVzipGates", "FastKVzipGate"},
}
MODULES = {
    "kvzap": kvzap,
    "kvzap.calibrate": kvzap.calibrate,
    "kvzap.cache": kvzap.cache,
    "kvzap.memory": kvzap.memory,
    "kvzap.kvzip": kvzap.kvzip,
    "kvzap.models": kvzap.models,
    "kvzap.surrogates": kvzap.surrogates,
}
#: Helpers of kvzap.models and kvzap.surrogates tested in their own files (tests/test_models.py, tests/surrogates).
OWN_TESTS = {
    "kvzap.models": {"default_cache_dir", "default_model_dir", "find_default_gguf", "is_complete_model_dir"},
    "kvzap.surrogates": {"bundled_surrogate_dir", "list_bundled", "write_checkpoint", "read_config"},
}


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_every_entry_point_is_covered(module_name):
    names = set(MODULES[module_name].__all__)
    known = COVERED.get(module_name, set()) | NO_INPUT.get(module_name, set()) | OWN_TESTS.get(module_name, set())
    missing = {n for n in names - known if not n.startswith("save_gguf")}
    # kvzap.surrogates re-exports the checkpoint helpers, whose inputs tests/surrogates exercises.
    if module_name == "kvzap.surrogates":
        missing = {n for n in missing if not hasattr(kvzap.surrogates.checkpoint, n)}
    assert not missing, f"new public names of {module_name} without an input-rule test: {sorted(missing)}"


def test_every_press_and_scorer_has_a_factory():
    assert set(_public_classes(Scorer)) <= set(SCORERS)
    assert set(_public_classes(BasePress)) <= set(PRESSES)


# --------------------------------------------------------------------------------------------------------------
# Rule 1: a user's objects are not changed; one scorer, two dtypes, each its own scores
# --------------------------------------------------------------------------------------------------------------


def _module_state(module: torch.nn.Module) -> tuple:
    return (
        module.training,
        [(n, p.dtype, p.device, p.requires_grad, p.detach().clone()) for n, p in module.named_parameters()],
    )


def _assert_same_state(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    for (n1, d1, dev1, r1, v1), (n2, d2, dev2, r2, v2) in zip(a[1], b[1], strict=True):
        assert (n1, d1, dev1, r1) == (n2, d2, dev2, r2)
        assert torch.equal(v1, v2)


@pytest.mark.parametrize("make", [_surrogate, _gates], ids=["KVzapSurrogate", "FastKVzipGates"])
def test_a_surrogate_handed_in_is_never_changed(make, model, model_bf16, tok):
    module = make()
    before = _module_state(module)
    scorer = (KVzapScorer if isinstance(module, KVzapSurrogate) else FastKVzipScorer)(surrogate=module)
    for m in (model, model_bf16, model):
        collect_scores(m, tok, scorer, [TEXT])
        _assert_same_state(before, _module_state(module))


def _as_float32(scores: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [s.float() for s in scores[0]]


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_one_scorer_with_two_dtypes_gives_each_model_its_own_scores(name, model, model_bf16, tok):
    alone_32 = _as_float32(collect_scores(model, tok, SCORERS[name](), [TEXT]))
    alone_16 = _as_float32(collect_scores(model_bf16, tok, SCORERS[name](), [TEXT]))
    shared = SCORERS[name]()
    for m, alone in ((model, alone_32), (model_bf16, alone_16), (model, alone_32)):
        if name == "RandomScorer":
            shared.setup(m)  # its draws restart with every press applied (collect_scores applies one)
        got = _as_float32(collect_scores(m, tok, shared, [TEXT]))
        assert all(torch.equal(a, b) for a, b in zip(alone, got, strict=True))


def test_tensors_and_lists_handed_in_are_never_changed(model, tok):
    ids, mask = random_ids(2, 24), torch.ones(2, 24, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    ids_before, mask_before = ids.clone(), mask.clone()
    press = DMSThresholdPress(KeyNormScorer(), threshold=-0.6, sliding_window_size=4, decoding=True)
    with press(model):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(ids, ids_before) and torch.equal(mask, mask_before)
    texts = [TEXT, TEXT[:120]]
    scores = collect_scores(model, tok, KeyNormScorer(), texts)
    saved = [[s.clone() for s in layers] for layers in scores]
    thresholds = torch.tensor([-1.0, -0.5])
    compression_curve(scores, thresholds, 8)
    calibrate(model, tok, KeyNormScorer(), texts, 0.2, scores=scores, sliding_window_size=8)
    assert texts == [TEXT, TEXT[:120]] and torch.equal(thresholds, torch.tensor([-1.0, -0.5]))
    assert all(torch.equal(a, b) for x, y in zip(saved, scores, strict=True) for a, b in zip(x, y, strict=True))


# --------------------------------------------------------------------------------------------------------------
# Rule 2: shapes are checked before anything changes
# --------------------------------------------------------------------------------------------------------------


class _Shaped(Scorer):
    """Minus the key norm, reshaped by ``reshape`` (a custom scorer returning the wrong shape)."""

    def __init__(self, reshape):
        self.reshape = reshape

    def score(self, module, hidden_states, keys, values, positions):
        return self.reshape(-keys.float().norm(dim=-1))  # (B, H, q) before reshaping


WRONG_SHAPES = {
    "one head": lambda s: s[:, :1],
    "one token": lambda s: s[..., :1],
    "heads last": lambda s: s.transpose(1, 2),
    "no batch": lambda s: s[0],
    "extra dim": lambda s: s[..., None],
    "a float": lambda s: 0.0,
    "bool": lambda s: s > 0,
}
USES = {
    "DMSThresholdPress": lambda scorer: DMSThresholdPress(scorer, threshold=-0.6, sliding_window_size=4),
    "DMSThresholdPress decoding": lambda scorer: DMSThresholdPress(
        scorer, threshold=-0.6, sliding_window_size=4, decoding=True
    ),
    "TopKPress": lambda scorer: TopKPress(scorer, target_compression=0.5),
}


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("wrong", sorted(WRONG_SHAPES))
@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_a_custom_scorer_of_the_wrong_shape_is_refused(model, use, wrong, storage):
    press = USES[use](_Shaped(WRONG_SHAPES[wrong]))
    press.storage = storage
    cache = DynamicCache()
    with refused(model, (TypeError, ValueError), "_Shaped.*(shape|tensor|scores)"):
        with press(model):
            model(random_ids(1, 20), past_key_values=cache)


def test_collect_scores_checks_the_scores_shape(model, tok):
    with refused(model, ValueError, "shape"):
        collect_scores(model, tok, _Shaped(WRONG_SHAPES["one token"]), [TEXT])


@pytest.mark.parametrize("storage", ["compact", "masked"])
@pytest.mark.parametrize(
    "mask",
    [torch.zeros(1, 1, 3, dtype=torch.bool), torch.zeros(2, 2, 3, dtype=torch.bool), torch.zeros(1, 2, 3)],
    ids=["one head", "two rows", "float"],
)
def test_an_eviction_mask_of_the_wrong_shape_or_dtype_is_refused(model, storage, mask):
    cache = DynamicCache()
    with DMSThresholdPress(KeyNormScorer(), threshold=-math.inf, storage=storage)(model):
        model(random_ids(1, 10), past_key_values=cache)
    layer = cache.layers[0]
    before = layer.keep_mask().clone()
    with pytest.raises((TypeError, ValueError), match="evict expects"):
        layer.evict(0, mask)
    assert torch.equal(before, layer.keep_mask())


# --------------------------------------------------------------------------------------------------------------
# Rule 3: every numeric argument is range-checked, attributes set later included
# --------------------------------------------------------------------------------------------------------------


def _numeric_attributes(obj) -> list[str]:
    """Public attributes of ``obj`` holding a number (fields of dataclasses, or constructor arguments)."""
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj) if not f.name.startswith("_")]
    else:
        names = [n for n in inspect.signature(type(obj)).parameters if hasattr(obj, n)]
    return [n for n in names if isinstance(getattr(obj, n), (int, float)) and not isinstance(getattr(obj, n), bool)]


def _bad_values(value) -> list:
    return [float("nan"), -1] if isinstance(value, int) else [float("nan")]


ATTRIBUTES = [
    (kind, name, attr)
    for kind, factories in (("scorer", SCORERS), ("press", PRESSES))
    for name, make in sorted(factories.items())
    for attr in _numeric_attributes(make())
]


def test_the_numeric_attributes_are_found():
    found = {(name, attr) for _, name, attr in ATTRIBUTES}
    assert {("DMSThresholdPress", "threshold"), ("DMSThresholdPress", "sliding_window_size")} <= found
    assert {("TopKPress", "target_compression"), ("RandomScorer", "seed"), ("KVzipPlusScorer", "chunk_size")} <= found


@pytest.mark.parametrize(("kind", "name", "attr"), ATTRIBUTES)
def test_a_numeric_attribute_set_later_is_range_checked(model, kind, name, attr):
    obj = (SCORERS if kind == "scorer" else PRESSES)[name]()
    press = obj if kind == "press" else DMSThresholdPress(obj, threshold=-math.inf)
    for bad in _bad_values(getattr(obj, attr)):
        old = getattr(obj, attr)
        with pytest.raises((TypeError, ValueError), match=attr):
            setattr(obj, attr, bad)
        assert getattr(obj, attr) == old
        # Inside `with press(model):` nothing validates again: the attribute refuses at once there too.
        before = model_fingerprint(model)
        with press(model):
            with pytest.raises((TypeError, ValueError), match=attr):
                setattr(obj, attr, bad)
        assert model_fingerprint(model)["attn"] == before["attn"]


# kv_bits (every press) holds None by default, which the search above cannot see as a number: each press is
# checked here, at construction (its factory's press with kv_bits given), set later, and inside the block.
KV_BITS_BAD = [float("nan"), -1, 0, 3, 4, 16, 8.0, "8", True]  # 4: storage only, refused by presses


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_kv_bits_is_checked_on_every_press(model, name):
    press = PRESSES[name]()
    assert press.kv_bits is None
    press.kv_bits = 8
    for bad in KV_BITS_BAD:
        with pytest.raises((TypeError, ValueError), match="kv_bits"):
            press.kv_bits = bad
        assert press.kv_bits == 8
        with pytest.raises((TypeError, ValueError), match="kv_bits"):
            dataclasses.replace(press, kv_bits=bad)
    before = model_fingerprint(model)
    with press(model):
        with pytest.raises((TypeError, ValueError), match="kv_bits"):
            press.kv_bits = float("nan")
    assert model_fingerprint(model)["attn"] == before["attn"]


def _pipe(model, tok):
    return pipeline("kv-press-text-generation", model=model, tokenizer=tok)


NUMERIC_ARGUMENTS = {
    "calibrate target nan": lambda m, t: calibrate(m, t, KeyNormScorer(), [TEXT], float("nan")),
    "calibrate window -1": lambda m, t: calibrate(m, t, KeyNormScorer(), [TEXT], 0.2, sliding_window_size=-1),
    "calibrate max_tokens -1": lambda m, t: calibrate(m, t, KeyNormScorer(), [TEXT], 0.2, max_tokens=-1),
    "collect_scores max_tokens 0": lambda m, t: collect_scores(m, t, KeyNormScorer(), [TEXT], max_tokens=0),
    "curve threshold nan": lambda m, t: compression_curve([[torch.zeros(2, 30)]], [0.0, float("nan")], 8),
    "curve thresholds 2-D": lambda m, t: compression_curve([[torch.zeros(2, 30)]], [[0.0]], 8),
    "curve window -1": lambda m, t: compression_curve([[torch.zeros(2, 30)]], [0.0], -1),
    "kvzip chunk_size 0": lambda m, t: kvzap.kvzip.kvzip_plus_scores(m, t, [5, 6, 7], chunk_size=0),
    "kvzip chunk_size nan": lambda m, t: kvzap.kvzip.kvzip_plus_scores(m, t, [5, 6, 7], chunk_size=float("nan")),
    "KVzipPlusScorer chunk_size -1": lambda m, t: KVzipPlusScorer(t, chunk_size=-1),
    "DMSThresholdPress threshold nan": lambda m, t: DMSThresholdPress(KeyNormScorer(), threshold=float("nan")),
    "DMSThresholdPress window -1": lambda m, t: DMSThresholdPress(KeyNormScorer(), 0.0, sliding_window_size=-1),
    "TopKPress nan": lambda m, t: TopKPress(KeyNormScorer(), target_compression=float("nan")),
    "DMSThresholdPress kv_bits 3": lambda m, t: DMSThresholdPress(KeyNormScorer(), 0.0, kv_bits=3),
    "DMSThresholdPress kv_bits nan": lambda m, t: DMSThresholdPress(KeyNormScorer(), 0.0, kv_bits=float("nan")),
    "ConstantScorer nan": lambda m, t: ConstantScorer(float("nan")),
    "RandomScorer seed -1": lambda m, t: RandomScorer(seed=-1),
    "KVzapSurrogate dim -1": lambda m, t: KVzapSurrogate(64, -1, 2),
    "FastKVzipGates dim 0": lambda m, t: FastKVzipGates(64, 2, 2, 0),
    "pipeline max_new_tokens -1": lambda m, t: _pipe(m, t)(TEXT, question="?", max_new_tokens=-1),
    "pipeline max_context_length nan": lambda m, t: _pipe(m, t)(TEXT, question="?", max_context_length=float("nan")),
    "pipeline prefill_chunk_size 0": lambda m, t: _pipe(m, t)(TEXT, question="?", prefill_chunk_size=0),
    "pipeline batch_size -1": lambda m, t: _pipe(m, t)([TEXT], question="?", batch_size=-1),
}


@pytest.mark.parametrize("case", sorted(NUMERIC_ARGUMENTS))
def test_a_numeric_argument_out_of_range_is_refused(model, tok, case):
    with refused(model, (TypeError, ValueError), "."):
        NUMERIC_ARGUMENTS[case](model, tok)


# --------------------------------------------------------------------------------------------------------------
# Rule 4: nothing to work on, or None for an object, is a clear error
# --------------------------------------------------------------------------------------------------------------

NOTHING_TO_WORK_ON = {
    "calibrate: texts within the window": (
        lambda m, t: calibrate(m, t, KeyNormScorer(), ["short"], 0.2),
        "Nothing to calibrate",
    ),
    "calibrate: an empty text": (lambda m, t: calibrate(m, t, KeyNormScorer(), [""], 0.2), "empty"),
    "calibrate: all scores tied": (
        lambda m, t: calibrate(m, t, ConstantScorer(1.0), [TEXT], 0.2, sliding_window_size=8),
        "same",
    ),
    "calibrate: no text": (lambda m, t: calibrate(m, t, KeyNormScorer(), [], 0.2), "non-empty"),
    "calibrate: a text that is not a string": (lambda m, t: calibrate(m, t, KeyNormScorer(), [None], 0.2), "string"),
    "compression_curve: no scores": (lambda m, t: compression_curve([], [0.0], 8), "collect_scores"),
    "kvzip: no token": (lambda m, t: kvzap.kvzip.kvzip_plus_scores(m, t, []), "non-empty"),
    "press: an input of no token": (
        lambda m, t: _under(PRESSES["DMSThresholdPress"](), m, torch.zeros(1, 0, dtype=torch.long)),
        "no token",
    ),
    "freed_share: an empty cache": (lambda m, t: kvzap.memory.freed_share(DynamicCache()), "no key"),
}
NONE_FOR_AN_OBJECT = {
    "calibrate model": lambda m, t: calibrate(None, t, KeyNormScorer(), [TEXT], 0.2),
    "calibrate tokenizer": lambda m, t: calibrate(m, None, KeyNormScorer(), [TEXT], 0.2),
    "calibrate scorer": lambda m, t: calibrate(m, t, None, [TEXT], 0.2),
    "collect_scores model": lambda m, t: collect_scores(None, t, KeyNormScorer(), [TEXT]),
    "kvzip model": lambda m, t: kvzap.kvzip.kvzip_plus_scores(None, t, [5, 6, 7]),
    "kvzip tokenizer": lambda m, t: kvzap.kvzip.kvzip_plus_scores(m, None, [5, 6, 7]),
    "build_repeat_prompt tokenizer": lambda m, t: kvzap.kvzip.build_repeat_prompt(None, [5, 6, 7]),
    "build_prefill_repeat_prompt tokenizer": lambda m, t: kvzap.kvzip.build_prefill_repeat_prompt(None, [5, 6, 7]),
    "press model": lambda m, t: _under(PRESSES["DMSThresholdPress"](), None, None),
    "DMSThresholdPress scorer": lambda m, t: DMSThresholdPress(None, threshold=0.0),
    "DMSThresholdPress scorer set later": lambda m, t: setattr(PRESSES["DMSThresholdPress"](), "scorer", None),
    "TopKPress scorer": lambda m, t: TopKPress(None, 0.5),
    "TopKPress scorer set later": lambda m, t: setattr(PRESSES["TopKPress"](), "scorer", None),
    "pipeline tokenizer": lambda m, t: kvzap.KVPressTextGenerationPipeline(model=m, tokenizer=None)(TEXT, question="?"),
    "snapshot_cache": lambda m, t: kvzap.cache.snapshot_cache(None),
    "restore_cache cache": lambda m, t: kvzap.cache.restore_cache(None, []),
    "restore_cache states": lambda m, t: kvzap.cache.restore_cache(DynamicCache(), None),
    "kv_bytes": lambda m, t: kvzap.cache.kv_bytes(None),
    "cache_bytes": lambda m, t: kvzap.memory.cache_bytes(None),
    "freed_share": lambda m, t: kvzap.memory.freed_share(None),
    "KVzapSurrogate.from_pretrained": lambda m, t: KVzapSurrogate.from_pretrained(None),
    "FastKVzipGates.from_pretrained": lambda m, t: FastKVzipGates.from_pretrained(None),
    "load_model a number": lambda m, t: kvzap.models.load_model(3),
    "load_model an empty name": lambda m, t: kvzap.models.load_model(""),
    "load_model a dtype by name": lambda m, t: kvzap.models.load_model("x/y", dtype="float32"),
    "resolve_model a number": lambda m, t: kvzap.models.resolve_model(3),
    "model_name a number": lambda m, t: kvzap.models.model_name(3),
}


def _under(press, model, ids):
    with press(model):
        model(ids)


@pytest.mark.parametrize("case", sorted(NOTHING_TO_WORK_ON))
def test_an_input_with_nothing_to_work_on_is_a_clear_error(model, tok, case):
    call, match = NOTHING_TO_WORK_ON[case]
    with refused(model, (TypeError, ValueError), match):
        call(model, tok)


@pytest.mark.parametrize("case", sorted(NONE_FOR_AN_OBJECT))
def test_none_or_a_wrong_object_is_a_clear_error(model, tok, case):
    # A sentence naming what to pass (never an AttributeError from deep inside, which is neither error type).
    with refused(model, (TypeError, ValueError), r"\w+ \w+ .{20,}"):
        NONE_FOR_AN_OBJECT[case](model, tok)


def test_a_restore_into_a_smaller_cache_changes_nothing(model):
    big, small = DynamicCache(), DynamicCache()
    with PRESSES["DMSThresholdPress"]()(model):
        model(random_ids(1, 12), past_key_values=big)
    states = kvzap.cache.snapshot_cache(big)
    small.layers = small.layers[:0]
    with pytest.raises(ValueError, match="checkpoint"):
        kvzap.cache.restore_cache(small, states)
    assert len(small.layers) == 0
