"""Preference pairs for DPO: the layouts users have, read into one form, a prompt conversation
and two completions of it, the chosen and the rejected.

Pure functions (no model, no loop), as :mod:`recipes.tasks.chat` is for conversations, whose
messages (and checks of them) a pair reuses. Layouts (``task.format``, detected per row by
default):

* ``explicit``: TRL's ``{"prompt", "chosen", "rejected"}``. The prompt is text (one user turn) or
  a list of messages; each completion is text (one assistant turn) or a list of messages. A
  completion that repeats the prompt's messages first (UltraFeedback-binarized rows, whose
  ``chosen`` is the whole conversation) has them taken off. A row of three strings (TRL's
  standard row) is marked ``text``: ``task.text_rows=raw`` tokenizes it as TRL does, no template.
* ``implicit``: ``{"chosen", "rejected"}``, two whole conversations sharing a prefix: the prompt
  is the messages they share (TRL's ``extract_prompt``), each completion the rest.
* ``ultrafeedback``: raw UltraFeedback, ``{"instruction", "completions": [{"response",
  "overall_score"}, ...]}``: the best-scored completion is chosen and the worst rejected; a row
  whose completions all score the same carries no preference and is left out (counted in the
  log).

A completion starts with an assistant turn that holds a reply (text or tool calls); a prompt
ends before it, with a user (or tool) turn. A row that fits none of this is refused, with its
line and field, in one message for the whole file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from datasets import Dataset

from recipes.data import DataError
from recipes.log import get_logger
from recipes.tasks.chat.rows import (
    Message,
    check_roles,
    has_reply,
    json_list,
    kind_of,
    layout_of,
    read_rows,
    rows_dataset,
    turns_of,
)
from recipes.tasks.configs.dpo import PAIR_FORMATS

log = get_logger(__name__)

FORMATS = PAIR_FORMATS
# text: the row was TRL's standard (plain-text) pair, prompt, chosen and rejected all strings;
# margin: the row's own, a number or None (TRL's optional column, read by task=reward_model).
COLUMNS = ("prompt", "chosen", "rejected", "tools", "text", "margin", "place")
# The layouts of a pair, as a row that fits none is told.
LAYOUTS = (
    "prompt/chosen/rejected (TRL), chosen/rejected conversations sharing a prompt, or "
    "instruction/completions (UltraFeedback)"
)


def detect_format(row: Mapping[str, Any]) -> str | None:
    if "completions" in row:
        return "ultrafeedback"
    if "chosen" in row and "rejected" in row:
        return "explicit" if "prompt" in row else "implicit"
    return None


def to_pair(
    row: Mapping[str, Any], fmt: str = "auto"
) -> tuple[list[Message], list[Message], list[Message]] | None:
    """``row`` as (prompt, chosen, rejected) messages, checked; None for a row that prefers
    nothing (an UltraFeedback row of ties). ValueError names the field that is wrong."""
    layout = layout_of(row, fmt, detect_format, LAYOUTS)
    if layout == "ultrafeedback":
        pair = _from_ultrafeedback(row)
        if pair is None:
            return None
    elif layout == "explicit":
        pair = _from_explicit(row)
    else:
        pair = _from_implicit(row)
    _check_pair(*pair)
    return pair


def is_text_pair(row: Mapping[str, Any], fmt: str = "auto") -> bool:
    """Whether ``row`` is TRL's standard pair: prompt, chosen and rejected all plain strings."""
    layout = detect_format(row) if fmt == "auto" else fmt
    return layout == "explicit" and all(
        isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")
    )


def _from_explicit(row: Mapping[str, Any]) -> tuple[list[Message], ...]:
    prompt = turns_of(row, "prompt", "user")
    chosen, rejected = (turns_of(row, key, "assistant") for key in ("chosen", "rejected"))
    return prompt, _after(prompt, chosen), _after(prompt, rejected)


def _after(prompt: list[Message], completion: list[Message]) -> list[Message]:
    """``completion`` without the prompt's messages, where it repeats them first."""
    if len(completion) > len(prompt) and completion[: len(prompt)] == prompt:
        return completion[len(prompt) :]
    return completion


def _from_implicit(row: Mapping[str, Any]) -> tuple[list[Message], ...]:
    chosen, rejected = (turns_of(row, key, None) for key in ("chosen", "rejected"))
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    # The completions start at the first differing assistant turn (a shared reply stays part
    # of the prompt, as TRL's extract_prompt keeps every shared message).
    if shared == 0:
        raise ValueError(
            "fields 'chosen' and 'rejected' share no prompt: give the prompt in a 'prompt' "
            "field, or both whole conversations"
        )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _from_ultrafeedback(row: Mapping[str, Any]) -> tuple[list[Message], ...] | None:
    instruction = row.get("instruction", row.get("prompt"))
    if not isinstance(instruction, str):
        raise ValueError(f"field 'instruction' is {kind_of(instruction)}, not a string")
    completions = row["completions"]
    if not isinstance(completions, list) or len(completions) < 2:
        raise ValueError("field 'completions' is not a list of at least two completions")
    scored = []
    for i, item in enumerate(completions):
        response = item.get("response") if isinstance(item, Mapping) else None
        score = item.get("overall_score") if isinstance(item, Mapping) else None
        if not isinstance(response, str) or not isinstance(score, (int, float)):
            raise ValueError(
                f"completions[{i}] is not a {{response: text, overall_score: number}} object"
            )
        scored.append((float(score), i, response))
    best = max(scored, key=lambda s: (s[0], -s[1]))  # ties: the earlier completion
    worst = min(scored, key=lambda s: (s[0], s[1]))
    if best[0] == worst[0]:
        return None
    prompt = [{"role": "user", "content": instruction}]
    return prompt, [_reply(best[2])], [_reply(worst[2])]


def _reply(text: str) -> Message:
    return {"role": "assistant", "content": text}


def _check_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message]) -> None:
    for key, turns in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        check_roles(turns, key)
    if prompt[-1]["role"] == "assistant":
        raise ValueError(
            "the prompt ends with an assistant turn; the completions must start with the reply "
            "they differ in"
        )
    for key, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[0]["role"] != "assistant" or not has_reply(turns[0]):
            raise ValueError(f"field {key!r} does not start with an assistant reply")


def margin_of(row: Mapping[str, Any]) -> float | None:
    """The row's ``margin`` (TRL's optional column: how much more the chosen side is preferred),
    a finite number, or None where the row has none."""
    value = row.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"field 'margin' is {value!r:.40}, not a finite number")
    return float(value)


def pair_dataset(rows: Iterator[tuple[str, Any]], fmt: str, source: str) -> Dataset:
    """The :data:`COLUMNS` of ``(place, row)`` pairs; every row that fits no layout is reported
    in one line, with its place and field."""

    ties, same = [], []
    normalised = fmt == "normalised"  # rows this module wrote: explicit, keeping their text flag
    fmt = "explicit" if normalised else fmt

    def convert(row: Mapping[str, Any]) -> tuple | None:
        pair = to_pair(row, fmt)
        tools = json_list(row.get("tools"), "field 'tools'", "JSON schemas")
        if pair is None:
            ties.append(row)
            return None
        text = bool(row.get("text")) if normalised else is_text_pair(row, fmt)
        if pair[1] == pair[2]:
            same.append(row)
        return (*pair, tools, text, margin_of(row))

    pairs = rows_dataset(
        rows,
        convert,
        COLUMNS,
        f"{source}: {{count}} row(s) are not preference pairs",
        f"name the layout with task.format={'|'.join(FORMATS[1:])}",
    )
    if ties:
        log.info("%s: %d row(s) left out, their completions all score the same", source, len(ties))
    if same:  # kept, as TRL keeps them: said once, as they only dilute the loss
        log.warning(
            "%s: %d pair(s) have the same chosen and rejected reply: they prefer nothing (both "
            "sides score alike, a pair loss without gradient) and only dilute the mean; leave "
            "them out of the data",
            source,
            len(same),
        )
    if len(pairs) == 0:
        raise DataError(f"{source}: no row holds a preference (every row's completions tie).")
    return pairs


def read_pairs(path: Path, fmt: str = "auto") -> Dataset | None:
    """A JSON lines or JSON file of pairs (None for other files, read by ``datasets``)."""
    return read_rows(path, lambda rows: pair_dataset(rows, fmt, str(path)))


def normalise(dataset: Dataset, fmt: str, source: str) -> Dataset:
    """Rows read by ``datasets`` (parquet, a saved folder) as pairs, checked by row; rows
    :func:`read_pairs` read already keep their place."""
    if tuple(dataset.column_names) == COLUMNS:
        return pair_dataset(((r["place"], r) for r in dataset), "normalised", source)
    return pair_dataset(((f"row {i}", r) for i, r in enumerate(dataset)), fmt, source)
