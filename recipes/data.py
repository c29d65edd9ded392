"""Finding and loading the train / evaluation splits, whatever form they come in.

``data.path`` may be a hub data set name, a folder of files, one file, or a ``save_to_disk``
folder; ``data.train_file`` / ``data.eval_file`` name files directly. Reading a file is done by
``datasets`` (JSON, JSON lines, parquet, CSV) unless the task supplies a reader for a format of its
own (the official nested SQuAD JSON). Features built from the splits are cached on disk, keyed by
the content of the data, the tokenizer and the feature settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets
from datasets import Dataset, DatasetDict

from recipes.config import DataConfig
from recipes.log import get_logger

log = get_logger(__name__)

SPLIT_PREFIXES = {
    "train": ("train",),
    "eval": ("dev", "validation", "valid", "val", "eval"),
}
EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

# A reader for a task-specific file format: returns None when the file is not in that format.
Reader = Callable[[Path], "Dataset | None"]


class DataError(ValueError):
    """The data cannot be used as given; the message names the file, example and field."""


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    )


def _find_file(folder: Path, role: str) -> Path | None:
    candidates = sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and p.suffix in EXTENSIONS
        and p.name.lower().startswith(SPLIT_PREFIXES[role])
    )
    if len(candidates) > 1:
        raise DataError(
            f"data.path={folder}: several {role} files ({', '.join(p.name for p in candidates)}); "
            f"name one with data.{role}_file=..."
        )
    return candidates[0] if candidates else None


def _read_file(path: Path, reader: Reader | None) -> Dataset:
    if reader is not None:
        dataset = reader(path)
        if dataset is not None:
            return dataset
    builder = EXTENSIONS.get(path.suffix)
    if builder is None:
        raise DataError(
            f"{path}: unknown file type {path.suffix!r}; use JSON, JSON lines, parquet or CSV."
        )
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # datasets raises many types for unreadable files
        raise DataError(f"{path}: could not be read as {builder}: {err}") from None


def _load_saved(path: Path, split: str, role: str) -> Dataset:
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, Dataset):
        if role == "eval":
            raise DataError(
                f"data.path={path} is a single saved split; give the evaluation data with "
                "data.eval_file=..."
            )
        return saved
    if split not in saved:
        raise DataError(
            f"data.path={path} has no split {split!r} (it has {', '.join(saved)}); "
            f"set data.{role}_split."
        )
    return saved[split]


def _load_hub(cfg: DataConfig, split: str, role: str) -> Dataset:
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise DataError(
            f"data.path={cfg.path}: not a local file or folder, and the hub is offline "
            "(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE). Point data.path at a local copy."
        )
    try:
        return datasets.load_dataset(cfg.path, cfg.name, split=split)
    except Exception as err:
        raise DataError(
            f"data.path={cfg.path} (split {split!r}, data.{role}_split) could not be loaded from "
            f"the hub: {err}"
        ) from None


def load_split(
    cfg: DataConfig, role: str, reader: Reader | None = None
) -> tuple[Dataset, str, str]:
    """Load the ``train`` or ``eval`` split described by ``cfg``.

    Returns:
        The examples, a fingerprint of their source (content hash for files) for caching, and a
        description of the source for messages.
    """
    split = cfg.train_split if role == "train" else cfg.eval_split
    explicit = cfg.train_file if role == "train" else cfg.eval_file
    path = Path(explicit or cfg.path).expanduser()
    if explicit is None and path.is_file() and role == "eval":
        raise DataError(
            f"data.path={path} is a single file, used for training; give the evaluation data "
            "with data.eval_file=..."
        )
    if _is_saved_dataset(path):
        dataset = _load_saved(path, split, role)
        return dataset, dataset._fingerprint, f"{path} [{split}]"
    if path.is_dir():
        found = _find_file(path, role)
        if found is None:
            raise DataError(
                f"data.path={path}: no {role} file (looked for {'/'.join(SPLIT_PREFIXES[role])}*"
                f"{'/'.join(EXTENSIONS)}); name it with data.{role}_file=..."
            )
        path = found
    if path.is_file():
        log.info("%s data: %s", role, path)
        return _read_file(path, reader), _file_digest(path), str(path)
    dataset = _load_hub(cfg, split, role)
    return dataset, dataset._fingerprint, f"{cfg.path} [{split}]"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_root(cfg: DataConfig) -> Path:
    """Where processed features are cached (``data.cache_dir``, ``$RECIPES_CACHE``, or home)."""
    root = cfg.cache_dir or os.environ.get("RECIPES_CACHE") or "~/.cache/musa-recipes"
    return Path(root).expanduser()


def cache_key(**parts: object) -> str:
    """A short stable hash of everything that determines a processed data set."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def cached(folder: Path, build: Callable[[], Dataset | DatasetDict]) -> Dataset | DatasetDict:
    """Load ``folder`` if a previous run saved it there, else build, save atomically and load.

    Loading what was just saved (rather than returning the in-memory result) gives every process
    the same memory-mapped files, so the features are not held in RAM once per process.
    """
    if not (folder / ".complete").exists():
        data = build()
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        data.save_to_disk(str(tmp))
        (tmp / ".complete").touch()
        if folder.exists():  # a stale, incomplete folder from an interrupted run
            shutil.rmtree(folder)
        tmp.rename(folder)
        log.info("cached features in %s", folder)
    else:
        log.info("reusing cached features from %s", folder)
    return datasets.load_from_disk(str(folder))
