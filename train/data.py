"""Training prompts: documents from the Hugging Face Hub or local files, cut to 750-1,250-token prompts.

The paper draws its prompts from ``nvidia/Nemotron-Pretraining-Dataset-sample`` (9 subsets), keeping prompts of
750 to 1,250 tokens and up to 500 train + 5 test prompts per subset. :func:`load_prompts` does the same for the
Hub dataset (one subset per dataset config) and for local files:

- a ``.jsonl``/``.json`` file with a ``text`` field (optional ``subset``, ``source`` and ``split`` fields; the
  corpus written by ``python -m train build-corpus`` has all of them),
- a ``.parquet`` file with the same columns,
- a ``.txt`` file (one document per file),
- or a folder of such files (searched recursively).

When the documents carry a ``split`` field it decides train/test (the offline corpus keeps whole sources out
of training that way); otherwise the first ``n_test`` usable documents of each subset, after a seeded shuffle,
are the test prompts and the next ``n_train`` the training prompts.
"""

from __future__ import annotations

import logging
import os
import random
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_DATASET = "nvidia/Nemotron-Pretraining-Dataset-sample"
SPLITS = ("train", "test")
_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}

__all__ = ["DEFAULT_DATASET", "Document", "Prompt", "load_documents", "load_prompts", "make_prompt_ids"]


@dataclass(frozen=True)
class Document:
    """A text with where it came from.

    Attributes
    ----------
    text : str
        The document.
    subset : str
        Group the per-subset quotas apply to (Hub dataset config, corpus kind, or file name).
    source : str
        Finer origin (package, directory, file); informative only.
    split : str or None
        ``"train"`` / ``"test"`` when the data fixes it, else ``None``.
    """

    text: str
    subset: str
    source: str = ""
    split: str | None = None


@dataclass(frozen=True)
class Prompt:
    """A training or test prompt.

    Attributes
    ----------
    ids : list of int
        Token ids, without special tokens (``min_tokens`` to ``max_tokens`` of them).
    subset, source : str
        Origin of the document it was cut from.
    """

    ids: list[int]
    subset: str
    source: str


def _local_files(path: Path) -> list[Path]:
    """Supported data files at ``path`` (a file, or a folder searched recursively), sorted."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _LOCAL_SUFFIXES)
    if not files or any(p.suffix not in _LOCAL_SUFFIXES for p in files):
        raise ValueError(
            f"{path} holds no usable data file; expected .jsonl/.json (with a `text` field), .parquet or .txt files."
        )
    return files


def _load_local(path: Path, text_field: str) -> list[Document]:
    """Read local files through `datasets` (json/parquet/text builders)."""
    import datasets

    documents = []
    for file in _local_files(path):
        builder = _LOCAL_SUFFIXES[file.suffix]
        if builder == "text":
            # One document per .txt file; the subset is the folder that holds it.
            text = file.read_text(encoding="utf-8", errors="replace")
            documents.append(Document(text=text, subset=file.parent.name or "text", source=file.stem))
            continue
        table = datasets.load_dataset(builder, data_files=str(file), split="train")
        if text_field not in table.column_names:
            raise ValueError(f"{file} has no `{text_field}` column (columns: {table.column_names}).")
        for row in table:
            split = row.get("split")
            if split is not None and split not in SPLITS:
                raise ValueError(f"{file}: the `split` field must be 'train' or 'test', got {split!r}.")
            documents.append(
                Document(
                    text=row[text_field],
                    subset=str(row.get("subset") or file.stem),
                    source=str(row.get("source") or file.stem),
                    split=split,
                )
            )
    return documents


def _load_hub(name: str, text_field: str, max_documents: int | None) -> list[Document]:
    """Read every config (subset) of a Hub dataset; needs network access or a populated `datasets` cache."""
    import datasets

    configs = datasets.get_dataset_config_names(name)
    logger.info("Loading %s: %d subsets (%s)", name, len(configs), ", ".join(configs))
    documents = []
    for config in configs:
        table = datasets.load_dataset(name, config, split="train", streaming=max_documents is not None)
        for i, row in enumerate(table):
            if max_documents is not None and i >= max_documents:
                break
            documents.append(Document(text=row[text_field], subset=config, source=config))
    return documents


def load_documents(
    source: str | os.PathLike = DEFAULT_DATASET, *, text_field: str = "text", max_documents: int | None = None
) -> list[Document]:
    """Load documents from a local file/folder or a Hugging Face Hub dataset.

    Parameters
    ----------
    source : str or PathLike, default "nvidia/Nemotron-Pretraining-Dataset-sample"
        An existing local path (file or folder) or a Hub dataset id.
    text_field : str, default "text"
        Column holding the text.
    max_documents : int, optional
        Hub only: read at most this many documents per subset (streaming).

    Returns
    -------
    list of Document
    """
    path = Path(source).expanduser()
    if path.exists():
        documents = _load_local(path, text_field)
    else:
        try:
            documents = _load_hub(str(source), text_field, max_documents)
        except Exception as error:  # the Hub raises many types (connection, gated repo, not found)
            raise RuntimeError(
                f"Could not load the dataset {source!r} from the Hugging Face Hub ({type(error).__name__}: {error}). "
                "Offline, build a local corpus with `python -m train build-corpus` and pass its path."
            ) from error
    logger.info("Loaded %d documents from %s", len(documents), source)
    return documents


def make_prompt_ids(ids: list[int], min_tokens: int, max_tokens: int, rng: random.Random) -> list[int] | None:
    """Cut a window of ``min_tokens`` to ``max_tokens`` tokens at a random offset of a tokenized document.

    Parameters
    ----------
    ids : list of int
        The document's token ids.
    min_tokens, max_tokens : int
        Bounds of the window length.
    rng : random.Random
        Source of the length and offset draws.

    Returns
    -------
    list of int or None
        The window, or ``None`` when the document is shorter than ``min_tokens``.
    """
    if len(ids) < min_tokens:
        return None
    length = rng.randint(min_tokens, min(max_tokens, len(ids)))
    # A random offset avoids always training on headers (license blocks, titles) of long documents.
    offset = rng.randint(0, len(ids) - length)
    return ids[offset : offset + length]


def _stable_seed(seed: int, name: str) -> int:
    """Seed derived from a name, stable across runs (unlike ``hash``)."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


def load_prompts(
    tokenizer,
    source: str | os.PathLike = DEFAULT_DATASET,
    *,
    split: str = "train",
    n_train: int = 500,
    n_test: int = 5,
    min_tokens: int = 750,
    max_tokens: int = 1250,
    seed: int = 0,
    text_field: str = "text",
    documents: list[Document] | None = None,
) -> list[Prompt]:
    """Token-id prompts of one split, with per-subset quotas.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        Tokenizer of the model the prompts are for.
    source : str or PathLike
        See :func:`load_documents`; ignored when ``documents`` is given.
    split : {"train", "test"}
        Which prompts to return.
    n_train, n_test : int
        Prompts per subset for each split (fewer when a subset runs out of long-enough documents).
    min_tokens, max_tokens : int
        Prompt length bounds in tokens (the paper: 750 and 1,250).
    seed : int
        Seed of the document shuffle and window draws; the result is deterministic given the data and seed.
    text_field : str
        See :func:`load_documents`.
    documents : list of Document, optional
        Already loaded documents (saves reloading them for the second split).

    Returns
    -------
    list of Prompt
        Subsets in sorted order, prompts in shuffled order within each subset.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"Need 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}.")
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be non-negative, got {n_train} and {n_test}.")
    if documents is None:
        documents = load_documents(source, text_field=text_field)
    by_subset: dict[str, list[Document]] = defaultdict(list)
    for doc in documents:
        by_subset[doc.subset].append(doc)

    prompts = []
    for subset in sorted(by_subset):
        docs = list(by_subset[subset])
        rng = random.Random(_stable_seed(seed, subset))
        rng.shuffle(docs)
        fixed = any(doc.split is not None for doc in docs)
        quotas = {"train": n_train, "test": n_test}
        taken: dict[str, list[Prompt]] = {"train": [], "test": []}
        for doc in docs:
            # Without a fixed split the test quota is filled first, so train prompts never depend on n_train.
            target = doc.split if fixed else ("test" if len(taken["test"]) < n_test else "train")
            if target is None or len(taken[target]) >= quotas[target]:
                if all(len(taken[s]) >= quotas[s] for s in SPLITS):
                    break
                continue
            ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
            window = make_prompt_ids(ids, min_tokens, max_tokens, rng)
            if window is not None:
                taken[target].append(Prompt(ids=window, subset=subset, source=doc.source))
        if len(taken[split]) < quotas[split]:
            logger.info("Subset %s: only %d %s prompts (asked %d)", subset, len(taken[split]), split, quotas[split])
        prompts.extend(taken[split])
    logger.info("%d %s prompts from %d subsets", len(prompts), split, len(by_subset))
    return prompts
