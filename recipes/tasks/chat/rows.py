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

Which tokens get loss (docs/configuration.md, "Which tokens get loss"):

* a template with ``{% generation %}`` markers: exactly the tokens transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks, which is what TRL's
  ``assistant_only_loss`` trains on (every token overlapping a marked span, the template's
  whitespace inside the markers included);
* a template without markers: each assistant turn from the end of its generation prompt to its
  end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, EOS) included, so the model learns to stop;
  the template's whitespace after that token is not labelled, nor an empty reasoning block the
  template writes before a reply that has none (Qwen3's ``<think>\n\n</think>\n\n``). The
  conversation is rendered once, as at inference; a turn the template renders differently once
  later turns follow (Qwen3 drops a past turn's reasoning) is context, not labelled: the model
  never writes it that way. Turn boundaries come from rendering the conversation prefix by
  prefix: where a prefix's tokens are a token prefix of the whole, its length is the boundary;
  where the tokenizer merges text across a boundary (a reply that starts with a newline), the
  boundary is placed by characters and mapped to tokens by their offsets, as transformers maps a
  ``{% generation %}`` span. A template whose generation prompt is not a *text* prefix of the
  whole is refused rather than mislabelled.

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
import re
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from jinja2 import TemplateError, TemplateSyntaxError
from transformers import PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import ASSETS, ConfigError, first_line
from recipes.data import DataError
from recipes.tasks.configs.sft import FORMATS, TEXT_ROWS, TRUNCATION  # noqa: F401  (re-exported)

IGNORE_INDEX = -100  # label of positions that carry no loss (transformers' convention)
ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # an assistant's reasoning
# The row fields a template may read, as whole names (``enable_thinking`` is not ``thinking``).
_FIELD_NAMES = re.compile(r"(?<!\w)(tool_calls|tools|reasoning_content|reasoning|thinking)(?!\w)")
# Kept on a message beside role, content and tool_calls.
MESSAGE_FIELDS = ("tool_call_id", "name", *REASONING_FIELDS)
MEDIA_PARTS = ("image", "image_url", "input_image", "audio", "input_audio", "video", "file")
# The conversations' dataset. prompt_turns: messages before the completion (prompt-completion
# rows; 0: every assistant turn is learnt); text: the row was plain strings (TRL's standard
# prompt-completion row); place: "line 3", "row 7".
COLUMNS = ("messages", "tools", "prompt_turns", "text", "place")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as TRL's has_generation_markers
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

# Named templates for models whose tokenizer has none (task.chat_template=<name>). Each is the
# published template of its family, without tool calls.
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content']"
        " + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"
    ),
    # Zephyr's template ends each turn with the tokenizer's own EOS: it needs no new tokens,
    # which is why the bundled tiny Llama (no chat tokens in its vocabulary) uses it.
    "zephyr": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}
# Qwen 2.5's template, which shows tools and writes Hermes-style <tool_call>{json}</tool_call>
# calls (task.tools; TRL's trl/chat_templates/qwen2_5.jinja, byte for byte, so TRL's parser
# recognises it). SmolLM2-Instruct has the same <|im_start|> / <|im_end|> tokens.
CHAT_TEMPLATES["qwen2_5"] = (ASSETS / "chat_templates" / "qwen2_5.jinja").read_text(
    encoding="utf-8"
)


# --------------------------------------------------------------------------------- layouts


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
    layout = detect_format(row, prompt) if fmt == "auto" else fmt
    if layout is None:
        raise LayoutError(
            f"fits no layout (fields: {', '.join(sorted(row)) or 'none'}); expected messages, "
            "conversations (ShareGPT), instruction/input/output (Alpaca), "
            "instruction/context/response (Dolly) or prompt/completion"
            + (" or prompt" if prompt else "")
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


# ------------------------------------------------------------------------------ templates


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, choice: str | None) -> str:
    """The template to render with: ``task.chat_template`` (a name or a Jinja file) when set,
    else the tokenizer's own; never a guess."""
    if choice:
        if choice in CHAT_TEMPLATES:
            return CHAT_TEMPLATES[choice]
        path = Path(choice).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        raise ConfigError(
            f"task.chat_template={choice}: neither a known template "
            f"({', '.join(CHAT_TEMPLATES)}) nor a Jinja file."
        )
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise ConfigError(
        f"the tokenizer of {tokenizer.name_or_path} has no chat template (a base model); name "
        f"one with task.chat_template={'|'.join(CHAT_TEMPLATES)} or a path to a Jinja file."
    )


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    generation_prompt: bool = False,
    tools: str | list | None = None,
) -> str:
    """``messages`` (as stored, or plain) rendered by ``template`` with the row's ``tools``."""
    return _apply(tokenizer, template, messages, tools, add_generation_prompt=generation_prompt)


def _apply(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    tools: str | list | None,
    tokenize: bool = False,
    **kwargs: Any,
) -> Any:
    """transformers' ``apply_chat_template``, its template errors turned into our refusals."""
    try:
        return tokenizer.apply_chat_template(
            _for_template(messages),
            chat_template=template,
            tools=json.loads(tools) if isinstance(tools, str) else tools,
            tokenize=tokenize,
            **kwargs,
        )
    except TemplateSyntaxError as err:
        raise TemplateMismatch(
            f"the chat template is not valid Jinja ({first_line(err)}, line {err.lineno}); "
            "fix the template"
        ) from None
    except (TemplateError, TypeError) as err:
        # The template's raise_exception ("roles must alternate"), or a value it cannot take.
        raise RowError(
            f"the chat template cannot render this conversation ({first_line(err)}); fix or "
            "remove the row"
        ) from None


def _for_template(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as a template reads them: ``tool_calls`` parsed, and the fields that are None
    (absent from this row, present in others) left out, as transformers leaves out None."""
    out = []
    for message in messages:
        plain = {k: v for k, v in message.items() if v is not None}
        if isinstance(plain.get("tool_calls"), str):
            plain["tool_calls"] = json.loads(plain["tool_calls"])
        # Reasoning under every name templates read (transformers 5 aliases them; 4.x does not).
        reasoning = next((plain[f] for f in REASONING_FIELDS if plain.get(f)), None)
        if reasoning is not None:
            plain |= dict.fromkeys(REASONING_FIELDS, reasoning)
        out.append(plain)
    return out


def render(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    generation_prompt: bool = False,
    tools: str | list | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by ``template`` (which supplies any BOS itself)."""
    return _encode(tokenizer, render_text(tokenizer, template, messages, generation_prompt, tools))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # verbose=False: a conversation longer than the model is the length policy's to handle.
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] if text else []


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` marks the assistant's tokens with ``{% generation %}``."""
    return GENERATION_TAG.search(template) is not None


class LayoutError(ValueError):
    """A row that fits none of the layouts the reader knows: the one problem ``task.format``
    can solve, so the only one whose refusal names it (:func:`rows_dataset`)."""


class TemplateMismatch(ValueError):
    """The chat template cannot be used for this data (a prefix rendered differently inside the
    whole conversation, tool calls it never renders); the message ends with the fix."""


class RowError(ValueError):
    """One conversation cannot be trained on as given; the message ends with the fix."""


def refusal(err: TemplateMismatch | RowError, place: str) -> ConfigError | DataError:
    """The one-line error to stop the run with, naming the file and row in ``place``."""
    if isinstance(err, TemplateMismatch):
        return ConfigError(f"task.chat_template: {err} ({place}).")
    return DataError(f"{place}: {err}.")


# Put in place of an assistant turn's content to find where that content starts: transformers
# renders no empty conversation, so an opening assistant turn has no prefix to render; and what
# a template writes before a plain reply (Qwen3's empty think block) comes before it.
CONTENT_MARKER = "<<sft-content-starts-here>>"


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    train_on_prompt: bool = False,
    tools: str | list | None = None,
    label_from: int = 0,
) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` of one conversation: the assistant's tokens labelled (by the
    template's ``{% generation %}`` markers where it has them, else each assistant turn with its
    end-of-turn token), the rest -100 unless ``train_on_prompt``; with ``label_from``, only
    from the turn of that index on (a completion, not its prompt's replies). The first token
    never carries a label (nothing predicts it), so packed and unpacked sequences score the
    same tokens."""
    _check_template_reads(template, messages, tools)
    if has_generation_markers(template):
        ids, labels = _marked_labels(tokenizer, template, messages, tools, label_from)
    else:
        ids, labels = _turn_labels(tokenizer, template, messages, tools, label_from)
    if train_on_prompt:
        labels = list(ids)
    if labels:
        labels[0] = IGNORE_INDEX
    if not train_on_prompt and all(label == IGNORE_INDEX for label in labels):
        raise RowError(
            "no assistant turn is labelled: "
            + (
                "the chat template's {% generation %} markers wrap none of its tokens; mark the "
                "assistant's turns in the template"
                if has_generation_markers(template)
                else "the chat template renders every reply differently once later turns follow "
                "(as Qwen3 drops a past turn's reasoning), so none is what the model writes; end "
                "the conversation with the reply to learn, or use a template with {% generation "
                "%} markers (TRL's training templates) to train on every turn"
            )
        )
    return {"input_ids": ids, "labels": labels}


def _marked_labels(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    tools: Any,
    label_from: int,
) -> tuple[list[int], list[int]]:
    """Ids and labels from transformers' assistant mask; with ``label_from``, from where the
    prompt's tokens (with the generation prompt) stop being a prefix, as TRL starts a completion."""
    if not tokenizer.is_fast:
        raise TemplateMismatch(
            "the chat template marks the assistant's tokens with {% generation %}, which "
            "transformers maps to tokens by character offsets, and this slow tokenizer has none; "
            "use the model's fast tokenizer (tokenizer.json)"
        )
    out = _apply(
        tokenizer,
        template,
        messages,
        tools,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    start = 0
    if label_from:
        prompt = render(tokenizer, template, messages[:label_from], True, tools)
        start = common_prefix_length(prompt, ids)
    pairs = enumerate(zip(ids, mask, strict=True))
    labels = [t if m and k >= start else IGNORE_INDEX for k, (t, m) in pairs]
    return ids, labels


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _turn_labels(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    tools: Any,
    label_from: int,
) -> tuple[list[int], list[int]]:
    """Ids and labels of a template without markers: each assistant turn (from ``label_from``)
    rendered as the model writes it, with its end-of-turn token (see the module's docstring)."""
    text = render_text(tokenizer, template, messages, tools=tools)
    ids = _encode(tokenizer, text)
    labels = [IGNORE_INDEX] * len(ids)
    offsets: list[tuple[int, int]] = []
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= label_from]
    for i in replies:
        span = _reply_span(tokenizer, template, messages, i, tools, text, i == replies[-1])
        if span is None:
            continue  # rewritten once later turns follow: context, as the model sees it
        head, end = span
        start, stop = (
            _token_prefix(tokenizer, ids, text[:head]),
            _token_prefix(tokenizer, ids, text[:end]),
        )
        if start is None or stop is None:  # the tokenizer merged text across a boundary
            offsets = offsets or _offsets(tokenizer, text, i)
            start, stop = _token_span(offsets, head, end)
        labels[start:stop] = ids[start:stop]
    return ids, labels


def _reply_span(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    turn: int,
    tools: Any,
    text: str,
    last: bool,
) -> tuple[int, int] | None:
    """Characters of ``text`` (the whole conversation) to label for assistant turn ``turn``: from
    the end of its generation prompt to its end-of-turn token, as the template renders the turn
    when it is the last one (how the model writes it); None where ``text`` renders it otherwise
    (a past turn: Qwen3.5's generation prompt opens a think block its past turns drop). The
    ``last`` reply must follow its generation prompt: the template is refused otherwise."""
    head = _turn_head(tokenizer, template, messages, turn, tools)
    if not last and not text.startswith(head):
        return None
    _check_prefix(text, head, turn, "the prompt of")
    alone = render_text(tokenizer, template, messages[: turn + 1], tools=tools)
    _check_prefix(alone, head, turn, "the prompt of")
    written = alone[len(head) :].rstrip()  # without the template's whitespace after the turn
    inserted = _inserted_before_reply(tokenizer, template, messages, turn, tools, head, written)
    rest = text[len(head) :]
    if rest.startswith(written):
        return len(head) + inserted, len(head) + len(written)
    if inserted and rest.startswith(written[inserted:]):  # a past turn without that block
        return len(head), len(head) + len(written) - inserted
    message = messages[turn]
    if any(message.get(f) for f in REASONING_FIELDS) or "<think>" in (message["content"] or ""):
        return None  # its reasoning dropped once later turns follow: context
    # Rewritten for another reason (Phi-3 ends the conversation with EOS, a Mistral template
    # moves the system turn): the reply's tokens cannot be found; refused, not left unlabelled.
    _check_prefix(rest, written, turn, "assistant")
    return None


def _inserted_before_reply(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    turn: int,
    tools: Any,
    head: str,
    written: str,
) -> int:
    """Characters the template writes between the generation prompt and a reply that has no
    reasoning, when it writes any but whitespace (Qwen3's empty think block): the template's,
    not the reply's, so not labelled."""
    message = messages[turn]
    content = message["content"] or ""
    if turn == 0 or any(message.get(f) for f in REASONING_FIELDS):
        return 0
    if content and written.startswith(content):  # the reply comes first: nothing inserted
        return 0
    plain = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
    marked = render_text(
        tokenizer, template, [*messages[:turn], {**plain, "content": CONTENT_MARKER}], tools=tools
    )
    if not marked.startswith(head) or CONTENT_MARKER not in marked:
        return 0
    before = marked[len(head) : marked.index(CONTENT_MARKER)]
    return len(before) if before.strip() and written.startswith(before) else 0


def _check_template_reads(template: str, messages: Sequence[Message], tools: Any) -> None:
    """Refuse a template that never reads the row's tool calls, tools or reasoning: the model
    would learn those turns without them (TRL trains on that silently)."""
    used = {
        "tool_calls": any(m.get("tool_calls") for m in messages),
        "tools": bool(tools),
        **{f: any(m.get(f) for m in messages) for f in REASONING_FIELDS},
    }
    named = set(_FIELD_NAMES.findall(template))
    if named & set(REASONING_FIELDS):  # any of them: the row's reasoning goes by every name
        named |= set(REASONING_FIELDS)
    missing = [name for name, present in used.items() if present and name not in named]
    reasoning_missing = [f for f in REASONING_FIELDS if f in missing]
    if reasoning_missing:  # one name for the row's reasoning in the message
        missing = [f for f in missing if f not in REASONING_FIELDS] + [reasoning_missing[0]]
    if missing:
        raise TemplateMismatch(
            f"the chat template never renders {' or '.join(missing)}, which this row has, so "
            "those turns would be learnt without it; use a template that takes it (the model's "
            "own, if it has one, or a Jinja file)"
        )


def _turn_head(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    turn: int,
    tools: Any,
) -> str:
    """The text before assistant turn ``turn``'s content: the earlier turns and the generation
    prompt; for an opening turn, its own rendering up to :data:`CONTENT_MARKER`."""
    if turn:
        return render_text(tokenizer, template, messages[:turn], True, tools)
    marked = render_text(
        tokenizer, template, [{**messages[0], "content": CONTENT_MARKER}], False, tools
    )
    if CONTENT_MARKER not in marked:
        raise TemplateMismatch(
            "the chat template does not render the content of an opening assistant turn (turn "
            "0); use a template that renders every turn's content"
        )
    return marked[: marked.index(CONTENT_MARKER)]


def _check_prefix(text: str, part: str, turn: int, where: str) -> None:
    if not text.startswith(part):
        raise TemplateMismatch(
            f"the chat template renders {where} turn {turn} differently inside the whole "
            "conversation, so turn boundaries cannot be found from prefixes; use a template that "
            "renders earlier turns the same whatever follows (e.g. task.chat_template=chatml), "
            "or one with {% generation %} markers"
        )


def _token_prefix(tokenizer: PreTrainedTokenizerBase, ids: list[int], part: str) -> int | None:
    """The number of tokens of ``part``, where they are the first tokens of ``ids``."""
    tokens = _encode(tokenizer, part)
    return len(tokens) if ids[: len(tokens)] == tokens else None


def _offsets(tokenizer: PreTrainedTokenizerBase, text: str, turn: int) -> list[tuple[int, int]]:
    if not tokenizer.is_fast:
        raise RowError(
            f"assistant turn {turn} begins or ends inside a token (its first characters merge "
            "with the template's, as a reply starting with a newline does), and this slow "
            "tokenizer gives no character offsets to split it; strip the whitespace the reply "
            "starts with, or use a fast tokenizer"
        )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return encoded["offset_mapping"]


def _token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The tokens that overlap characters ``[start, end)``: transformers' rule for a
    ``{% generation %}`` span, so a token straddling the start (the header's newline merged with
    a reply's first newline) is labelled, as ``return_assistant_tokens_mask`` labels it."""
    first = next((k for k, (_, stop) in enumerate(offsets) if stop > start), len(offsets))
    last = first
    while last < len(offsets) and offsets[last][0] < end:
        last += 1
    return first, last


def tokenize_text(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    completions: Sequence[str],
    train_on_prompt: bool = False,
) -> list[dict[str, list[int]]]:
    """Plain-text rows as TRL tokenizes them without a chat template (``task.text_rows=raw``):
    per completion, the prompt and the completion (EOS appended where it lacks one) tokenized
    as one text with the tokenizer's own special tokens (a BOS); labels from where the prompt's
    tokens stop being a prefix of every side's, as TRL starts the completion."""
    eos = tokenizer.eos_token or ""
    prompt_ids = tokenizer(prompt, verbose=False)["input_ids"]
    sides = [
        tokenizer(prompt + c + ("" if c.endswith(eos) else eos), verbose=False)["input_ids"]
        for c in completions
    ]
    start = min(common_prefix_length(prompt_ids, ids) for ids in sides)
    out = []
    for ids in sides:
        labels = list(ids) if train_on_prompt else [IGNORE_INDEX] * start + list(ids[start:])
        if labels:
            labels[0] = IGNORE_INDEX
        out.append({"input_ids": list(ids), "labels": labels})
    return out


def check_template(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: Sequence[Message],
    place: str,
    tools: str | list | None = None,
) -> None:
    """Refuse, in one line naming ``place``, a template that cannot label this conversation
    (see :func:`tokenize_conversation`), or the conversation itself."""
    try:
        tokenize_conversation(tokenizer, template, messages, tools=tools)
    except (TemplateMismatch, RowError) as err:
        raise refusal(err, place) from None


# ------------------------------------------------------------------------- length policy


def fit_length(
    features: dict[str, list[int]], max_length: int, policy: str
) -> dict[str, list[int]] | None:
    """``features`` within ``max_length`` tokens: cut at the end (``truncate``) or None
    (``drop``). A cut conversation left without a labelled token is None as well."""
    if len(features["input_ids"]) <= max_length:
        return features
    if policy == "drop":
        return None
    cut = {k: v[:max_length] for k, v in features.items()}
    return cut if any(label != IGNORE_INDEX for label in cut["labels"]) else None


# ------------------------------------------------------------------------------- packing


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into rows of at most ``capacity`` tokens, best-fit decreasing (longest
    first, each into the fullest row it still fits); deterministic, ties in index order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row), sorted
    for i in order:
        at = bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            left, row = capacity - lengths[i], len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= lengths[i]
        if left > 0:
            insort(free, (left, row))
    return [sorted(row) for row in rows]


def packed_rows(features: Dataset, capacity: int) -> dict[str, list[list[int]]]:
    """Conversations concatenated into rows; ``position_ids`` restart at 0 at each one, which
    is how the attention mask finds where a conversation begins."""
    ids, labels = features["input_ids"], features["labels"]
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in pack([len(x) for x in ids], capacity):
        out["input_ids"].append([t for i in row for t in ids[i]])
        out["labels"].append([t for i in row for t in labels[i]])
        out["position_ids"].append([p for i in row for p in range(len(ids[i]))])
    return out


class ChatCollator:
    """Pads a batch: ``input_ids`` with the pad token, ``labels`` with -100, ``position_ids``
    with 0 (packed rows) or an ``attention_mask`` of ones (unpacked)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of  # the loop sets trainer.pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = padded_length(rows, self.pad_to_multiple_of)
        batch = {
            "input_ids": pad_rows(rows, "input_ids", self.pad_token_id, longest),
            "labels": pad_rows(rows, "labels", IGNORE_INDEX, longest),
        }
        if "position_ids" in rows[0]:
            batch["position_ids"] = pad_rows(rows, "position_ids", 0, longest)
        else:
            batch["attention_mask"] = attention_mask(rows, longest)
        return batch


def padded_length(rows: Sequence[Mapping[str, Any]], multiple: int | None) -> int:
    """The longest row's ``input_ids``, rounded up to a multiple of ``multiple`` (if set)."""
    longest = max(len(r["input_ids"]) for r in rows)
    return -(-longest // multiple) * multiple if multiple else longest


def pad_rows(rows: Sequence[Mapping[str, Any]], key: str, value: int, length: int) -> torch.Tensor:
    """Column ``key`` of ``rows`` padded with ``value`` to ``length``, as one tensor."""
    return torch.tensor([list(r[key]) + [value] * (length - len(r[key])) for r in rows])


def attention_mask(rows: Sequence[Mapping[str, Any]], length: int) -> torch.Tensor:
    """Ones over each row's ``input_ids``, zeros over the padding to ``length``."""
    return torch.tensor(
        [[1] * len(r["input_ids"]) + [0] * (length - len(r["input_ids"])) for r in rows]
    )


def flat_rows(
    sequences: Sequence[Mapping[str, Sequence[int]]],
    labels: Sequence[str],
    pad_token_id: int,
    multiple: int | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Sequences as one row without padding between them: the padding-free layout of TRL's
    ``padding_free`` and transformers' ``DataCollatorWithFlattening``, which a variable-length
    kernel reads as separate sequences from ``position_ids`` restarting at 0 (see
    :data:`POSITION_ID_ATTENTION`).

    Each of ``sequences`` holds ``input_ids``, its ``labels`` columns and its ``group`` (the
    term it belongs to: a pair, a row); the row is ``input_ids``, ``position_ids``, each label
    column and ``sequence`` (each token's group), all (1, tokens), keys ``prefix``-ed. A
    sequence's first token carries no label: the padded layout never scores a row's first token,
    and here the logits before it are the previous sequence's. With ``multiple`` the row ends
    in one padding sequence up to a multiple of it (fewer distinct shapes), unlabelled."""
    ids, positions, groups = [], [], []
    columns: dict[str, list[int]] = {key: [] for key in labels}
    for seq in sequences:
        length = len(seq["input_ids"])
        ids += seq["input_ids"]
        positions += range(length)
        groups += [seq["group"]] * length
        for key in labels:
            columns[key] += [IGNORE_INDEX, *seq[key][1:]][:length]
    total = len(ids)
    padding = (-(-total // multiple) * multiple - total) if multiple else 0
    ids += [pad_token_id] * padding
    positions += range(padding)
    groups += [0] * padding
    row = {"input_ids": ids, "position_ids": positions, "sequence": groups}
    row |= {key: column + [IGNORE_INDEX] * padding for key, column in columns.items()}
    return {f"{prefix}{key}": torch.tensor([values]) for key, values in row.items()}


# ------------------------------------------------------------------- block-diagonal masks

# Attention implementations that take the 4D mask built here (eager adds it to the scores, SDPA
# takes a boolean one), and those that find sequence starts in position_ids themselves
# (flash-attention's variable-length kernels).
MASKED_ATTENTION = ("eager", "sdpa")
POSITION_ID_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


# Attention functions registered with transformers' AttentionInterface that find sequence starts
# in position_ids as flash's do (a device's own variable-length kernel): add the name here.
VARLEN_ATTENTION: set[str] = set()


def reads_packed_positions(attn_implementation: str) -> bool:
    """Whether ``attn_implementation`` runs a row of sequences (``position_ids`` restarting at
    0, no mask) through a variable-length kernel: transformers' flash implementations, and the
    hub's flash kernels (``kernels-community/flash-attn2`` and the like), whose mask
    transformers also leaves to ``position_ids``, and those named in :data:`VARLEN_ATTENTION`.
    Exact and without padding there; anywhere else a row of sequences needs the dense
    block-diagonal mask (:func:`block_causal_mask`)."""
    name = attn_implementation or ""
    if name in POSITION_ID_ATTENTION or name in VARLEN_ATTENTION:
        return True
    return "/" in name and "flash" in name


def packing_unsupported_reason(attn_implementation: str) -> str | None:
    if attn_implementation in MASKED_ATTENTION or reads_packed_positions(attn_implementation):
        return None
    return (
        f"attention implementation {attn_implementation!r} takes neither a custom 4D mask nor "
        "sequence starts from position_ids"
    )


def block_causal_mask(
    position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """The (batch, 1, L, L) mask of packed rows: a token sees earlier tokens of its own
    conversation only. Boolean (True: attend) for SDPA, additive (0 / dtype min) for eager;
    None where the kernel reads position_ids itself. A padding position (position 0, alone in
    its "conversation") sees itself, so no row of the mask is empty."""
    if reads_packed_positions(attn_implementation):
        return None
    segment = (position_ids == 0).cumsum(dim=-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return blocked.masked_fill(~allowed, torch.finfo(dtype).min)
