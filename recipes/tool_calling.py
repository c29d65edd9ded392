"""Multi-turn tool calling for ``task=grpo`` (``task.tools``), as TRL 1.16's ``GRPOTrainer`` does
it (``trl/trainer/grpo_trainer.py``: ``_tool_call_loop``, ``_get_tool_suffix_ids``; the parser
``trl/chat_template_utils.py``'s ``parse_response`` over transformers' ``tokenizer.parse_response``):

* the tools (plain functions with type hints and a Google-style docstring, named by import path)
  are given to the chat template, which shows the model their JSON schemas;
* each completion is parsed into an assistant message; where it calls tools, they run, each
  result becomes a ``tool`` message, the template's tokens for those messages are appended to the
  completion (``tool_mask`` 0: no loss on them) and the model continues from there, up to
  ``task.max_tool_calling_iterations`` rounds, all within ``max_completion_length`` tokens (a
  round whose tool results would not fit is dropped and the completion ends there);
* a tool that raises (or calls ``sys.exit()``), an unknown tool, arguments that are no JSON
  object (a JSON string, as models write, gets TRL's ``argument after ** must be a mapping``), a
  call the parser cannot read and a tool that runs past ``task.tool_timeout`` seconds give a tool
  message ``{'error': ...}`` and count as failures; the run goes on (a timed-out tool's thread
  is left behind, as Python cannot stop a thread).

The model's tool calls are read with transformers' ``tokenizer.parse_response`` (transformers >=
5.13) under the tokenizer's ``response_template``, or where it has none the Hermes format
(``<tool_call>{json}</tool_call>``, Qwen 2.5's and SmolLM2's), TRL's ``qwen3_template``.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import transformers
from packaging.version import Version
from transformers import PreTrainedTokenizerBase

from recipes import user_code
from recipes.config import ConfigError, first_line

# TRL 1.16's qwen3_template (trl/chat_template_utils.py): an assistant turn's text, then any
# number of <tool_call>{"name": ..., "arguments": {...}}</tool_call>, then <|im_end|>.
HERMES_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
CALL_OPENS = ("<tool_call>",)  # text that says the model tried to call a tool (bad JSON too)

# (rows, their token ids so far, their new-token limits) -> each row's new tokens: the model's
# turn; ``rows`` index the batch's completions, so each can keep its own sampling stream.
Generate = Callable[[list[int], list[list[int]], list[int]], list[list[int]]]


def parse_supported() -> bool:
    """Whether this transformers parses responses with templates (5.13 and later)."""
    from recipes.tasks.configs.grpo import TOOLS_MIN_TRANSFORMERS

    return Version(transformers.__version__) >= Version(TOOLS_MIN_TRANSFORMERS)


def load_tools(specs: Sequence[str]) -> list[Callable]:
    """``task.tools``: each an import path (``package.module.function`` or ``module:function``)
    of a function transformers can describe to the chat template (type hints, docstring)."""
    from transformers.utils import get_json_schema

    tools = []
    for spec in specs:
        module_name, attr = user_code.split(str(spec))
        module = (
            user_code.import_module(module_name, "task.tools", str(spec)) if module_name else None
        )
        fn = getattr(module, attr, None)
        if module is not None and fn is None:
            raise ConfigError(
                f"task.tools: cannot import {spec!r} (module {module_name!r} has no attribute "
                f"{attr!r})."
            )
        if not callable(fn):
            raise ConfigError(
                f"task.tools: {spec!r} is not a function; give an import path such as "
                "recipes.tools.calculator."
            )
        if inspect.iscoroutinefunction(fn):
            raise ConfigError(
                f"task.tools: {spec!r} is an async function, which is not supported here (TRL "
                "awaits them); write it as a plain def."
            )
        try:
            get_json_schema(fn)
        except (
            Exception
        ) as err:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(
                f"task.tools: {spec!r} cannot be shown to the model ({first_line(err)}); give it "
                "type hints and a Google-style docstring with an Args: line per argument."
            ) from None
        tools.append(fn)
    names = [fn.__name__ for fn in tools]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"task.tools: names repeat ({', '.join(names)}); the model calls by name."
        )
    return tools


def use_parser(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give ``tokenizer`` the Hermes response template unless it has its own (TRL's
    ``add_response_schema``)."""
    if getattr(tokenizer, "response_template", None) is None:
        tokenizer.response_template = copy.deepcopy(HERMES_RESPONSE)


@dataclass
class Parsed:
    """An assistant turn as a message, and why a call in it could not be read (None: it could)."""

    message: dict[str, Any]
    error: str | None = None


def parse(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    prefix: Sequence[int],
    tools: Sequence[Callable],
    ends: Collection[int] = (),
) -> Parsed:
    """The turn ``ids`` (after ``prefix``) as a message, as TRL's ``parse_response``: the parser's
    message, or where it fails the decoded text. Unlike TRL, a failure in a turn that opens a
    tool call and ends (EOS or one of ``ends``: not cut by the budget) is kept as the call's
    error, so the model is told (TRL reads it as plain text)."""
    try:
        message = tokenizer.parse_response(list(ids), prefix=list(prefix), tools=list(tools))
        if message is None:
            raise ValueError("the parser found nothing")
        if isinstance(message.get("content"), str) and tokenizer.eos_token:
            message["content"] = message["content"].removesuffix(tokenizer.eos_token)
        if not message.get("content"):
            message["content"] = ""
        _check_calls(message.get("tool_calls"))
        return Parsed(message)
    except (ValueError, TypeError) as err:
        text = tokenizer.decode(list(ids), skip_special_tokens=True)
        ended = bool(ids) and ids[-1] in {tokenizer.eos_token_id, *ends}
        tried = ended and any(opening in text for opening in CALL_OPENS)
        return Parsed({"role": "assistant", "content": text}, first_line(err) if tried else None)


def _check_calls(calls: Any) -> None:
    """TRL's ``_validate_tool_calls``: each call a dict with a function name; no arguments: {}."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call without a function name")
        if function.get("arguments") is None:
            function["arguments"] = {}


def run_call(call: Mapping[str, Any], tools: Mapping[str, Callable], timeout: float) -> tuple:
    """One tool call as ``(name, content, failed)``: the tool's result as text, or TRL's
    ``{'error': ...}`` for an unknown tool, a call the tool cannot take, an exception or a
    tool still running after ``timeout`` seconds."""
    if call.get("type") != "function":
        error = {"error": f"Unsupported tool call type: {call.get('type')}"}
        return call.get("name", "unknown"), str(error), True
    function = call["function"]
    name = function["name"]
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        # As TRL 1.16 calls it (grpo_trainer.py, _tool_call_loop: ``tool(**function["arguments"])``):
        # arguments that are no mapping (a JSON string) fail with Python's own TypeError.
        return name, str(_call(tools[name], function.get("arguments", {}), timeout)), False
    except Exception as err:
        return name, str({"error": str(err)}), True


def _call(fn: Callable, arguments: Any, timeout: float) -> Any:
    """``fn(**arguments)`` in a daemon thread, given up on after ``timeout`` seconds."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn(**arguments)
        except BaseException as err:  # handed to the caller's thread
            out["error"] = err

    thread = threading.Thread(target=target, name=f"tool-{fn.__name__}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{fn.__name__} did not return within {timeout:g} s (task.tool_timeout)")
    error = out.get("error")
    if error is not None and not isinstance(error, Exception):
        # sys.exit() / KeyboardInterrupt in a tool: that call failed, the run goes on (raised
        # here they would end it, sys.exit(0) with exit code 0 as if it had finished).
        raise RuntimeError(f"{fn.__name__} exited ({type(error).__name__}: {error})") from error
    if error is not None:
        raise error
    return out["value"]


def suffix_ids(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    tool_messages: list[dict],
    ends: Collection[int] = (),
) -> list[int]:
    """The template's tokens for ``tool_messages`` and the next assistant header, after an
    assistant turn that ends with its stop token (EOS or one of ``ends``): TRL's
    ``_get_tool_suffix_ids`` (a dummy conversation rendered with and without them)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    options = {"tokenize": True, "chat_template": template, "return_dict": False}
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **options)
    whole = tokenizer.apply_chat_template(
        dummy + tool_messages, add_generation_prompt=True, **options
    )
    stops = {tokenizer.eos_token_id, *ends}
    at = [i for i, token in enumerate(prefix) if token in stops]
    if at:  # the completion ends at its stop token; the template may write a newline after it
        prefix = prefix[: at[-1] + 1]
    if whole[: len(prefix)] != prefix:
        raise ConfigError(
            "task.chat_template: it renders an assistant turn differently once tool messages "
            "follow, so tool results cannot be appended to a completion; use a template that "
            "keeps earlier turns as they are (task.chat_template=qwen2_5)."
        )
    return list(whole[len(prefix) :])


def check_template(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    tools: Sequence[Callable],
    ends: Collection[int] = (),
) -> None:
    """Refuse, before training, a template that does not show the tools, drops a tool call or a
    tool message (TRL's ``supports_tool_calling``), or renders an assistant turn differently once
    tool messages follow (``is_chat_template_prefix_preserving``; :func:`suffix_ids` raises)."""
    names = ("probe_tool_a8f3", "probe_key_b9d4", "probe_value_d6e7", "probe_result_c4f9")
    calls = [
        {"type": "function", "function": {"name": names[0], "arguments": {names[1]: names[2]}}}
    ]
    probe = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": names[0], "content": names[3]},
    ]
    options = {"chat_template": template, "tokenize": False}
    try:
        shown = tokenizer.apply_chat_template(probe[:1], tools=list(tools), **options)
        rendered = tokenizer.apply_chat_template(probe, **options)
    except Exception as err:  # jinja2's TemplateError, a template that cannot take dicts
        rendered, shown = f"({first_line(err)})", ""
    missing = [n for n in names if n not in rendered]
    if missing or tools[0].__name__ not in shown:
        raise ConfigError(
            "task.tools: the chat template does not render "
            + ("the tools' schemas" if not missing else "tool calls and tool messages")
            + " (TRL's supports_tool_calling); use task.chat_template=qwen2_5 (Hermes tool "
            "calls, <|im_start|>/<|im_end|> as SmolLM2 and Qwen 2.5) or a template that does."
        )
    suffix_ids(tokenizer, template, probe[2:], ends)


@dataclass
class Conversations:
    """Completions after tool calling: their token ids (model turns and tool results), which
    tokens the model wrote (``tool_mask`` 1) and which the tools (0), each as messages (the
    assistant and tool turns, what rewards read), and the calls made and failed."""

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    messages: list[list[dict[str, Any]]]
    calls: int = 0
    failures: int = 0

    def stats(self) -> dict[str, float]:
        """TRL's tool metrics: calls per completion, and the share of calls that failed."""
        return {
            "tools/call_frequency": self.calls / max(1, len(self.completion_ids)),
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
        }


def tool_call_loop(
    generate: Generate,
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    tools: Sequence[Callable],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    max_completion_length: int,
    max_iterations: int | None,
    timeout: float,
    max_length: int | None = None,
    ends: Collection[int] = (),
) -> Conversations:
    """Parse each first turn (``completion_ids`` after ``prompt_ids``), run the tools it calls and
    let the model go on (``generate``), as TRL's ``_tool_call_loop``; ``max_length``: the
    model's positions (a round that would reach them is dropped, as in TRL); ``ends``: the
    tokens that end a turn besides EOS."""
    by_name = {fn.__name__: fn for fn in tools}
    ids = [list(c) for c in completion_ids]
    mask = [[1] * len(c) for c in ids]
    first = [parse(tokenizer, c, p, tools, ends) for p, c in zip(prompt_ids, ids, strict=True)]
    messages = [[p.message] for p in first]
    out = Conversations(ids, mask, messages)
    pending = {i: _calls(p) for i, p in enumerate(first) if _calls(p)}
    rounds = 0
    while pending and (max_iterations is None or rounds < max_iterations):
        grown: dict[int, list[int]] = {}
        for i, calls in pending.items():
            results = [_run(call, by_name, timeout) for call in calls]
            out.calls += len(results)
            out.failures += sum(failed for *_, failed in results)
            tool_messages = [{"role": "tool", "name": n, "content": c} for n, c, _ in results]
            whole = [*prompt_ids[i], *ids[i], *suffix_ids(tokenizer, template, tool_messages, ends)]
            overlong = len(whole) - len(prompt_ids[i]) > max_completion_length or (
                max_length is not None and len(whole) >= max_length
            )
            if not overlong:  # else the results are dropped and the completion ends as it is
                messages[i].extend(tool_messages)
                grown[i] = whole
        # Each row's next turn within what is left of its budget (TRL generates a whole
        # max_completion_length and cuts it: the same tokens, drawn from the row's own stream).
        budgets = {
            i: max_completion_length - (len(w) - len(prompt_ids[i])) for i, w in grown.items()
        }
        asked = [i for i, budget in budgets.items() if budget > 0]
        turns = (
            generate(asked, [grown[i] for i in asked], [budgets[i] for i in asked]) if asked else []
        )
        new = dict(zip(asked, turns, strict=True))
        pending = {}
        for i in grown:
            turn = new.get(i, [])
            tool_length = len(grown[i]) - len(prompt_ids[i]) - len(ids[i])
            mask[i] += [0] * tool_length + [1] * len(turn)
            ids[i] = grown[i][len(prompt_ids[i]) :] + list(turn)
            if turn:
                parsed = parse(tokenizer, turn, grown[i], tools, ends)
                messages[i].append(parsed.message)
                if _calls(parsed):
                    pending[i] = _calls(parsed)
        rounds += 1
    return out


def _calls(parsed: Parsed) -> list[dict[str, Any]]:
    """The calls to run for a parsed turn: its tool calls, or the one it could not read."""
    if parsed.error is not None:
        return [{"type": "function", "function": {"name": "unknown"}, "error": parsed.error}]
    return list(parsed.message.get("tool_calls") or [])


def _run(call: Mapping[str, Any], tools: Mapping[str, Callable], timeout: float) -> tuple:
    if "error" in call:  # the parser could not read it
        return "unknown", str({"error": f"the tool call could not be read: {call['error']}"}), True
    return run_call(call, tools, timeout)
