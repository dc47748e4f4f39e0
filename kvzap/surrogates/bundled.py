"""Surrogates shipped inside the package, found by model name with no network access.

Layout: ``BUNDLED_DIR/<model name>/<model_type>/{config.json,model.safetensors}``, where ``<model name>``
is the last path component of the model's ``name_or_path`` (e.g. ``SmolLM2-135M-Instruct``).
"""

from __future__ import annotations

from pathlib import Path

from kvzap.surrogates.checkpoint import CONFIG_NAME, WEIGHTS_NAME

__all__ = ["BUNDLED_DIR", "bundled_surrogate_dir", "list_bundled"]

BUNDLED_DIR: Path = Path(__file__).resolve().parent / "bundled"


def _is_checkpoint(directory: Path) -> bool:
    return (directory / CONFIG_NAME).is_file() and (directory / WEIGHTS_NAME).is_file()


def _short_name(model_name: str) -> str:
    # "HuggingFaceTB/SmolLM2-135M-Instruct", "/models/SmolLM2-135M-Instruct/" -> "SmolLM2-135M-Instruct"
    return model_name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _find_child(parent: Path, name: str) -> Path | None:
    """The sub-directory ``name`` of ``parent``: exact match first, then a case-insensitive one."""
    exact = parent / name
    if exact.is_dir():
        return exact
    # sorted() so that two directories differing only by case resolve the same way on every machine.
    for child in sorted(parent.iterdir()):
        if child.is_dir() and child.name.lower() == name.lower():
            return child
    return None


def bundled_surrogate_dir(model_name: str, model_type: str) -> Path | None:
    """The directory of the bundled surrogate for a model, if the package ships one.

    Parameters
    ----------
    model_name : str
        The model's name or ``name_or_path`` (``"HuggingFaceTB/SmolLM2-135M-Instruct"`` or a local
        directory); only its last path component is used, matched exactly, else case-insensitively.
    model_type : str
        The surrogate family, e.g. ``"linear"`` or ``"mlp"``.

    Returns
    -------
    Path or None
        A directory holding ``config.json`` and ``model.safetensors``, or ``None`` if none is bundled.

    Raises
    ------
    ValueError
        If ``model_name`` or ``model_type`` is empty.
    """
    name = _short_name(model_name)
    if not name:
        raise ValueError(f"model_name must name a model, got {model_name!r}.")
    if not model_type or "/" in model_type or "\\" in model_type:
        raise ValueError(f"model_type must be a surrogate type such as 'linear' or 'mlp', got {model_type!r}.")
    if not BUNDLED_DIR.is_dir():
        return None
    model_dir = _find_child(BUNDLED_DIR, name)
    if model_dir is None:
        return None
    surrogate_dir = _find_child(model_dir, model_type)
    if surrogate_dir is None or not _is_checkpoint(surrogate_dir):
        return None
    return surrogate_dir


def list_bundled() -> dict[str, list[str]]:
    """Every bundled surrogate.

    Returns
    -------
    dict of str to list of str
        Model name -> sorted surrogate types (e.g. ``{"SmolLM2-135M-Instruct": ["linear", "mlp"]}``);
        only complete checkpoints are listed.
    """
    if not BUNDLED_DIR.is_dir():
        return {}
    bundled = {}
    for model_dir in sorted(BUNDLED_DIR.iterdir()):
        if not model_dir.is_dir():
            continue
        types = sorted(d.name for d in model_dir.iterdir() if d.is_dir() and _is_checkpoint(d))
        if types:
            bundled[model_dir.name] = types
    return bundled
