"""Unpaired preference rows for KTO: a prompt, one completion and whether it is desirable.

Pure functions (no model, no loop), as :mod:`recipes.tasks.chat.preference` is for pairs. Layouts
(``task.format``, detected per row by default):

* ``unpaired``: TRL's ``{"prompt", "completion", "label"}``. The prompt is text (one user turn)
  or a list of messages; the completion is text (one assistant reply) or a list of messages
  starting with the assistant's reply (a completion that repeats the prompt's messages first has
  them taken off, as a pair's). A row of two strings is marked ``text`` (``task.text_rows=raw``
  tokenizes it as TRL does, without a template). ``label`` is a JSON boolean: ``true`` for a
  desirable completion, ``false`` for an undesirable one. Anything else is refused: a string
  (``"true"``), and also the numbers 0 and 1, which TRL's tensors would take silently but which
  as often hold a score or a class id as a verdict (a 1-5 rating's 1 would read as desirable).
* a preference pair in any layout :mod:`recipes.tasks.chat.preference` reads (``explicit``,
  ``implicit``, ``ultrafeedback``): unpaired as TRL's ``unpair_preference_dataset`` does, its
  chosen completion a desirable row and its rejected one an undesirable row. The two rows follow
  each other (TRL puts a whole map batch's chosen rows before its rejected ones; the training
  loader shuffles rows either way).

A row that fits none of this (a missing or non-boolean label, a missing prompt, an empty
completion, a prompt that ends with the assistant's turn) is refused, with its line and field,
in one message for the whole file; that message names ``task.format`` only where a row fits no
layout at all, the one problem naming the layout solves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from datasets import Dataset

import recipes.tasks.chat.preference as preference
import recipes.tasks.chat.rows as row_lib
from recipes.data import DataError
from recipes.log import get_logger
from recipes.tasks.configs.kto import UNPAIRED_FORMATS

log = get_logger(__name__)

FORMATS = UNPAIRED_FORMATS
# text: the row was TRL's standard (plain-text) row, prompt and completion strings.
COLUMNS = ("prompt", "completion", "label", "tools", "text", "place")
# The layouts of a row, as a row that fits none is told.
LAYOUTS = (
    "prompt/completion/label (TRL's unpaired rows) or a preference pair: prompt/chosen/rejected, "
    "chosen/rejected conversations sharing a prompt, or instruction/completions (UltraFeedback)"
)


def detect_format(row: Mapping[str, Any]) -> str | None:
    if "label" in row or "completion" in row:
        return "unpaired"
    return preference.detect_format(row)


def to_rows(
    row: Mapping[str, Any], fmt: str = "auto"
) -> list[tuple[list[row_lib.Message], list[row_lib.Message], bool, bool]]:
    """``row`` as checked (prompt, completion, label, text) rows: one for an unpaired row, two
    for a pair (chosen, then rejected), none for a pair of ties. ValueError names the field."""
    layout = row_lib.layout_of(row, fmt, detect_format, LAYOUTS)
    if layout != "unpaired":
        pair = preference.to_pair(row, layout)
        if pair is None:
            return []
        prompt, chosen, rejected = pair
        text = preference.is_text_pair(row, layout or "auto")
        return [(prompt, chosen, True, text), (prompt, rejected, False, text)]
    label = _label(row)
    if row.get("prompt") is None:
        raise ValueError("field 'prompt' is missing (text or a list of messages)")
    completion = row.get("completion")
    if completion is None:
        raise ValueError("field 'completion' is missing (text or a list of messages)")
    if (isinstance(completion, str) and not completion.strip()) or completion == []:
        raise ValueError("field 'completion' is empty, so there is nothing to judge")
    prompt = row_lib.turns_of(row, "prompt", "user")
    turns = preference._after(prompt, row_lib.turns_of(row, "completion", "assistant"))
    row_lib.check_roles(prompt, "prompt")
    row_lib.check_roles(turns, "completion")
    if prompt[-1]["role"] == "assistant":
        raise ValueError(
            "the prompt ends with an assistant turn; the completion must start with the reply "
            "that is judged"
        )
    if turns[0]["role"] != "assistant" or not row_lib.has_reply(turns[0]):
        raise ValueError(
            "field 'completion' does not start with an assistant reply (text or tool calls)"
        )
    text = isinstance(row["prompt"], str) and isinstance(completion, str)
    return [(prompt, turns, label, text)]


def _label(row: Mapping[str, Any]) -> bool:
    if "label" not in row or row["label"] is None:
        raise ValueError("field 'label' is missing: true (desirable) or false (undesirable)")
    label = row["label"]
    if isinstance(label, bool):
        return label
    hint = " (a number may be a score or a class id; write true or false)"
    raise ValueError(
        f"field 'label' is {row_lib.kind_of(label)} {label!r}, not a boolean: true (desirable) or "
        f"false (undesirable){hint if isinstance(label, (int, float)) else ''}"
    )


def unpaired_dataset(rows: Iterator[tuple[str, Any]], fmt: str, source: str) -> Dataset:
    """The :data:`COLUMNS` of ``(place, row)`` pairs, a pair giving two rows (their place says
    which side); every row that fits no layout is reported in one line, with its place and
    field."""
    normalised = fmt == "normalised"  # rows this module wrote: kept with their text flag
    groups: list[tuple[list[tuple], str | None]] = []  # each source row's rows, and its tools

    def convert(row: Mapping[str, Any]) -> tuple:
        tools = row_lib.json_list(row.get("tools"), "field 'tools'", "JSON schemas")
        if normalised:
            prompt = [row_lib.parse_message(m, "prompt") for m in row["prompt"]]
            completion = [row_lib.parse_message(m, "completion") for m in row["completion"]]
            found = [(prompt, completion, bool(row["label"]), bool(row["text"]))]
        else:
            found = to_rows(row, fmt)
        groups.append((found, tools))
        return (len(groups) - 1,)

    kept = row_lib.rows_dataset(
        rows,
        convert,
        ("group", "place"),
        f"{source}: {{count}} row(s) are not unpaired preference rows or pairs",
        f"name the layout with task.format={'|'.join(FORMATS[1:])}",
    )
    out: dict[str, list] = {name: [] for name in COLUMNS}
    for number, place in zip(kept["group"], kept["place"], strict=True):
        found, tools = groups[number]
        for prompt, completion, label, text in found:
            side = (
                "" if normalised or len(found) == 1 else f" ({'chosen' if label else 'rejected'})"
            )
            values = (prompt, completion, label, tools, text, place + side)
            for name, value in zip(COLUMNS, values, strict=True):
                out[name].append(value)
    if not out["label"]:
        raise DataError(f"{source}: no row to learn from (every pair's completions tie).")
    return Dataset.from_dict(out)


def read_unpaired(path: Path, fmt: str = "auto") -> Dataset | None:
    """A JSON lines or JSON file of rows (None for other files, read by ``datasets``)."""
    return row_lib.read_rows(path, lambda rows: unpaired_dataset(rows, fmt, str(path)))


def normalise(dataset: Dataset, fmt: str, source: str) -> Dataset:
    """Rows read by ``datasets`` (parquet, a saved folder) as unpaired rows, checked by row;
    rows :func:`read_unpaired` read already keep their place."""
    if tuple(dataset.column_names) == COLUMNS:
        return unpaired_dataset(((r["place"], r) for r in dataset), "normalised", source)
    return unpaired_dataset(((f"row {i}", r) for i, r in enumerate(dataset)), fmt, source)
