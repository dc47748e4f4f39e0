"""Save and load surrogate checkpoints in the published ``nvidia/KVzap-*`` format.

A checkpoint is a directory (local, or a Hugging Face Hub repo) holding two files:

- ``config.json``: a JSON object with a ``model_type`` field plus the constructor arguments of the
  surrogate. Extra keys written by ``transformers`` (``architectures``, ``transformers_version``,
  ``torch_dtype``...) are tolerated and ignored.
- ``model.safetensors``: the state dict of the surrogate.

Nothing here is specific to KVzap: other surrogate families (e.g. Fast KVzip gates) reuse these helpers
with their own ``model_type`` and fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = [
    "CONFIG_NAME",
    "check_finite",
    "WEIGHTS_NAME",
    "SurrogateNotFoundError",
    "check_config_fields",
    "check_weights_header",
    "load_state_dict_strict",
    "load_weights",
    "read_config",
    "read_weights_header",
    "resolve_checkpoint_files",
    "write_checkpoint",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_HOW_TO_FIX = (
    "To fix it, pass a local directory that holds config.json and model.safetensors, "
    "train a surrogate for this model with `kvzap train`, "
    "or go online (unset HF_HUB_OFFLINE, check the repo id, and pass token= for a private or gated repo)."
)

# What hf_hub_download raises when the file cannot be had: no network, offline mode, no such repo,
# revision or file, gated/private repo, invalid repo id. Other errors (disk full, proxy misconfigured)
# propagate unchanged because "surrogate not found" would mislead.
_HUB_NOT_FOUND_ERRORS: tuple[type[BaseException], ...] = (
    EntryNotFoundError,  # includes LocalEntryNotFoundError (not cached while offline) and the remote one
    HfHubHTTPError,  # includes RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError, 5xx
    OfflineModeIsEnabled,
    ConnectionError,
    TimeoutError,
    HFValidationError,
)


class SurrogateNotFoundError(FileNotFoundError):
    """No surrogate checkpoint could be found locally or downloaded from the Hugging Face Hub.

    The message names what was tried and how to fix it.
    """


def _hub_hint(error: BaseException, filename: str) -> str:
    """One sentence saying why a Hub download failed, from the exception that huggingface_hub raised."""
    # Order matters: subclasses before their bases.
    if isinstance(error, HFValidationError):
        return "it is not a valid Hub repo id either (expected 'owner/name')"
    if isinstance(error, GatedRepoError):
        return "the repo is gated: accept its terms on the Hub and pass token="
    if isinstance(error, RepositoryNotFoundError):
        return "the repo does not exist on the Hub, or it is private and no valid token was given"
    if isinstance(error, RevisionNotFoundError):
        return "the requested revision does not exist in the repo"
    if isinstance(error, LocalEntryNotFoundError | OfflineModeIsEnabled | ConnectionError | TimeoutError):
        return f"the Hub could not be reached (offline mode or no network) and {filename} is not in the local cache"
    if isinstance(error, EntryNotFoundError):
        return f"the repo has no file {filename}"
    return "the Hub answered with an error"


def _looks_like_local_path(path: str) -> bool:
    """Whether a string the user passed was meant as a filesystem path rather than a Hub repo id."""
    return (
        os.path.isabs(path)
        or path.startswith(("./", "../", "~", ".\\", "..\\"))
        or path in (".", "..")
        or path.count("/") > 1
        or "\\" in path
    )


def resolve_checkpoint_files(
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
    token: str | bool | None = None,
) -> tuple[Path, Path]:
    """Find the ``config.json`` and ``model.safetensors`` files of a checkpoint.

    Parameters
    ----------
    path_or_repo_id : str or os.PathLike
        A local directory if one exists at that path, otherwise a Hugging Face Hub repo id
        (``"owner/name"``) downloaded with :func:`huggingface_hub.hf_hub_download`.
    revision, cache_dir, token
        Passed to ``hf_hub_download``; ignored for a local directory.
    local_files_only : bool, optional
        Only look in the Hub cache, never on the network. ``None`` keeps huggingface_hub's default
        (which honours ``HF_HUB_OFFLINE``).

    Returns
    -------
    tuple of Path
        ``(config_path, weights_path)``.

    Raises
    ------
    SurrogateNotFoundError
        If the local directory lacks a file, or the Hub is unreachable, the repo, revision or file does
        not exist, or the repo id is invalid.
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)) or not str(path_or_repo_id).strip():
        raise TypeError(
            f"path_or_repo_id must be a local directory or a Hub repo id ('owner/name'), got "
            f"{type(path_or_repo_id).__name__} ({path_or_repo_id!r}). {_HOW_TO_FIX}"
        )
    local = Path(path_or_repo_id).expanduser()
    try:
        is_dir, exists = local.is_dir(), local.exists()
    except (OSError, ValueError) as error:  # name too long, NUL byte, permission denied on a parent
        shown = str(path_or_repo_id)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise SurrogateNotFoundError(
            f"The surrogate path {shown!r} cannot be used ({type(error).__name__}: {error.args[-1]}). {_HOW_TO_FIX}"
        ) from error
    if is_dir:
        files = (local / CONFIG_NAME, local / WEIGHTS_NAME)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SurrogateNotFoundError(
                f"The surrogate directory {str(local)!r} has no {' and no '.join(missing)}. "
                f"A surrogate checkpoint holds {CONFIG_NAME} and {WEIGHTS_NAME}. {_HOW_TO_FIX}"
            )
        return files
    if exists:
        raise SurrogateNotFoundError(
            f"{str(local)!r} is a file, but a surrogate checkpoint is a directory holding {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}. Pass the directory instead."
        )

    repo_id = os.fspath(path_or_repo_id)
    if _looks_like_local_path(repo_id):
        raise SurrogateNotFoundError(
            f"The surrogate directory {repo_id!r} does not exist (and it is not a Hub repo id). {_HOW_TO_FIX}"
        )
    downloaded = []
    for filename in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            path = hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                cache_dir=cache_dir,
                # None would be rejected by some huggingface_hub versions; False still honours HF_HUB_OFFLINE.
                local_files_only=bool(local_files_only),
                token=token,
            )
        except _HUB_NOT_FOUND_ERRORS as error:
            at_revision = f" at revision {revision!r}" if revision else ""
            raise SurrogateNotFoundError(
                f"Could not find the surrogate {repo_id!r}: there is no local directory of that name, and "
                f"downloading {filename} from the Hugging Face Hub repo {repo_id!r}{at_revision} failed because "
                f"{_hub_hint(error, filename)} ({type(error).__name__}). {_HOW_TO_FIX}"
            ) from error
        downloaded.append(Path(path))
    return downloaded[0], downloaded[1]


def read_config(path: str | os.PathLike[str], expected_model_type: str, required: Sequence[str] = ()) -> dict:
    """Read a checkpoint's ``config.json`` and check its ``model_type`` and required fields.

    Parameters
    ----------
    path : str or os.PathLike
        The ``config.json`` file.
    expected_model_type : str
        The value its ``model_type`` field must hold (e.g. ``"kvzap"``).
    required : sequence of str, optional
        Fields that must be present (their value may be ``null``).

    Returns
    -------
    dict
        The whole JSON object, extra keys included; the caller picks the fields it knows.

    Raises
    ------
    ValueError
        If the file is not a JSON object, has another ``model_type``, or lacks a required field.
    """
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(
            f"The surrogate config {str(path)!r} is not valid JSON (or not UTF-8: {error}): write it again with "
            "`save_pretrained`, or restore the file of the checkpoint."
        ) from error
    except OSError as error:
        raise ValueError(f"The surrogate config {str(path)!r} cannot be read: {error}.") from error
    if not isinstance(config, dict):
        raise ValueError(f"The surrogate config {str(path)!r} must hold a JSON object, not {type(config).__name__}.")
    model_type = config.get("model_type")
    if model_type != expected_model_type:
        raise ValueError(
            f"The surrogate config {str(path)!r} has model_type {model_type!r}, expected {expected_model_type!r}: "
            f"this checkpoint is not a {expected_model_type} surrogate."
        )
    missing = [name for name in required if name not in config]
    if missing:
        raise ValueError(
            f"The surrogate config {str(path)!r} lacks the field(s) {', '.join(missing)}; "
            f"a {expected_model_type} config needs {', '.join(required)}."
        )
    return config


def check_config_fields(
    config: Mapping[str, object], path: str | os.PathLike[str], expected: Mapping[str, object] | None
) -> None:
    """Check a config's fields against values known in advance (the model's shapes) before building anything.

    Raises
    ------
    ValueError
        Naming the file, each differing field with both values, and the fix.
    """
    if not expected:
        return
    differing = [
        f"{name} is {config.get(name)!r}, the model needs {value!r}"
        for name, value in expected.items()
        if config.get(name) != value
    ]
    if differing:
        raise ValueError(
            f"The surrogate config {str(path)!r} does not fit the model: {'; '.join(differing)}. Pass the surrogate "
            "trained for this model, or train one with `kvzap train`."
        )


def read_weights_header(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Names, dtypes and shapes of the tensors of a safetensors file, read from its header only.

    Nothing is allocated for the tensors themselves, so a config can be checked against the file before a
    module is built from it.

    Returns
    -------
    dict
        ``name -> (dtype, shape)``, the dtype as safetensors names it (``"F32"``, ``"BF16"``, ``"I64"`` ...).

    Raises
    ------
    ValueError
        If the file is not a readable safetensors file (empty, truncated, corrupt), naming it.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"The surrogate weights {str(path)!r} are not a readable safetensors file ({error}): the file is "
            "empty, truncated or corrupt. Download or copy the checkpoint again, or save it with `save_pretrained`."
        ) from error


#: dtypes a surrogate's weights may have in a file (safetensors names).
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_weights_header(
    header: Mapping[str, tuple[str, tuple[int, ...]]],
    expected_count: int,
    expected_shapes: Callable[[], Mapping[str, tuple[int, ...]]],
    source: str,
    module_name: str,
) -> None:
    """Check a safetensors header against the tensors a config describes, before anything is allocated.

    Parameters
    ----------
    header : the output of :func:`read_weights_header`.
    expected_count : number of tensors the config describes (compared first, so that a config describing
        billions of tensors is refused without listing them).
    expected_shapes : returns ``name -> shape`` for every tensor the config describes (called only when the
        count is within a small factor of the file's, so the names listed stay about as many as the file holds).
    source : the weights file, for the messages.
    module_name : the class the config describes, for the messages.

    Raises
    ------
    ValueError
        For another number of tensors, missing or unexpected names, other shapes, or non-float dtypes.
    """
    if expected_count > 4 * len(header) + 64:
        raise ValueError(
            f"The weights in {source!r} hold {len(header)} tensors, but its config describes a {module_name} with "
            f"{expected_count}. The config and the weights must come from the same checkpoint."
        )
    found = {name: tuple(entry[1]) for name, entry in header.items()}
    _check_shapes(found, expected_shapes(), source, module_name)
    wrong = sorted({dtype for dtype, _ in header.values() if dtype not in _FLOAT_DTYPES})
    if wrong:
        raise ValueError(
            f"The weights in {source!r} have the dtype(s) {', '.join(wrong)}; a {module_name} needs floating-point "
            f"weights ({', '.join(_FLOAT_DTYPES)}). Save the checkpoint again from a float model."
        )


def load_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a safetensors file on CPU (never a pickle), wrapping its errors with the path."""
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"The surrogate weights {str(path)!r} cannot be read ({error}): the file is truncated or corrupt. "
            "Download or copy the checkpoint again, or save it with `save_pretrained`."
        ) from error


def check_finite(module: nn.Module, source: str) -> None:
    """Refuse weights holding NaN or infinity: their scores would silently evict nothing (or everything).

    Raises
    ------
    ValueError
        Naming the source and the first parameter with a non-finite value.
    """
    for name, tensor in module.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"The surrogate weights from {source} hold NaN or infinite values (first in {name!r}): the scores "
                "would be meaningless. Retrain the surrogate, or load an intact checkpoint."
            )


def write_checkpoint(
    directory: str | os.PathLike[str], config: Mapping[str, object], state_dict: Mapping[str, torch.Tensor]
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into a directory (created if needed).

    Parameters
    ----------
    directory : str or os.PathLike
        Where to write; existing files of the same names are overwritten.
    config : mapping
        JSON-serialisable config, written as is (it should hold ``model_type``).
    state_dict : mapping of str to torch.Tensor
        The weights; they are detached, moved to CPU and made contiguous, as safetensors requires.

    Returns
    -------
    Path
        The directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state_dict.items()}
    # "format": "pt" is what transformers checks when it reads a safetensors file.
    save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})
    return directory


def _format_list(items: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def _check_shapes(found: dict, expected: dict, source: str, module_name: str) -> None:
    """Raise one ValueError listing every missing name, unexpected name and shape mismatch between the tensors
    ``found`` in a file and those ``expected`` (both ``name -> shape``)."""
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    mismatched = [
        f"{name}: {found[name]} in the file, {tuple(shape)} expected"
        for name, shape in expected.items()
        if name in found and found[name] != tuple(shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_format_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_format_list(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {_format_list(mismatched)}")
    if problems:
        raise ValueError(
            f"The weights in {source!r} do not match the {module_name} described by its config "
            f"({'; '.join(problems)}). The config and the weights must come from the same checkpoint."
        )


def load_state_dict_strict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str, *, assign: bool = False
) -> None:
    """Load weights into a module after checking that names and shapes match exactly.

    Parameters
    ----------
    module : nn.Module
        The module to fill.
    state_dict : mapping of str to torch.Tensor
        The weights to load.
    source : str
        Where the weights come from (a file name), for the error message.
    assign : bool, optional
        Passed to :meth:`nn.Module.load_state_dict`: ``True`` keeps the tensors of ``state_dict``
        themselves (their dtype included), which also fills a module built on the ``meta`` device.

    Raises
    ------
    ValueError
        Listing every missing key, unexpected key and shape mismatch.
    """
    _check_shapes(
        {name: tuple(tensor.shape) for name, tensor in state_dict.items()},
        {name: tensor.shape for name, tensor in module.state_dict().items()},
        source,
        type(module).__name__,
    )
    module.load_state_dict(state_dict, strict=True, assign=assign)
