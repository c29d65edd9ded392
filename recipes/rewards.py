"""Reward functions for ``task=grpo``, with TRL's signature.

A reward function takes ``prompts`` and ``completions`` (one per completion: text, or for a
conversational prompt a list holding the assistant message, as TRL passes them), the row's other
columns as keyword arguments (one value per completion), and ``completion_ids``; it returns one
float per completion, or None where it does not apply (left out of that completion's sum, as in
TRL). An ``async def`` function is awaited, as in TRL. ``task.rewards`` lists them, each a built-in name or an import path
(``package.module:function``) with its weight and options::

    rewards:
      - {name: answer_f1, weight: 1.0}
      - {name: format, weight: 0.5, pattern: '<answer>.*</answer>'}
      - {name: my_pkg.rewards:exact_json, weight: 1.0}

Built in:

* ``answer_match``: 1 when the completion equals a reference answer after SQuAD's normalisation
  (lower case, no punctuation, articles or extra spaces), else 0;
* ``answer_f1``: SQuAD's word-overlap F1 with the best reference answer;
* ``math_answer``: 1 when the completion's final answer (``\\boxed{...}``, ``<answer>...</answer>``,
  ``#### x`` or else its last number) equals the reference as a number: ``1/2``, ``0.5`` and
  ``1,000`` are read exactly (fractions, decimals, thousands separators); else 0;
* ``format``: 1 when the whole completion matches ``pattern`` (a regular expression, ``.``
  matching newlines too), else 0; the default is the reasoning layout
  ``<think>...</think><answer>...</answer>``;
* ``span_overlap``: the share of the completion's words (SQuAD-normalised) found in the column
  ``column`` (``prompt`` by default: the prompt's text): how far an extractive answer keeps to
  its passage; 0 for an empty completion;
* ``length``: minus the completion's share of ``max_tokens`` (default: the task's
  ``max_completion_length``), from 0 (empty) to -1 (cut at the limit).
* ``reward_model``: a trained reward model's score of the prompt and completion together
  (``path``: the final/ of a ``task=reward_model`` run; ``batch_size``, 16), as TRL scores with
  a reward model.

``answer_*`` and ``math_answer`` read the reference from the column ``column`` (``answer`` by
default): a string or a list of strings.

:func:`scores` calls a function and checks what it gives: one that cannot take TRL's keywords,
raises, returns something other than a number or None, returns infinity (or a number float32
cannot hold), or returns the wrong count stops the run in one
line naming the function and the completion, before any optimizer step uses its rewards.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from recipes import user_code
from recipes.config import ConfigError, first_line
from recipes.metrics.squad import exact_match_score, f1_score, normalize_answer

RewardFn = Callable[..., Sequence[float | None]]

THINK_ANSWER = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of its (last) message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence) and completion:
        return text_of(completion[-1])
    return ""


def _references(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping) and "text" in value:  # SQuAD's answers: {"text": [...]}
        return _references(value["text"])
    return [str(v) for v in value]


def _best_scores(
    score: Callable[[str, str], float], completions: Sequence, references: Sequence
) -> list[float | None]:
    """Per completion, its best ``score`` against its row's reference answers (a string or a
    list of them); None for a row without one."""
    return [
        max((float(score(text_of(c).strip(), r)) for r in refs), default=None)
        for c, refs in zip(completions, map(_references, references), strict=True)
    ]


def answer_match(column: str = "answer") -> RewardFn:
    def answer_match(prompts: Sequence, completions: Sequence, **row: Any) -> list[float | None]:
        return _best_scores(exact_match_score, completions, _column(row, column))

    return answer_match


def answer_f1(column: str = "answer") -> RewardFn:
    def answer_f1(prompts: Sequence, completions: Sequence, **row: Any) -> list[float | None]:
        return _best_scores(f1_score, completions, _column(row, column))

    return answer_f1


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"


def final_answer(text: str) -> Fraction | None:
    """The number a completion (or a reference, GSM8K's ``#### 72`` included) gives as its
    answer: inside its last ``\\boxed{}``, ``<answer>`` or after ``####``, else its last number."""
    for pattern in (r"\\boxed\{([^{}]*)\}", r"<answer>(.*?)</answer>", r"####\s*([^\n]*)"):
        found = re.findall(pattern, text, flags=re.DOTALL)
        if found:
            text = found[-1]
            break
    numbers = re.findall(_NUMBER, text)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "").replace(" ", "")
    try:
        return Fraction(value)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(column: str = "answer") -> RewardFn:
    def math_answer(prompts: Sequence, completions: Sequence, **row: Any) -> list[float | None]:
        out: list[float | None] = []
        for c, refs in zip(completions, map(_references, _column(row, column)), strict=True):
            wanted = [v for v in map(final_answer, refs) if v is not None]
            if not wanted:
                out.append(None)  # no number to check against: not this reward's row
                continue
            got = final_answer(text_of(c))
            out.append(float(got is not None and got in wanted))
        return out

    return math_answer


def _words(value: Any) -> list[str]:
    if isinstance(value, list):  # messages
        value = " ".join(text_of(m) for m in value)
    return normalize_answer(str(value or "")).split()


def span_overlap(column: str = "prompt") -> RewardFn:
    def span_overlap(prompts: Sequence, completions: Sequence, **row: Any) -> list[float]:
        sources = prompts if column == "prompt" else _column(row, column)
        out = []
        for c, source in zip(completions, sources, strict=True):
            words, allowed = _words(text_of(c)), set(_words(source))
            out.append(sum(w in allowed for w in words) / len(words) if words else 0.0)
        return out

    return span_overlap


def format_match(pattern: str = THINK_ANSWER) -> RewardFn:
    try:
        compiled = re.compile(pattern, flags=re.DOTALL)
    except re.error as err:
        raise ConfigError(
            f"task.rewards: format pattern {pattern!r} is not a regular expression ({err})."
        ) from None

    def format(prompts: Sequence, completions: Sequence, **row: Any) -> list[float]:
        return [float(compiled.fullmatch(text_of(c)) is not None) for c in completions]

    return format


def length(max_tokens: int) -> RewardFn:
    if max_tokens < 1:
        raise ConfigError(f"task.rewards: length's max_tokens={max_tokens} must be >= 1.")

    def length(
        prompts: Sequence, completions: Sequence, completion_ids: Sequence, **row: Any
    ) -> list[float]:
        return [-min(len(ids), max_tokens) / max_tokens for ids in completion_ids]

    return length


# ------------------------------------------------------------------- a trained reward model


def reward_model(path: str | None = None, batch_size: int = 16) -> RewardFn:
    """The reward a trained reward model gives each whole completion (``path``: a final/ of
    ``task=reward_model``, or any one-output ``AutoModelForSequenceClassification`` folder), as
    TRL's GRPOTrainer scores with a model (``_calculate_rewards``): a conversational prompt and
    its completion rendered with the reward model's own chat template, a text prompt and its
    completion joined, tokenized without special tokens, padded on the right, ``batch_size``
    at a time, without gradients, on the run's device. The model loads on the first call."""
    folder = Path(str(path or "")).expanduser()
    if path is None or not (folder / "config.json").is_file():
        raise ConfigError(
            f"task.rewards: reward_model's path={path}: not a model folder (no config.json); "
            "give the final/ of a task=reward_model run, e.g. {name: reward_model, path: "
            "runs/rm/final}."
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"task.rewards: reward_model's batch_size={batch_size} must be >= 1.")
    loaded: list[Any] = []  # [model, tokenizer], once loaded

    def reward_model(prompts: Sequence, completions: Sequence, **row: Any) -> list[float]:
        import torch

        if not loaded:
            loaded.extend(_load_reward_model(folder))
        model, tokenizer = loaded
        texts = [
            tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
            if isinstance(p, list)
            else p + text_of(c)
            for p, c in zip(prompts, completions, strict=True)
        ]
        out: list[float] = []
        for start in range(0, len(texts), batch_size):
            inputs = tokenizer(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(model.device)
            with torch.no_grad():
                out += model(**inputs).logits[:, 0].float().tolist()
        return out

    return reward_model


def _load_reward_model(folder: Path) -> tuple[Any, Any]:
    """The one-output model of ``folder`` on the run's device (accelerate's), in evaluation
    mode, and its tokenizer, padding on the right with the pad id the model reads rewards by."""
    from accelerate import PartialState
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder)
    if model.config.num_labels != 1:
        raise ConfigError(
            f"task.rewards: reward_model's path={folder} has {model.config.num_labels} outputs; "
            "a reward model has one (the final/ of a task=reward_model run)."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model.config.pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    return model.to(PartialState().device).eval(), tokenizer


# ------------------------------------------------------------ tool calling (task.tools)


def tool_math_answer(column: str = "answer") -> RewardFn:
    """``math_answer`` of a conversation's last assistant turn that is text: with ``task.tools``
    a completion is its assistant and tool turns (TRL's), and a tool's result, or a turn that
    only calls a tool, is not the model's answer."""
    check = math_answer(column)

    def tool_math_answer(prompts: Sequence, completions: Sequence, **row: Any) -> list:
        return check(prompts, [_last_answer(c) for c in completions], **row)

    return tool_math_answer


def _last_answer(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    turns = [m for m in completion if m.get("role") == "assistant" and not m.get("tool_calls")]
    return text_of(turns[-1]) if turns else ""


BUILT_IN: dict[str, Callable[..., RewardFn]] = {
    "answer_match": answer_match,
    "answer_f1": answer_f1,
    "math_answer": math_answer,
    "span_overlap": span_overlap,
    "format": format_match,
    "length": length,
    "reward_model": reward_model,
    "tool_math_answer": tool_math_answer,
}


def _column(row: Mapping[str, Any], column: str) -> Sequence[Any]:
    if column not in row:
        raise ConfigError(
            f"task.rewards: the reward reads the column {column!r}, which the rows lack (they have "
            f"{', '.join(sorted(k for k in row if k != 'completion_ids')) or 'none'}); set its "
            "column: option, or add the column to the data."
        )
    return row[column]


def build(spec: Mapping[str, Any], max_completion_length: int) -> tuple[str, float, RewardFn]:
    """One ``task.rewards`` entry as (name, weight, function)."""
    options = {k: v for k, v in dict(spec).items() if k not in ("name", "weight")}
    name = spec.get("name")
    if not name or not isinstance(name, str):
        raise ConfigError(
            f"task.rewards: {dict(spec)} has no name; give a built-in "
            f"({', '.join(BUILT_IN)}) or an import path (package.module:function)."
        )
    weight = spec.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool):
        raise ConfigError(f"task.rewards: {name}'s weight={weight!r} must be a number.")
    if name in BUILT_IN:
        if name == "length":
            options.setdefault("max_tokens", max_completion_length)
        try:
            return name, float(weight), BUILT_IN[name](**options)
        except TypeError as err:
            raise ConfigError(f"task.rewards: {name}: {err}.") from None
    return name.rsplit(":", 1)[-1].rsplit(".", 1)[-1], float(weight), _imported(name, options)


def _imported(path: str, options: Mapping[str, Any]) -> RewardFn:
    module_name, attr = user_code.split(path)
    if not module_name or not attr:
        raise ConfigError(
            f"task.rewards: {path!r} is neither a built-in ({', '.join(BUILT_IN)}) nor an import "
            f"path (package.module:function){_did_you_mean(path, BUILT_IN)}"
        )
    module = user_code.import_module(module_name, "task.rewards", path)
    fn = getattr(module, attr, None)
    if fn is None:
        names = [n for n in vars(module) if not n.startswith("_")]
        raise ConfigError(
            f"task.rewards: cannot import {path!r} (module {module_name!r} has no attribute "
            f"{attr!r}){_did_you_mean(attr, names)}"
        )
    if not callable(fn):
        raise ConfigError(f"task.rewards: {path!r} is not a function.")
    return functools.partial(fn, **options) if options else fn


def scores(
    fn: RewardFn,
    name: str,
    places: Sequence[str],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
) -> list[float]:
    """``fn``'s rewards of ``completions`` (NaN where it returned None or NaN: not scored), called
    as TRL calls it. ``places`` says where each completion's prompt is (``train row 7``), for the
    refusals: a function that raises, returns a non-number or infinity, or the wrong count is a
    :class:`ConfigError` naming it and the completion (the run stops before any optimizer step
    uses these rewards)."""
    calls = dict(prompts=prompts, completions=completions, completion_ids=completion_ids)
    stopped = "; the run stopped before any step used its rewards."
    _check_signature(fn, name, [*calls, *columns], stopped)
    try:
        returned = _called(fn, calls, columns)
    except ConfigError:
        raise  # a built-in's own refusal (a column the rows lack) says what to change
    except BaseException as err:  # the user's code: anything it raises, sys.exit() included
        if not _users(err):
            raise
        which = _first_failing(fn, calls, columns, len(completions))
        at = (
            f"on completion {which} (the prompt of {places[which]})"
            if which is not None
            else f"on the batch of {len(completions)} completions (on none of them alone)"
        )
        exits = "" if isinstance(err, Exception) else ", which a reward function must not do"
        raise ConfigError(
            f"task.rewards: {name} raised {type(err).__name__} ({first_line(err)[:200]}){exits} "
            f"{at}, at {user_code.where(err)}{stopped} Fix the function: it must return a float, "
            "or None, per completion."
        ) from None
    if isinstance(returned, str | bytes | Mapping) or not isinstance(returned, Iterable):
        raise ConfigError(
            f"task.rewards: {name} returned {returned!r:.80} ({type(returned).__name__}) for "
            f"{len(completions)} completions{stopped} It must return a list: one float (or None) "
            "per completion."
        )
    values = list(returned)
    if len(values) != len(completions):
        raise ConfigError(
            f"task.rewards: {name} returned {len(values)} rewards for {len(completions)} "
            f"completions{stopped} It must return one (a float, or None) per completion."
        )
    out = []
    for i, value in enumerate(values):
        number = _number(value)
        if number is None or math.isinf(number) or abs(number) > _FLOAT32_MAX:
            raise ConfigError(
                f"task.rewards: {name} returned {value!r:.80} ({type(value).__name__}) for "
                f"completion {i} (the prompt of {places[i]}){stopped} It must return a finite "
                "float (within float32's range: the rewards are a float32 tensor), or None where "
                "it does not apply, per completion."
            )
        out.append(number)
    return out


def _check_signature(fn: RewardFn, name: str, keywords: list[str], stopped: str) -> None:
    """A function that cannot take TRL's keywords is named with what it was given, rather than
    reported as a TypeError "on completion 0"."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: it is simply called
        return
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        raise ConfigError(
            f"task.rewards: {name} cannot be called as TRL calls a reward function ({err}){stopped}"
            f" It is given the keywords {', '.join(keywords)}: declare the ones it uses and "
            "**kwargs for the rest, e.g. def reward(completions, **kwargs)."
        ) from None


_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: larger becomes inf


def _called(fn: RewardFn, calls: Mapping[str, Sequence], columns: Mapping[str, Sequence]) -> Any:
    """``fn(**calls, **columns)``; an ``async def`` function is awaited, as TRL runs one (TRL
    gathers several on a background loop; one at a time here, in the step's order)."""
    returned = fn(**calls, **columns)
    if inspect.isawaitable(returned):
        return asyncio.run(_awaited(returned))
    return returned


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _number(value: Any) -> float | None:
    """A reward as a float (NaN for None: not scored), or None when it is no number: a string
    (even ``"1.0"``, which TRL refuses too), a list, a dict."""
    if value is None:
        return math.nan
    if isinstance(value, str | bytes):
        return None
    try:
        return float(value)  # int, bool, numpy scalars, one-element tensors
    except (TypeError, ValueError):
        return None


def _first_failing(
    fn: RewardFn, calls: Mapping[str, Sequence], columns: Mapping[str, Sequence], count: int
) -> int | None:
    """The first completion that makes ``fn`` raise when called on it alone (called only once
    the whole batch raised), or None when none does alone."""
    for i in range(count):
        alone = {key: [values[i]] for key, values in (*calls.items(), *columns.items())}
        try:
            _called(fn, alone, {})
        except BaseException as err:
            if not _users(err):
                raise
            return i
    return None


def _users(err: BaseException) -> bool:
    """Whether ``err`` is the reward function's failure: an exception, or ``SystemExit`` /
    ``KeyboardInterrupt`` it raised (they would end the run, with exit 0 for ``sys.exit()``);
    not what the signal handler raises (a Ctrl-C, :class:`recipes.faults.StopNow`)."""
    if isinstance(err, KeyboardInterrupt):
        return not user_code.from_signal(err)
    return isinstance(err, Exception | SystemExit)


def _did_you_mean(word: str, choices: Any) -> str:
    """``; did you mean <closest>?`` when one of ``choices`` is close to ``word`` (difflib, as
    :mod:`recipes.config` answers a misspelt option), else ``.``."""
    near = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {near[0]}?" if near else "."
