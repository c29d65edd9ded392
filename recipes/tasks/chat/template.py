"""Which tokens get loss (docs/configuration.md, "Which tokens get loss"):

* a template with ``{% generation %}`` markers: exactly the tokens transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks, which is what TRL's
  ``assistant_only_loss`` trains on (every token overlapping a marked span, the template's
  whitespace inside the markers included);
* a template without markers: each assistant turn from the end of its generation prompt to its
  end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, EOS) included, so the model learns to stop;
  a template that ends a turn with no token of its own, the next turn's opening special token
  being what stops the model (GLM-4: ``<|user|>``, which its generation config lists as an end
  of generation), gets that token labelled after each reply, and written after the last one,
  as ms-swift's GLM-4 template labels its ``<|user|>`` suffix;
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
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from transformers import PreTrainedTokenizerBase

from recipes.config import ASSETS, ConfigError, first_line
from recipes.data import DataError
from recipes.log import get_logger
from recipes.tasks.base import IGNORE_INDEX
from recipes.tasks.chat.rows import REASONING_FIELDS, Message

log = get_logger(__name__)

# The row fields a template may read, as whole names (``enable_thinking`` is not ``thinking``).
_FIELD_NAMES = re.compile(r"(?<!\w)(tool_calls|tools|reasoning_content|reasoning|thinking)(?!\w)")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as TRL's has_generation_markers

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
    ender = turn_ender(tokenizer, template)
    special = _special_ids(tokenizer) if ender is not None else set()
    if ender is not None and messages and messages[-1]["role"] == "assistant":
        ids.append(ender)  # what the model writes after its last reply, as after the others
        labels.append(IGNORE_INDEX)
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
        if stop < len(ids) and ids[stop] in special:
            stop += 1  # the special token that opens the next turn ends this one
        labels[start:stop] = ids[start:stop]
    return ids, labels


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def turn_ender(tokenizer: PreTrainedTokenizerBase, template: str) -> int | None:
    """For a template that writes nothing of its own after a reply (GLM-4's), the special token
    that opens the next user turn right after it: what the model writes to stop. None where a
    turn has an end-of-turn token (ChatML's ``<|im_end|>``...) or what follows is not a special
    token written at once (a plain-text template): nothing is added then."""
    user = {"role": "user", "content": "Hi"}
    reply = {"role": "assistant", "content": "Hello"}
    try:
        alone = render_text(tokenizer, template, [user, reply])
        followed = render_text(tokenizer, template, [user, reply, {**user, "content": "Again"}])
    except (TemplateMismatch, RowError):
        return None
    if not alone.endswith("Hello") or not followed.startswith(alone):
        return None  # the reply is followed by the template's own text (an end-of-turn token)
    after = _encode(tokenizer, followed[len(alone) :])
    return after[0] if after and after[0] in _special_ids(tokenizer) else None


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


# Special tokens the named templates write (task.chat_template=<name>). A tokenizer without them
# gets them added, and the model embedding rows for them, as TRL's clone_chat_template does: else
# "<|im_end|>" is seven ordinary tokens and the model never learns one token that ends a turn.
TEMPLATE_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen2_5": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}

# -------------------------------------------------------------------------------- template


@dataclass(frozen=True)
class ChatTemplate:
    """The template a task renders with (None: plain-text rows without one), the token ids it
    added to the tokenizer, and the tokens that end an assistant turn (TaskData's fields)."""

    template: str | None
    new_tokens: list[int] = field(default_factory=list)
    stop_tokens: list[int] = field(default_factory=list)

    def data_fields(self, held_out: list[dict[str, Any]]) -> dict[str, Any]:
        """What a chat task's data declares of its template: the template, the ``held_out``
        prompts it can ask (:func:`answerable`), the tokens it added and those that end a turn."""
        return {
            "template": self.template,
            "prompts": answerable(held_out, self.template),
            "new_tokens": self.new_tokens,
            "stop_tokens": self.stop_tokens,
        }


def answerable(prompts: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """Held-out prompts to answer after training: none without a chat template to render them
    with (plain-text rows on a base model, task.text_rows=raw)."""
    if prompts and template is None:
        log.info("no held-out answers after training: there is no chat template to ask with")
        return []
    return prompts


def resolve_template(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None, text_rows: str = "chat"
) -> str | None:
    """The chat template ``task.chat_template`` names, or the tokenizer's; with
    ``text_rows=raw`` and none to be had (a base model), None: plain-text rows need none, and a
    row of messages is refused when it is met (:func:`require_template`)."""
    if text_rows == "raw" and not chat_template and not tokenizer.chat_template:
        return None
    return resolve_chat_template(tokenizer, chat_template)


def use_template(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None, text_rows: str = "chat"
) -> ChatTemplate:
    """Resolve the template (:func:`resolve_template`), add its special tokens to ``tokenizer``
    (:func:`add_template_tokens`) and set it there: saved with the tokenizer, final/ renders
    prompts as the model was trained on them."""
    template = resolve_template(tokenizer, chat_template, text_rows)
    new_tokens = add_template_tokens(tokenizer, chat_template)
    tokenizer.chat_template = template
    return ChatTemplate(template, new_tokens, end_of_turn(tokenizer, template))


def add_template_tokens(tokenizer: PreTrainedTokenizerBase, choice: str | None) -> list[int]:
    """Add the special tokens of the named template ``choice`` that ``tokenizer`` lacks (or
    has only as several tokens); returns their ids."""
    missing = [
        t
        for t in TEMPLATE_TOKENS.get(choice or "", ())
        if len(tokenizer(t, add_special_tokens=False)["input_ids"]) != 1
    ]
    if not missing:
        return []
    tokenizer.add_tokens(missing, special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(missing)
    log.info(
        "task.chat_template=%s: added %s to the tokenizer as special tokens (ids %s); the model "
        "gets new embedding rows for them, trained under LoRA too",
        choice,
        " ".join(missing),
        ids,
    )
    return ids


def end_of_turn(tokenizer: PreTrainedTokenizerBase, template: str | None) -> list[int]:
    """The special token that ends an assistant turn under ``template`` (the last labelled token
    of a probe conversation's reply that is not whitespace: a template's markers may wrap the
    newline after it), if it is a special token; [] otherwise, and without a template."""
    if template is None:
        return []
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    labels = tokenize_conversation(tokenizer, template, probe)["labels"]
    labelled = [t for t in labels if t != IGNORE_INDEX]
    while labelled and not tokenizer.decode(labelled[-1]).strip():
        labelled.pop()
    return [labelled[-1]] if labelled and labelled[-1] in _special_ids(tokenizer) else []


def require_template(template: str | None, place: str) -> None:
    """Refuse a row of messages (at ``place``) when there is no chat template to render it."""
    if template is None:
        raise ConfigError(
            f"{place} holds messages, which need a chat template, and the tokenizer has none "
            "(task.text_rows=raw reads only plain-string rows without one); name one with "
            f"task.chat_template={'|'.join(CHAT_TEMPLATES)} or a Jinja file."
        )


def templated_reply(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    prompt: list,
    completion: list,
    tools: Any,
    where: str,
) -> dict[str, list[int]]:
    """``prompt`` then ``completion`` rendered with the template, labelled on the completion
    (a preference pair's side, an unpaired row); a row the template cannot render is refused
    naming ``where``."""
    require_template(template, where)
    try:
        return tokenize_conversation(
            tokenizer, template, prompt + completion, tools=tools, label_from=len(prompt)
        )
    except (TemplateMismatch, RowError) as err:
        raise refusal(err, where) from None
