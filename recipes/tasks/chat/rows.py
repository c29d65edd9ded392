"""Conversations for supervised fine-tuning: reading the common layouts, rendering them with a
chat template, labelling the assistant's tokens, truncating and packing.

Pure functions (no model, no loop), so each is tested on its own. A conversation is a list of
messages in the chat format of transformers and OpenAI: ``{"role", "content"}`` with roles
``system``, ``user``, ``assistant`` and ``tool``; an assistant message may carry ``tool_calls``, a
tool message ``tool_call_id`` / ``name``, and a row may carry ``tools`` (JSON schemas the template
is given). Four layouts are read and normalised to it:

* ``messages``: ``{"messages": [{"role", "content"}, ...]}`` (and ``tools``);
* ``sharegpt``: ``{"conversations": [{"from", "value"}, ...]}``, ``from`` in human / gpt / system;
* ``alpaca``: ``{"instruction", "input", "output"}`` (``input`` may be empty or absent);
* ``dolly``: ``{"instruction", "context", "response"}`` (``context`` may be empty);
* ``prompt_completion``: TRL's ``{"prompt", "completion"}``, each a list of messages or text (the
  prompt as one user turn, the completion as one assistant reply); only the completion's
  assistant turns are labelled.

An assistant message may carry its reasoning in ``reasoning_content`` (Qwen3, vLLM, DeepSeek),
``reasoning`` or ``thinking``; it reaches the template as given.

Rows as users have them. TRL renders the whole row with the template and labels what
``return_assistant_tokens_mask`` marks; each kind is handled as that does, or refused by row:

* reply starting with whitespace: trained (the token joining the header's newline to the reply's
  is labelled: transformers labels every token that overlaps the reply);
* conversation opening with an assistant turn (after a system message or not): trained, the turn
  labelled, as TRL renders and labels it;
* tool calls: ``tool_calls`` and ``tools`` reach the template, tool-call turns are labelled, tool
  results are not; a template that never reads them is refused (TRL would train on tool-call
  turns without their calls);
* same role twice running, an empty user turn, a system message after the first turn, a final
  user turn after the last reply: rendered as given and unlabelled (as TRL); a template that
  raises on them ("roles must alternate") refuses the row with its own words;
* content as a list of OpenAI parts: the text parts joined by a newline (what vLLM gives a
  template that takes text); an image, audio or file part refuses the row (text-only task);
* a role in another case or padded ("Assistant"): read lower-cased, as ShareGPT's ``from`` is
  (TRL would render it verbatim, and its template would never label it);
* blank or empty reply: labelled like any reply (as TRL); a row with no reply holding text or
  tool calls is refused, as there is nothing to learn;
* null content: allowed on an assistant turn with tool calls (OpenAI's form), refused elsewhere
  (the template would fail on it); any other role (function, ipython, developer) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset

from recipes import data as data_lib
from recipes.data import DataError
from recipes.tasks.configs.sft import FORMATS, TEXT_ROWS, TRUNCATION  # noqa: F401  (re-exported)

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # an assistant's reasoning
# Kept on a message beside role, content and tool_calls.
MESSAGE_FIELDS = ("tool_call_id", "name", *REASONING_FIELDS)
MEDIA_PARTS = ("image", "image_url", "input_image", "audio", "input_audio", "video", "file")
# The conversations' dataset. prompt_turns: messages before the completion (prompt-completion
# rows; 0: every assistant turn is learnt); text: the row was plain strings (TRL's standard
# prompt-completion row); place: "line 3", "row 7".
COLUMNS = ("messages", "tools", "prompt_turns", "text", "place")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}
MAX_REPORTED_PROBLEMS = 3
Message = dict[str, Any]


class LayoutError(ValueError):
    """A row that fits none of the layouts the reader knows: the one problem ``task.format``
    can solve, so the only one whose refusal names it (:func:`rows_dataset`)."""


# --------------------------------------------------------------------------------- layouts


def layout_of(
    row: Mapping[str, Any],
    fmt: str,
    detect: Callable[[Mapping[str, Any]], str | None],
    expected: str,
) -> str:
    """``fmt``, or for ``auto`` the layout ``detect`` finds in ``row``; a row that fits none is
    refused (:class:`LayoutError`) naming its fields and the ``expected`` layouts."""
    layout = detect(row) if fmt == "auto" else fmt
    if layout is None:
        raise LayoutError(
            f"fits no layout (fields: {', '.join(sorted(row)) or 'none'}); expected {expected}"
        )
    return layout


def detect_format(row: Mapping[str, Any], prompt: bool = False) -> str | None:
    """The layout whose fields ``row`` has, or None. A prompt to answer (``prompt``) may lack
    the answer's field, and may be TRL's prompt-only row (``prompt``: text or messages)."""
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row and ("output" in row or (prompt and "context" not in row)):
        return "alpaca"
    if "instruction" in row and ("response" in row or prompt):
        return "dolly"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if prompt and "prompt" in row:
        return "prompt"
    return None


def to_messages(row: Mapping[str, Any], fmt: str = "auto", prompt: bool = False) -> list[Message]:
    """``row`` as a checked list of messages; ValueError names the field that is wrong.

    ``prompt``: a row to answer (mode=predict), not to learn from: it needs a user turn, not an
    assistant's, and a final assistant turn, if any, is the reference answer."""
    return to_conversation(row, fmt, prompt)[0]


def to_conversation(
    row: Mapping[str, Any], fmt: str = "auto", prompt: bool = False
) -> tuple[list[Message], int, bool]:
    """``row``'s checked messages (:func:`to_messages`), how many of them are the prompt of a
    prompt-completion row (0 for a conversation), and whether the row was plain text."""
    layout = layout_of(
        row,
        fmt,
        lambda r: detect_format(r, prompt),
        "messages, conversations (ShareGPT), instruction/input/output (Alpaca), "
        "instruction/context/response (Dolly) or prompt/completion"
        + (" or prompt" if prompt else ""),
    )
    if layout == "normalised":  # a row this module wrote: kept as it is
        messages = _from_messages(row)
        turns, text = int(row.get("prompt_turns") or 0), bool(row.get("text"))
    elif layout == "prompt_completion":
        asked = turns_of(row, "prompt", "user")
        messages = asked + turns_of(row, "completion", "assistant")
        turns = len(asked)
        text = all(isinstance(row.get(k), str) for k in ("prompt", "completion"))
    else:
        messages, turns, text = _NORMALISERS[layout](row, prompt), 0, False
    key = "conversations" if layout == "sharegpt" else "messages"
    if prompt:
        check_roles(messages, key)
        asked = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
        if not any(m["role"] == "user" for m in asked):
            raise ValueError(f"{key}: no user turn to answer (before a final assistant reply)")
    elif turns:
        check_roles(messages, "prompt")
        completion = messages[turns:]
        if completion[0]["role"] != "assistant" or not any(
            m["role"] == "assistant" and has_reply(m) for m in completion
        ):
            raise ValueError(
                "field 'completion' does not start with an assistant turn holding a reply "
                "(text or tool calls), so nothing to learn"
            )
    else:
        _check_messages(messages, key)
    return messages, turns, text


def turns_of(row: Mapping[str, Any], key: str, text_role: str | None) -> list[Message]:
    """Field ``key`` as messages: text as one ``text_role`` turn, or a list of messages."""
    value = row.get(key)
    if isinstance(value, str) and text_role is not None:
        return [{"role": text_role, "content": value}]
    if not isinstance(value, list) or not value:
        expected = "text or " if text_role else ""
        raise ValueError(f"field {key!r} is {kind_of(value)}, not {expected}a list of messages")
    return [parse_message(turn, f"{key}[{i}]") for i, turn in enumerate(value)]


def _field(row: Mapping[str, Any], name: str, optional: bool = False) -> str:
    value = row.get(name)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} is {kind_of(value)}, not a string")
    return value


def _from_messages(row: Mapping[str, Any], prompt: bool = False) -> list[Message]:
    turns = _turn_list(row, "messages")
    return [parse_message(turn, f"messages[{i}]") for i, turn in enumerate(turns)]


def parse_message(turn: Any, key: str) -> Message:
    """One turn as stored: role lower-cased, content as text, ``tool_calls`` as JSON text (a
    dataset holds one schema for all rows, and tool arguments differ from call to call)."""
    if not isinstance(turn, Mapping) or "role" not in turn:
        raise ValueError(f"{key} is not a {{role, content}} object")
    message = {
        "role": str(turn["role"]).strip().lower(),
        "content": _content(turn.get("content"), f"{key}.content"),
    }
    calls = json_list(turn.get("tool_calls"), f"{key}.tool_calls", "tool call objects")
    if calls is not None:
        message["tool_calls"] = calls
    elif message["content"] is None:
        raise ValueError(f"{key}.content is missing (only a turn with tool_calls may go without)")
    message.update({k: str(turn[k]) for k in MESSAGE_FIELDS if turn.get(k) is not None})
    return message


def _content(value: Any, key: str) -> str | None:
    """Text, or None; OpenAI's list of parts as its text parts joined by a newline (as vLLM
    hands such content to a template that takes text)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{key} is {kind_of(value)}, not a string or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type", "text") if isinstance(part, Mapping) else None
        if kind in MEDIA_PARTS:
            raise ValueError(
                f"{key}[{j}] is a part of type {kind}, and this task trains on text only: "
                "remove the part or the row"
            )
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{key}[{j}] is not a {{type: text, text}} part")
        texts.append(part["text"])
    return "\n".join(texts)


def json_list(value: Any, key: str, items: str) -> str | None:
    """A list of objects (or its JSON text) as JSON text; None when absent or empty."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as err:
            raise ValueError(f"{key} is text but not JSON ({err.msg})") from None
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ValueError(f"{key} is {kind_of(value)}, not a list of {items}")
    return json.dumps(value, ensure_ascii=False)


def _from_sharegpt(row: Mapping[str, Any], prompt: bool = False) -> list[Message]:
    turns = _turn_list(row, "conversations")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or "from" not in turn or "value" not in turn:
            raise ValueError(f"conversations[{i}] is not a {{from, value}} object")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ValueError(f"conversations[{i}].from={turn['from']!r}: use human, gpt or system")
        if not isinstance(turn["value"], str):
            raise ValueError(f"conversations[{i}].value is {kind_of(turn['value'])}, not a string")
        out.append({"role": role, "content": turn["value"]})
    return out


def _from_alpaca(row: Mapping[str, Any], prompt: bool = False) -> list[Message]:
    asked = _join(_field(row, "instruction"), _field(row, "input", optional=True))
    return _single_turn(row, asked, _field(row, "output", optional=prompt))


def _from_dolly(row: Mapping[str, Any], prompt: bool = False) -> list[Message]:
    asked = _join(_field(row, "instruction"), _field(row, "context", optional=True))
    return _single_turn(row, asked, _field(row, "response", optional=prompt))


def _from_prompt(row: Mapping[str, Any], prompt: bool = True) -> list[Message]:
    """TRL's prompt-only row: ``prompt`` as text (one user turn) or as messages."""
    if isinstance(row["prompt"], str):
        return [{"role": "user", "content": row["prompt"]}]
    turns = _turn_list(row, "prompt")
    return [parse_message(turn, f"prompt[{i}]") for i, turn in enumerate(turns)]


def _single_turn(row: Mapping[str, Any], prompt: str, answer: str) -> list[Message]:
    """A system turn (if any), the user's and the answer (left out when empty: a prompt)."""
    system = _field(row, "system", optional=True)
    head = [{"role": "system", "content": system}] if system else []
    tail = [{"role": "assistant", "content": answer}] if answer else []
    return [*head, {"role": "user", "content": prompt}, *tail]


def _join(instruction: str, extra: str) -> str:
    return f"{instruction}\n\n{extra}" if extra.strip() else instruction


def _turn_list(row: Mapping[str, Any], key: str) -> list:
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"field {key!r} is {kind_of(turns)}, not a non-empty list of turns")
    return turns


def _check_messages(messages: list[Message], key: str) -> None:
    check_roles(messages, key)
    if not any(m["role"] == "assistant" and has_reply(m) for m in messages):
        raise ValueError(
            f"{key}: no non-empty assistant turn (text or tool calls), so nothing to learn"
        )


def check_roles(messages: list[Message], key: str) -> None:
    """Refuse a role the task does not know, and tool calls outside an assistant turn."""
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise ValueError(
                f"{key}[{i}].role={message['role']!r}: use system, user, assistant or tool"
            )
        if "tool_calls" in message and message["role"] != "assistant":
            raise ValueError(f"{key}[{i}].tool_calls: only an assistant turn calls tools")


def has_reply(message: Message) -> bool:
    return bool((message["content"] or "").strip() or message.get("tool_calls"))


def kind_of(value: Any) -> str:
    return "missing" if value is None else type(value).__name__


_NORMALISERS = {
    "messages": _from_messages,
    "sharegpt": _from_sharegpt,
    "alpaca": _from_alpaca,
    "dolly": _from_dolly,
    "prompt": _from_prompt,  # rows to answer only (detect_format's prompt)
}


def conversation_dataset(
    rows: Iterator[tuple[str, Any]], fmt: str, source: str, prompt: bool = False
) -> Dataset:
    """The :data:`COLUMNS` of ``(place, row)`` pairs (``tools`` as JSON text or None; ``place``
    names the row in later refusals); every row that fits no layout is reported in one line
    (the first few, with their place and field, and how many in all). ``prompt``: rows to answer
    (:func:`to_messages`)."""

    def convert(row: Mapping[str, Any]) -> tuple:
        tools = json_list(row.get("tools"), "field 'tools'", "JSON schemas")
        messages, turns, text = to_conversation(row, fmt, prompt)
        return messages, tools, turns, text

    return rows_dataset(
        rows,
        convert,
        COLUMNS,
        f"{source}: {{count}} row(s) are not {'prompts' if prompt else 'conversations'}",
        f"name the layout with task.format={'|'.join(FORMATS[1:])}",
    )


def rows_dataset(
    rows: Iterator[tuple[str, Any]],
    convert: Callable[[Mapping[str, Any]], tuple | None],
    columns: Sequence[str],
    problem: str,
    fix: str,
) -> Dataset:
    """``columns`` (the last one ``place``) of the rows ``convert`` turns into the other
    columns' values (None: a row left out); the rows it refuses (ValueError naming the field)
    are reported together in one DataError, ``problem`` (with ``{count}``) then the first few,
    then ``fix`` where a row fit no layout (:class:`LayoutError`): a bad label or an empty
    reply is not solved by naming the layout. When every row is refused for the same reason (a
    field no row has), that reason is said once, with the fields the rows do have."""
    out: dict[str, list] = {name: [] for name in columns}
    problems = []
    reasons: set[str] = set()
    fields: set[str] = set()  # of the refused rows
    layout_problem = False
    read = 0
    for place, row in data_lib.progress(rows, desc="read rows", unit=" rows"):
        read += 1
        try:
            if not isinstance(row, Mapping):
                raise ValueError(f"is {kind_of(row)}, not an object")
            values = convert(row)
        except ValueError as err:
            problems.append(f"{place}: {err}")
            reasons.add(str(err))
            if isinstance(row, Mapping):
                fields.update(str(k) for k in row)
            layout_problem = layout_problem or isinstance(err, LayoutError)
            continue
        if values is None:
            continue
        for name, value in zip(columns, (*values, place), strict=True):
            out[name].append(value)
    if read > 1 and len(problems) == read and len(reasons) == 1:
        listed = fields and not layout_problem  # a layout refusal lists the fields itself
        have = f"; the rows' fields: {', '.join(sorted(fields))}" if listed else ""
        hint = f", or {fix}" if layout_problem else ""
        raise DataError(
            f"{problem.format(count=read)}: every row: {reasons.pop()} ({read} rows{have}). "
            f"Fix them{hint}."
        )
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED_PROBLEMS])
        more = f" (and {len(problems) - MAX_REPORTED_PROBLEMS} more)" if len(problems) > 3 else ""
        hint = f", or {fix}" if layout_problem else ""
        raise DataError(
            f"{problem.format(count=len(problems))}: {shown}{more}. Fix or remove them{hint}."
        )
    return Dataset.from_dict(out)


def read_conversations(path: Path, fmt: str = "auto", prompt: bool = False) -> Dataset | None:
    """JSON lines or JSON (a list of rows, or ``{"data": [...]}``) as conversations (or, with
    ``prompt``, prompts to answer), read here so that a bad row is named by its line; None for
    other files (parquet), which ``datasets`` reads before :func:`normalise` checks them by row."""
    return read_rows(path, lambda rows: conversation_dataset(rows, fmt, str(path), prompt))


def read_rows(path: Path, build: Callable[[Iterator[tuple[str, Any]]], Dataset]) -> Dataset | None:
    """The rows of a JSON lines or JSON file (a list of rows, or ``{"data": [...]}``), each with
    its place ("line 3", "row 7"), as ``build`` makes them a dataset; None for other files."""
    if path.suffix not in (".json", ".jsonl"):
        return None
    text = data_lib.read_text(path)
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or not stripped.startswith("["):
        try:
            return build(_json_lines(path, text))
        except _NotJsonLines:
            pass
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not JSON ({err.msg} at line {err.lineno}).") from None
    rows = raw.get("data") if isinstance(raw, dict) else raw
    if not isinstance(rows, list):
        raise DataError(f"{path}: a JSON file of rows is a list of rows (or 'data': [...]).")
    return build((f"row {i}", r) for i, r in enumerate(rows))


class _NotJsonLines(Exception):
    """A .json file holding one JSON document over several lines."""


def _json_lines(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if path.suffix == ".json":
                raise _NotJsonLines from None
            raise DataError(f"{path}: line {number} is not JSON ({err.msg}).") from None
        yield f"line {number}", row


def normalise(dataset: Dataset, fmt: str, source: str, prompt: bool = False) -> Dataset:
    """Rows read by ``datasets`` (parquet, a saved folder) as conversations, checked by row;
    rows :func:`read_conversations` has normalised already keep their layout and place."""
    if tuple(dataset.column_names) == COLUMNS:
        rows = ((r["place"], r) for r in dataset)
        return conversation_dataset(rows, "normalised", source, prompt)
    rows = ((f"row {i}", r) for i, r in enumerate(dataset))
    return conversation_dataset(rows, fmt, source, prompt)
