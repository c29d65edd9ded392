"""Finding and loading the train / evaluation splits, whatever form they come in.

``data.path`` may be a hub data set name, a folder of files, one file, or a ``save_to_disk``
folder; ``data.train_file`` / ``data.eval_file`` name files directly. Reading a file is done by
``datasets`` (JSON, JSON lines, parquet, CSV, TSV, plain text) unless the task supplies a reader
for a format of its own (the QA task reads and checks SQuAD JSON and JSON lines itself). When the
source has no evaluation split, a seeded fraction of the training examples is held out
(``data.eval_fraction``) and the log says so. ``data.mix`` lists several local sources with
weights instead of ``data.path``; :func:`load_splits` says how they are mixed.
Features built from the splits are cached on disk, keyed by the content of the data, the tokenizer
and the feature settings.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from datasets import Dataset, DatasetDict
from torch.utils.data import Sampler
from tqdm.auto import tqdm

from recipes.config import DataConfig, DataError, MixSource, first_line, mix_sources
from recipes.log import get_logger

log = get_logger(__name__)

SPLIT_PREFIXES = {
    "train": ("train",),
    "eval": ("dev", "validation", "valid", "val", "eval"),
}
EXTENSIONS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "text",
    ".conll": "conll",  # CoNLL column files (one token a line, tag last): read_conll
}

# A reader for a task-specific file format: returns None when the file is not in that format.
Reader = Callable[[Path], "Dataset | None"]


class MissingSplit(DataError):
    """The source has no split for this role (evaluation data may then be held out)."""


@dataclass
class Split:
    """One split's examples, a fingerprint of exactly what they are (for caching), and where
    they came from (for messages)."""

    examples: Dataset
    fingerprint: str
    source: str
    held_out: bool = False  # split off the training data (data.eval_fraction), not its own file


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


def _unnamed_files(folder: Path) -> list[Path]:
    """All data files of ``folder`` when none is named after a split (one document per file,
    say): they are the training data together. Empty when the folder mixes file types."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in EXTENSIONS)
    named = any(p.name.lower().startswith(SPLIT_PREFIXES["eval"]) for p in files)
    if named or len({p.suffix for p in files}) != 1:
        return []
    return files


def read_text(path: Path) -> str:
    """The file's text as UTF-8 (a leading byte-order mark is dropped, as editors on Windows
    write one); any other encoding is refused, naming the first byte that is not UTF-8."""
    raw = path.read_bytes()
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DataError(
            f"{path}: is UTF-16 text; save it as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8 "
            f"{path.name} > utf8-{path.name})."
        )
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        at = bom + err.start
        line = raw.count(b"\n", 0, at) + 1
        column = at - raw.rfind(b"\n", 0, at)
        raise DataError(
            f"{path}: not UTF-8: byte {at} (line {line}, column {column}) is {raw[at]:#04x}. "
            f"Save the file as UTF-8 (from Latin-1 / Windows-1252: iconv -f CP1252 -t UTF-8 "
            f"{path.name} > utf8-{path.name})."
        ) from None


def _read_files(paths: list[Path], cfg: DataConfig, reader: Reader | None) -> Dataset:
    if reader is not None:
        read = [reader(p) for p in paths]
        if all(d is not None for d in read):
            return read[0] if len(read) == 1 else datasets.concatenate_datasets(read)
    suffix = paths[0].suffix
    builder = EXTENSIONS.get(suffix)
    where = str(paths[0]) if len(paths) == 1 else f"{paths[0].parent} ({len(paths)} files)"
    if builder == "conll":
        read = [read_conll(p) for p in paths]
        return read[0] if len(read) == 1 else datasets.concatenate_datasets(read)
    if builder is None:
        raise DataError(
            f"{where}: unknown file type {suffix!r}; use JSON, JSON lines, parquet, CSV, TSV or "
            ".txt."
        )
    options: dict = {}
    if suffix == ".tsv":
        # GLUE's TSV files hold unbalanced quotes in their sentences and some start with a
        # byte-order mark: read them verbatim.
        options = {"sep": "\t", "quoting": csv.QUOTE_NONE, "encoding": "utf-8-sig"}
    elif builder == "text":
        options = {"sample_by": cfg.sample_by, "keep_linebreaks": True}
    try:
        return datasets.load_dataset(
            builder, data_files=[str(p) for p in paths], split="train", **options
        )
    except Exception as err:  # datasets raises many types for unreadable files
        cause = _root_cause(err)
        if isinstance(cause, UnicodeDecodeError):
            for path in paths:
                read_text(path)  # raises, naming the byte and line
        raise DataError(f"{where}: could not be read as {builder}: {first_line(cause)}") from None


CONLL_DOCSTART = "-DOCSTART-"


def read_conll(path: Path) -> Dataset:
    """A CoNLL column file as rows of ``tokens`` and ``ner_tags`` (strings), plus ``line``: the
    file line of each sentence's first token (token ``i`` is on line ``line + i``).

    One token a line, its tag in the last column, the columns split by tabs when the line has
    one (a token may then hold spaces), else by whitespace; a blank (or whitespace-only) line
    ends a sentence, and ``-DOCSTART-`` lines are dropped, as CoNLL-2003 and WNUT-17 have them.
    A line with a single column (no tag) is refused, naming the line."""
    tokens: list[list[str]] = []
    tags: list[list[str]] = []
    lines: list[int] = []
    sentence: tuple[list[str], list[str]] = ([], [])
    for number, raw in enumerate(read_text(path).splitlines(), start=1):
        if not raw.strip() or raw.split(None, 1)[0] == CONLL_DOCSTART:
            if sentence[0]:
                tokens.append(sentence[0])
                tags.append(sentence[1])
            sentence = ([], [])
            continue
        fields = raw.rstrip("\r\n").split("\t") if "\t" in raw.strip() else raw.split()
        fields = [f.strip() for f in fields]
        if len(fields) < 2 or not fields[-1]:
            raise DataError(
                f"{path} line {number}: {raw.strip()!r} has no tag column (a CoNLL line is a "
                "token, then its tag in the last column, split by a tab or spaces); add the "
                "tag, or a blank line between sentences."
            )
        if not sentence[0]:
            lines.append(number)
        sentence[0].append(fields[0])
        sentence[1].append(fields[-1])
    if sentence[0]:
        tokens.append(sentence[0])
        tags.append(sentence[1])
    return Dataset.from_dict({"tokens": tokens, "ner_tags": tags, "line": lines})


def looks_like_conll(path: Path, probe: int = 50) -> bool:
    """Whether ``path`` (a .txt, .tsv or other text file) is a CoNLL column file: its first
    ``probe`` non-blank lines are all ``-DOCSTART-`` or hold two columns or more, and a blank
    line separates sentences before the probe ends (or the file does)."""
    if path.suffix in (".json", ".jsonl", ".parquet", ".csv"):
        return False
    seen, blank = 0, False
    try:
        with path.open(encoding="utf-8-sig", errors="replace") as handle:
            for raw in handle:
                if not raw.strip():
                    blank = True
                    if seen >= probe:
                        break
                    continue
                if raw.split(None, 1)[0] != CONLL_DOCSTART:
                    fields = raw.strip().split("\t") if "\t" in raw.strip() else raw.split()
                    if len(fields) < 2:
                        return False
                seen += 1
            else:
                blank = blank or seen > 0
    except OSError:
        return False
    return seen > 0 and blank


def _root_cause(err: BaseException) -> BaseException:
    """The error behind ``err``: datasets wraps the parser's error (which says what and where,
    e.g. Arrow's "JSON parse error ... in row 3") in a generic "error while generating"."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _load_saved(path: Path, split: str, role: str) -> Dataset:
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, Dataset):
        if role == "eval":
            raise MissingSplit(f"data.path={path} is a single saved split")
        return saved
    if split not in saved:
        raise (MissingSplit if role == "eval" else DataError)(
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
        if role == "eval" and "split" in str(err).lower():
            raise MissingSplit(f"data.path={cfg.path} has no split {split!r}") from None
        raise DataError(
            f"data.path={cfg.path} (split {split!r}, data.{role}_split) could not be loaded from "
            f"the hub: {err}"
        ) from None


def load_split(cfg: DataConfig, role: str, reader: Reader | None = None) -> Split:
    """Load the ``train`` or ``eval`` split described by ``cfg``, as the source has it.

    Raises:
        MissingSplit: the source has no data for ``role``.
        DataError: the data is there but unusable.
    """
    split = cfg.train_split if role == "train" else cfg.eval_split
    explicit = cfg.train_file if role == "train" else cfg.eval_file
    path = Path(explicit or cfg.path).expanduser()
    if explicit is None and path.is_file() and role == "eval":
        raise MissingSplit(f"data.path={path} is a single file, used for training")
    if _is_saved_dataset(path):
        dataset = _load_saved(path, split, role)
        return Split(dataset, dataset._fingerprint, f"{path} [{split}]")
    if path.is_dir():
        found = _find_file(path, role)
        files = [found] if found else (_unnamed_files(path) if role == "train" else [])
        if not files:
            raise (MissingSplit if role == "eval" else DataError)(
                f"data.path={path}: no {role} file (looked for {'/'.join(SPLIT_PREFIXES[role])}*"
                f"{'/'.join(EXTENSIONS)}); name it with data.{role}_file=..."
            )
    elif path.is_file():
        files = [path]
    else:
        dataset = _load_hub(cfg, split, role)
        return Split(dataset, dataset._fingerprint, f"{cfg.path} [{split}]")
    log.info("%s data: %s", role, files[0] if len(files) == 1 else f"{len(files)} files in {path}")
    digest = cache_key(files=[_file_digest(p) for p in files], sample_by=cfg.sample_by)
    source = str(files[0]) if len(files) == 1 else f"{path} ({len(files)} files)"
    return Split(_read_files(files, cfg, reader), digest, source)


def pick_column(
    split: Split,
    key: str,
    explicit: str | None,
    candidates: Sequence[str],
    also: Sequence[str] = (),
) -> str:
    """The column ``data.<key>`` names (``explicit``; refused when the rows lack it), else the
    first of ``candidates`` the rows have, then of ``also`` (found by the caller's own rule);
    refused, naming the candidates, when there is none."""
    have = split.examples.column_names
    if explicit is not None:
        if explicit not in have:
            raise DataError(
                f"data.{key}={explicit}: no such column in {split.source} (it has "
                f"{', '.join(have)})."
            )
        return explicit
    found = [c for c in (*candidates, *also) if c in have]
    if not found:
        raise DataError(
            f"{split.source}: none of the columns {', '.join(candidates)} found (it has "
            f"{', '.join(have)}); name it with data.{key}=..."
        )
    return found[0]


def load_predict_file(cfg: DataConfig, reader: Reader | None = None) -> Split:
    """The rows of ``data.predict_file`` (mode=predict), read as a training file would be."""
    path = Path(str(cfg.predict_file)).expanduser()
    if not path.is_file():
        raise DataError(
            f"data.predict_file={cfg.predict_file}: not a file. Give one file of rows "
            "(JSON lines, JSON, CSV, TSV, parquet or text)."
        )
    log.info("predict data: %s", path)
    digest = cache_key(files=[_file_digest(path)], sample_by=cfg.sample_by)
    split = Split(_read_files([path], cfg, reader), digest, str(path))
    if len(split.examples) == 0:
        raise DataError(f"data.predict_file={path}: holds no rows.")
    return split


def load_splits(cfg: DataConfig, reader: Reader | None = None) -> dict[str, Split]:
    """The ``train`` and ``eval`` splits, with ``data.max_*_examples`` applied.

    Without an evaluation split in the source, ``data.eval_fraction`` of the training examples
    (chosen with ``data.split_seed``) are held out for evaluation and the log reports it. With
    ``data.mix``, see :func:`_load_mix`.
    """
    sources = mix_sources(cfg)
    if sources:
        train, held = _load_mix(cfg, sources, reader)
    else:
        train = load_split(cfg, "train", reader)
        _require_examples(train, "train", cfg)
        try:
            held = load_split(cfg, "eval", reader)
        except MissingSplit as err:
            held, train = _hold_out(train, cfg, reason=str(err))
    splits = {"train": train, "eval": held}
    for role, limit in (("train", cfg.max_train_examples), ("eval", cfg.max_eval_examples)):
        split = splits[role]
        _require_examples(split, role, cfg)
        if limit is not None and limit < len(split.examples):
            split.examples = split.examples.select(range(limit))
            split.fingerprint = f"{split.fingerprint} first {limit}"
    return splits


def _load_mix(
    cfg: DataConfig, sources: list[MixSource], reader: Reader | None
) -> tuple[Split, Split]:
    """(train, eval) of ``data.mix``: each source read as ``data.path`` would be, its training
    rows weighted by :func:`_weigh`, then all concatenated and shuffled with ``data.split_seed``.

    Evaluation: ``data.eval_file`` when set; else every source's own evaluation split (a dev file
    in its folder) or, without one, its ``data.eval_fraction`` held out before weighting, so no
    repeated training row is evaluated on. Evaluation rows are not weighted.
    """
    trains, helds = [], []
    for i, source in enumerate(sources):
        one = dataclasses.replace(cfg, path=source.path, mix=None, eval_file=None)
        train = load_split(one, "train", reader)
        if len(train.examples) and cfg.eval_file is None:
            try:
                helds.append(load_split(one, "eval", reader))
            except MissingSplit as err:
                held, train = _hold_out(train, one, reason=str(err))
                helds.append(held)
        trains.append(_weigh(train, source.weight, cfg.split_seed, f"data.mix[{i}]"))
    held = load_split(cfg, "eval", reader) if cfg.eval_file else _concatenate(helds, "eval", cfg)
    return _concatenate(trains, "train", cfg), held


def _weigh(split: Split, weight: float, seed: int, where: str) -> Split:
    """``round(weight x rows)`` rows of ``split``: every row ``floor`` times over, then the rest
    drawn without replacement with ``seed`` (weight 2.5: each row twice, and half of them once
    more), kept in file order (the mix is shuffled as a whole)."""
    rows = len(split.examples)
    if rows == 0:
        raise DataError(
            f"{where} {split.source}: holds no examples. Point {where}.path at a file or folder "
            "with data, or drop the entry."
        )
    target = math.floor(weight * rows + 0.5)
    if target == 0:
        raise DataError(
            f"{where}.weight={weight:g}: keeps none of the {rows} rows of {split.source}; use a "
            f"weight of at least {0.5 / rows:.2g}, or drop the entry."
        )
    copies, rest = divmod(target, rows)
    drawn = np.sort(np.random.default_rng(seed).permutation(rows)[:rest])
    indices = np.concatenate([np.tile(np.arange(rows), copies), drawn])
    log.info(
        "train data %s %s: %d rows -> %d (weight %g)", where, split.source, rows, target, weight
    )
    return Split(
        split.examples.select(indices),
        f"{split.fingerprint} weight {weight!r} seed {seed}",
        split.source,
        split.held_out,
    )


def _concatenate(parts: list[Split], role: str, cfg: DataConfig) -> Split:
    """One split of ``parts``, shuffled with ``data.split_seed`` (``data.max_*_examples`` then
    keep a share of every source). Columns some sources lack are dropped, not filled with
    nulls (a task then names a column it needs and no longer finds)."""
    shared = set.intersection(*(set(p.examples.column_names) for p in parts))
    for part in parts:
        extra = [c for c in part.examples.column_names if c not in shared]
        if extra:
            log.warning(
                "%s data %s: column(s) %s dropped (not in every source of data.mix)",
                role,
                part.source,
                ", ".join(extra),
            )
    try:
        examples = datasets.concatenate_datasets(
            [
                p.examples.select_columns([c for c in p.examples.column_names if c in shared])
                for p in parts
            ]
        )
    except ValueError as err:
        columns = "; ".join(f"{p.source}: {', '.join(p.examples.column_names)}" for p in parts)
        raise DataError(
            f"data.mix: the {role} sources do not share one layout ({first_line(err)}): "
            f"{columns}. Give every source the same columns, of the same types."
        ) from None
    return Split(
        examples.shuffle(seed=cfg.split_seed),
        cache_key(mix=[p.fingerprint for p in parts], seed=cfg.split_seed),
        f"data.mix ({', '.join(p.source for p in parts)})",
        held_out=all(p.held_out for p in parts),
    )


def _require_examples(split: Split, role: str, cfg: DataConfig) -> None:
    if len(split.examples) == 0:
        key = f"data.{role}_file" if getattr(cfg, f"{role}_file") else "data.path"
        raise DataError(
            f"{role} data {split.source}: holds no examples. Point {key} at a file or "
            "folder with data (and check data.train_split / data.eval_split)."
        )


def _hold_out(train: Split, cfg: DataConfig, reason: str) -> tuple[Split, Split]:
    """(eval, train): ``data.eval_fraction`` of ``train`` held out for evaluation, the rest."""
    if not cfg.eval_fraction:
        raise DataError(
            f"{reason}, and data.eval_fraction=0. Give evaluation data with "
            "data.eval_file=... (or data.eval_split=...), or hold out part of the "
            "training data with data.eval_fraction=0.05."
        ) from None
    total = len(train.examples)
    try:
        parts = train.examples.train_test_split(
            test_size=cfg.eval_fraction, seed=cfg.split_seed, shuffle=True
        )
    except ValueError:  # one of the two parts would be empty
        raise DataError(
            f"train data {train.source}: {total} example(s) are too few to hold out "
            f"data.eval_fraction={cfg.eval_fraction} of them for evaluation and train on the "
            "rest. Give evaluation data with data.eval_file=..., or use more training data."
        ) from None
    tag = f"held out {cfg.eval_fraction} seed {cfg.split_seed}"
    log.info(
        "%s; holding out %d of its %d examples for evaluation (data.eval_fraction=%s, "
        "data.split_seed=%d)",
        reason,
        len(parts["test"]),
        total,
        cfg.eval_fraction,
        cfg.split_seed,
    )
    source = f"{train.source} ({tag})"
    return (
        Split(parts["test"], f"{train.fingerprint} {tag} test", source, held_out=True),
        Split(parts["train"], f"{train.fingerprint} {tag} train", source, held_out=True),
    )


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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What about a tokenizer decides the features it makes (its whole definition when fast).

    Without the fast tokenizer's truncation and padding state: each call with ``truncation=``
    or ``padding=`` sets it, so it says what the last call asked for, not what the tokenizer is
    (the same features would get a new key once a tokenizer had been used)."""
    if tokenizer.is_fast:
        definition: Any = json.loads(tokenizer.backend_tokenizer.to_str())
        definition.pop("truncation", None)
        definition.pop("padding", None)
    else:
        definition = sorted(tokenizer.get_vocab())
    return cache_key(
        definition=definition, cls=type(tokenizer).__name__, side=tokenizer.padding_side
    )


def cached(folder: Path, build: Callable[[], Dataset | DatasetDict]) -> Dataset | DatasetDict:
    """Load ``folder`` if a previous run saved it there, else build, save atomically and load.

    Loading what was just saved (rather than returning the in-memory result) gives every process
    the same memory-mapped files, so the features are not held in RAM once per process. A build
    with an empty split is refused (:class:`DataError`), not saved: ``datasets`` cannot load an
    empty saved split back (an IndexError from deep inside ``load_from_disk``).
    """
    if (folder / ".complete").exists() and _saved_empty(folder):
        log.warning(
            "%s holds an empty split (saved by an older release): building it again", folder
        )
        shutil.rmtree(folder, ignore_errors=True)
    if not (folder / ".complete").exists():
        data = build()
        _refuse_empty(data, folder)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        data.save_to_disk(str(tmp))
        (tmp / ".complete").touch()
        if (folder / ".complete").exists():  # another run sharing the cache finished first
            shutil.rmtree(tmp)
        else:
            if folder.exists():  # a stale, incomplete folder from an interrupted run
                shutil.rmtree(folder)
            try:
                tmp.rename(folder)
            except OSError:  # another run renamed its copy in between
                if not (folder / ".complete").exists():
                    raise
                shutil.rmtree(tmp)
        log.info("cached features in %s", folder)
    else:
        log.info("reusing cached features from %s", folder)
    return datasets.load_from_disk(str(folder))


def split_key(role: str, split: Split, tokenizer: Any, **parts: object) -> str:
    """The cache key of a split's features: its role, its data, the tokenizer, and ``parts``
    (what else shapes them: the task's feature settings, its features' version)."""
    return cache_key(
        role=role, data=split.fingerprint, tokenizer=tokenizer_fingerprint(tokenizer), **parts
    )


def cached_features(
    cfg: DataConfig,
    name: str,
    role: str,
    split: Split,
    tokenizer: Any,
    build: Callable[[], Dataset],
    **parts: object,
) -> Dataset:
    """A task's features of ``split``, built by ``build`` once and cached (:func:`cached`) as
    ``<name>-<role>-<key>`` under the cache root, the key from :func:`split_key`."""
    key = split_key(role, split, tokenizer, **parts)
    return cached(cache_root(cfg) / f"{name}-{role}-{key}", build)


def _refuse_empty(data: Dataset | DatasetDict, folder: Path) -> None:
    """Raise DataError if ``data`` (or a split of it) has no rows: a task that drops rows says
    why before this (SFT's "every conversation was dropped"); this is the backstop."""
    parts = data.items() if isinstance(data, DatasetDict) else [("", data)]
    empty = [name for name, part in parts if len(part) == 0]
    if empty:
        split = f" (split {', '.join(empty)})" if empty != [""] else ""
        raise DataError(
            f"features {folder.name}{split}: the task built no rows from the data, and an empty "
            "split cannot be cached; check that the data has rows the task keeps (its length "
            "settings, task.max_seq_length and task.truncation, drop rows that do not fit)."
        )


def _saved_empty(folder: Path) -> bool:
    """Whether a saved dataset (or a split of a saved dict) in ``folder`` has no data files."""
    for state in (folder / "state.json", *folder.glob("*/state.json")):
        try:
            if state.is_file() and not json.loads(state.read_text()).get("_data_files"):
                return True
        except (OSError, ValueError):
            return True  # unreadable: build it again
    return False


# Progress bars for data preparation and the QA answer search, on the local main process only
# (other processes stay silent); trainer.progress_bar=false turns them off (show_progress).
_progress = True
PROGRESS_DELAY_S = 2.0  # a bar of ours shows only once its step has run this long
MAP_PROGRESS_ROWS = 1000  # a datasets .map over fewer rows draws no bar (it has no delay)


def show_progress(enabled: bool) -> None:
    """Whether data preparation and the QA answer search draw progress bars
    (``trainer.progress_bar``); they are only ever drawn on the local main process."""
    global _progress
    _progress = enabled


def progress_enabled() -> bool:
    """What :func:`show_progress` last set (``trainer.progress_bar``)."""
    return _progress


def progress_wanted() -> bool:
    """Bars are on (:func:`show_progress`) and this is the local main process."""
    return _progress and _is_local_main_process()


def _is_local_main_process() -> bool:
    from accelerate import PartialState

    if PartialState._shared_state:  # the run's Accelerator is set up: ask it
        return PartialState().is_local_main_process
    return int(os.environ.get("LOCAL_RANK", "0")) == 0  # as a launcher sets it


def progress(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A tqdm bar for a step of ours (``desc``, ``total``, ``unit``), drawn on stderr once the
    step has run for :data:`PROGRESS_DELAY_S` seconds, and only where :func:`progress_wanted`;
    it disappears when done."""
    return tqdm(
        iterable,
        disable=not progress_wanted(),
        delay=PROGRESS_DELAY_S,
        leave=False,
        dynamic_ncols=True,
        **kwargs,
    )


@contextmanager
def map_progress(rows: int) -> Iterator[None]:
    """``datasets``' progress bars (each ``.map``'s ``desc``) for the block's work on ``rows``
    rows: on where :func:`progress_wanted` and the rows are many (:data:`MAP_PROGRESS_ROWS`; a
    smaller map takes about a second), off otherwise, and as they were after the block
    (:func:`recipes.log.setup_logging` keeps them off: saving and loading draw bars too).
    ``HF_DATASETS_DISABLE_PROGRESS_BARS``, when set, decides instead."""
    if getattr(datasets.config, "HF_DATASETS_DISABLE_PROGRESS_BARS", None) is not None:
        yield
        return
    was_disabled = datasets.are_progress_bars_disabled()
    show = rows >= MAP_PROGRESS_ROWS and progress_wanted()
    (datasets.enable_progress_bars if show else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.disable_progress_bars if was_disabled else datasets.enable_progress_bars)()


def feature_lengths(features: Any) -> np.ndarray:
    """Tokens per feature (``input_ids``; a task whose features have none, as DPO's pairs,
    gives a ``length`` column), read from Arrow without a Python list per feature."""
    import pyarrow.compute as pc

    table = features.with_format("arrow")[:]
    if "length" in table.column_names:
        return table.column("length").to_numpy()
    return pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)


class EpochLengthGroupedSampler(Sampler[int]):
    """Batches of similar lengths, in random order, drawn from ``(seed, epoch)``.

    Like transformers' ``LengthGroupedSampler``, the epoch's permutation is cut into megabatches
    of ``megabatch`` batches and each megabatch is sorted by length, so a batch holds features of
    similar lengths and little padding. Unlike it, the batches are then shuffled across the
    epoch: transformers keeps every megabatch in descending order, so an epoch runs long-to-short
    several times over (with 2,000 features and batches of 24, four times), an order that a short
    fine-tuning run and its learning-rate schedule feel. Here only the batch holding the longest
    feature is moved first, so an out-of-memory shows at step 1. The order depends on
    ``(seed, epoch)`` alone: every process and a resumed run draw the same one.

    Args:
        batch_size: The global batch (per device x processes x accumulation): consecutive slices
            of this size are the optimizer steps, so every layout of the same global batch (more
            processes, more accumulation) trains on the same examples at each step.
        lengths: Tokens per feature.
        seed: The run's seed.
        megabatch: Batches per sorted group, at most a quarter of the epoch's (as transformers).
    """

    def __init__(
        self, batch_size: int, lengths: Sequence[int] | np.ndarray, seed: int, megabatch: int = 50
    ) -> None:
        self.batch_size = batch_size
        self.lengths = torch.tensor(np.asarray(lengths))  # a copy: Arrow's arrays are read-only
        self.seed = seed
        self.megabatch = max(1, min(megabatch, len(lengths) // (batch_size * 4)))
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator)
        size = self.megabatch * self.batch_size
        batches = []
        for first in range(0, len(order), size):
            group = order[first : first + size]
            group = group[torch.sort(self.lengths[group], descending=True, stable=True).indices]
            batches.extend(group.split(self.batch_size))
        # A short batch (the epoch's remainder) can only come last, or every later batch shifts.
        short = [batches.pop()] if batches and len(batches[-1]) < self.batch_size else []
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        if batches:
            longest = max(range(len(batches)), key=lambda i: int(self.lengths[batches[i][0]]))
            batches[0], batches[longest] = batches[longest], batches[0]
            # The remainder is a sorted group's tail, or a whole small group: its first is its
            # longest, and may be the epoch's. (The batches are views of one fresh tensor each.)
            if short and self.lengths[short[0][0]] > self.lengths[batches[0][0]]:
                batches[0][0], short[0][0] = short[0][0].item(), batches[0][0].item()
        return iter(torch.cat([*batches, *short]).tolist() if batches or short else [])


class RepeatedStepsSampler(Sampler[int]):
    """The epoch's random order (drawn from ``(seed, epoch)``, the same on every process and in a
    resumed run), cut into optimizer steps of ``batch_size`` (the global batch), each step given
    ``repeat`` times in a row: GRPO's ``num_iterations``, several optimizer steps on one
    generation batch (TRL's ``RepeatSampler`` repeats its generation batches the same way). An
    epoch is ``repeat`` times as many steps."""

    def __init__(self, size: int, batch_size: int, repeat: int, seed: int) -> None:
        self.size, self.batch_size, self.repeat, self.seed = size, batch_size, repeat, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size * self.repeat

    def __iter__(self):
        order = torch.randperm(
            self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        steps = order.split(self.batch_size)
        return iter([i for step in steps for _ in range(self.repeat) for i in step.tolist()])


def length_pieces(lengths: Sequence[int], pieces: int) -> list[list[int]]:
    """Cut a batch into at most ``pieces`` groups of rows, each padded to its own longest, with
    the fewest padded tokens in all: the rows sorted longest first, then the cut points that
    minimise the sum of (rows x longest) over the groups (a small dynamic programme: a batch has
    tens of rows). Returns the row indices of each group, longest group first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    sizes = [lengths[i] for i in order]
    n, pieces = len(sizes), max(1, min(pieces, len(sizes)))
    # cost[k][j]: fewest tokens for the first j sorted rows in k groups; cut[k][j]: where the
    # last of those groups starts.
    cost = [[0] + [math.inf] * n] + [[math.inf] * (n + 1) for _ in range(pieces)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    for k in range(1, pieces + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                tokens = cost[k - 1][i] + (j - i) * sizes[i]
                if tokens < cost[k][j]:
                    cost[k][j], cut[k][j] = tokens, i
    k = min(range(1, pieces + 1), key=lambda k: (cost[k][n], k))  # fewer groups on a tie
    groups, end = [], n
    while k:
        start = cut[k][end]
        groups.append(order[start:end])
        end, k = start, k - 1
    return groups[::-1]


class SubBatchCollator:
    """Collates a batch as length-sorted sub-batches (``trainer.sub_batches``): a list of batches,
    each padded to its own longest, which the loop runs as one micro-batch (their losses weighted
    by rows). The examples of every step stay those of the plain batch, so training follows the
    same path as without it (the gradient is the same up to float rounding) in fewer padded
    tokens. For tasks whose loss is a mean over rows.

    Why not a library's: transformers and accelerate only group by length across batches
    (``LengthGroupedSampler``, ``group_by_length``), which changes what each step learns from."""

    def __init__(
        self, collate: Callable[[list[dict]], dict], pieces: int, multiple: int | None
    ) -> None:
        self.collate = collate
        self.pieces = pieces
        self.multiple = multiple or 1

    def __call__(self, features: list[dict]) -> list[dict]:
        lengths = [-(-len(f["input_ids"]) // self.multiple) * self.multiple for f in features]
        groups = length_pieces(lengths, self.pieces)
        return [self.collate([features[i] for i in group]) for group in groups]
