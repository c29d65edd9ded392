"""The chat features of the tasks that train a causal LM on chat rows (SFT, DPO, KTO, GRPO).

Each such task holds a :class:`ChatFeatures` (built from its settings) and calls the functions
here; none inherits them from another task. What they share:

* the chat template: resolved from ``task.chat_template`` or the tokenizer, its special tokens
  added to the tokenizer where it lacks them, set on the tokenizer (saved with it, so final/
  renders prompts as trained), and the token that ends an assistant turn (:func:`use_template`);
* rows rendered and tokenized once per split, cached on disk by the data, the tokenizer, the
  template and the task's feature settings, and refused when no row is kept
  (:meth:`ChatFeatures.read_splits`, uncached :func:`tokenize_rows`); a reply rendered after its
  prompt (:func:`templated_reply`);
* the held-out prompts answered greedily after training, scored against their reference
  (:func:`held_out_prompts`, :func:`answerable`, :func:`answer_held_out`), and mode=predict's
  answers to the prompts of a file (:func:`predict_data`, :func:`predict`);
* the model's limits (:meth:`ChatFeatures.check_model`) and its forward on a batch, packed rows
  included (:func:`forward`); the padding-free layout's choice (:func:`flat_batches`,
  ``task.padding_free``) and its per-sequence losses (:func:`sequence_losses`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.metrics.squad import exact_match_score, f1_score
from recipes.tasks.base import RunContext, TaskData
from recipes.tasks.chat.batches import attention_of, fit_length, packing_unsupported_reason
from recipes.tasks.chat.rows import FORMATS, normalise, read_conversations
from recipes.tasks.chat.template import (
    ChatTemplate,
    render,
    templated_reply,
    tokenize_text,
    use_template,
)
from recipes.tasks.outputs import write_jsonl

log = get_logger(__name__)

# What ChatFeatures.tokenized maps over a split, batched: (batch, tokenizer, template, source)
# -> the feature columns of the rows it keeps.
Tokenize = Callable[[Mapping[str, list], PreTrainedTokenizerBase, "str | None", str], dict]
# A row module's reader of a file ((path, format) -> its rows, or None for datasets to read it)
# and its check of rows however read ((rows, format, source) -> the rows in its columns).
Read = Callable[[Path, str], "Dataset | None"]
Normalise = Callable[[Dataset, str, str], Dataset]
# A task's check of a split's rows before they are tokenized: (rows, source, template).
CheckRows = Callable[[Dataset, str, "str | None"], None]


def tokenize_rows(
    rows: Dataset,
    tokenize: Tokenize,
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    source: str,
    **options: Any,
) -> Dataset:
    """``rows`` mapped by ``tokenize`` (batched), each batch's rows replaced by the feature
    columns it returns; ``options``: ``Dataset.map``'s own (``num_proc``, ``desc``)."""
    return rows.map(
        tokenize,
        batched=True,
        remove_columns=rows.column_names,
        fn_kwargs={"tokenizer": tokenizer, "template": template, "source": source},
        **options,
    )


@dataclass
class ChatData(TaskData):
    """A chat task's features, and the prompts answered after training or in mode=predict
    (``{"messages", "tools", "reference"}``, asked in ``template``)."""

    prompts: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------- held-out prompts


def held_out_prompts(
    rows: Iterable[Mapping[str, Any]],
    count: int,
    ask: Callable[[Mapping[str, Any]], tuple[list, str] | None],
) -> list[dict[str, Any]]:
    """The first ``count`` prompts that ``ask`` finds in ``rows``: each row's (messages to
    answer, reference answer), or None to pass the row; with the row's ``tools``."""
    prompts: list[dict[str, Any]] = []
    for row in rows:
        if len(prompts) >= count:
            break
        found = ask(row)
        if found is not None:
            messages, reference = found
            prompts.append(
                {"messages": messages, "tools": row.get("tools"), "reference": reference}
            )
    return prompts


def answer(
    model: torch.nn.Module,
    data: ChatData,
    run: RunContext,
    generation: GenerationConfig,
    max_new_tokens: int,
    max_length: int,
) -> list[str]:
    """The answer to each of ``data.prompts``, rendered with its template (every process
    answering its share; the answers of all on every process)."""
    tokenizer = run.tokenizer
    prompts = [
        render(tokenizer, data.template, p["messages"], True, p["tools"]) for p in data.prompts
    ]
    return generation_lib.complete(
        model,
        prompts,
        tokenizer,
        generation,
        max_new_tokens,
        max_length=max_length,
        accelerator=run.accelerator,
    )


def answer_held_out(
    model: torch.nn.Module, data: ChatData, run: RunContext, max_new_tokens: int, max_length: int
) -> dict[str, Any]:
    """Greedy answers to the held-out prompts, in ``generations.jsonl`` and the log, and their
    scores against the references (:func:`generation_scores`)."""
    if not data.prompts:
        return {}
    greedy = generation_lib.on_engine(
        GenerationConfig(batch_size=run.generation.batch_size), run.generation
    )
    answers = answer(model, data, run, greedy, max_new_tokens, max_length)
    records = [
        {"messages": p["messages"], "reference": p["reference"], "generated": answer}
        for p, answer in zip(data.prompts, answers, strict=True)
    ]
    if run.accelerator.is_main_process:
        write_jsonl(run.output_dir / "generations.jsonl", records)
    for record in records[:4]:
        log.info("greedy answer: %r (reference %r)", record["generated"], record["reference"])
    scores = generation_scores(records)
    log.info(
        "greedy answers to %d held-out prompts: exact match %.2f, F1 %.2f (SQuAD v1.1 scoring)",
        len(records),
        scores["generation/exact_match"],
        scores["generation/f1"],
    )
    return {**scores, "sample/generations": json.dumps(records[:16], ensure_ascii=False)}


def generation_scores(records: list[dict[str, Any]]) -> dict[str, float]:
    """Exact match and F1 of the greedy answers against the reference answers, with the
    official SQuAD v1.1 normalisation (the project's QA metric), as percentages."""
    pairs = [(r["generated"].strip(), r["reference"]) for r in records]
    return {
        "generation/exact_match": 100.0
        * sum(exact_match_score(g, r) for g, r in pairs)
        / len(pairs),
        "generation/f1": 100.0 * sum(f1_score(g, r) for g, r in pairs) / len(pairs),
        "generation/count": float(len(pairs)),
    }


def predict_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, chat_template: str | None, fmt: str
) -> ChatData:
    """mode=predict: the prompts of ``data.predict_file``: conversations (any layout training
    reads, in ``fmt`` where it names one, the answer's field optional) or TRL's prompt-only
    rows; a conversation that ends with an assistant reply is asked what comes before it, and
    the reply is kept as its reference."""
    chat = use_template(tokenizer, chat_template)
    fmt = fmt if fmt in FORMATS else "auto"  # a pair's or row's layout: auto
    split = data_lib.load_predict_file(cfg, lambda path: read_conversations(path, fmt, prompt=True))
    prompts = []
    for row in normalise(split.examples, fmt, split.source, prompt=True):
        messages, reference = row["messages"], None
        if messages[-1]["role"] == "assistant":
            messages, reference = messages[:-1], messages[-1]["content"]
        prompts.append({"messages": messages, "tools": row["tools"], "reference": reference})
    empty = Dataset.from_dict({"input_ids": []})
    return ChatData(
        train=empty,
        eval=empty,
        template=chat.template,
        prompts=prompts,
        new_tokens=chat.new_tokens,
        stop_tokens=chat.stop_tokens,
    )


def predict(
    model: torch.nn.Module, data: ChatData, run: RunContext, max_new_tokens: int, max_length: int
) -> dict[str, Any]:
    """mode=predict's ``generations.jsonl``: per prompt, its messages, the answer generated
    with the chat template (greedy, or sampled with ``generation.do_sample``;
    ``generation.max_new_tokens``, else ``max_new_tokens``) and the reference, if any."""
    generation = run.generation
    new_tokens = generation.max_new_tokens or max_new_tokens
    answers = answer(model, data, run, generation, new_tokens, max_length)
    if run.accelerator.is_main_process:
        records = (
            {"messages": p["messages"], "generated": answer}
            | ({"reference": p["reference"]} if p["reference"] is not None else {})
            for p, answer in zip(data.prompts, answers, strict=True)
        )
        write_jsonl(run.output_dir / "generations.jsonl", records)
    return {"rows": len(answers), "file": "generations.jsonl"}


@dataclass(frozen=True)
class PromptAnswers:
    """``mode=predict`` of a chat task, the part it holds as ``predictor``: the prompts of
    ``data.predict_file`` (rows in ``layout``, the task's ``format``; auto detects it) answered
    in the task's template with its :class:`ChatFeatures` (:func:`predict_data`,
    :func:`predict`)."""

    chat: ChatFeatures
    layout: str = "auto"

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChatData:
        return self.chat.predict_data(cfg, tokenizer, self.layout)

    def predict(
        self, model: torch.nn.Module, loader: Any, data: ChatData, run: RunContext
    ) -> dict[str, Any]:
        return self.chat.predict(model, data, run)


# ------------------------------------------------------------------------------ features


@dataclass(frozen=True)
class ChatSplits:
    """A chat task's splits as :meth:`ChatFeatures.read_splits` built them: the template they
    are rendered in, and by split (``train``, ``eval``) its rows, their features and the
    features' cache key."""

    template: ChatTemplate
    rows: dict[str, Dataset]
    features: dict[str, Dataset]
    keys: dict[str, str]


@dataclass(frozen=True)
class ChatFeatures:
    """A chat task's feature building: rows rendered, tokenized, fitted to ``max_seq_length``
    (``truncation``) and cached; and the checks of the model that reads them.

    ``settings``: the task's feature settings (part of the cache key); ``kind``: the cache's
    and progress bar's name of the features, ``version`` their builder's version (bumped to
    invalidate cached features); ``row_words``: what a row is, and what in it is learnt, in the
    refusal of a split where none is kept; ``max_new_tokens``: the length of the answers to
    held-out prompts (and of mode=predict's, without ``generation.max_new_tokens``);
    ``format``: the rows' layout (the task's ``format``), what :meth:`read_splits` reads."""

    chat_template: str | None
    text_rows: str
    max_seq_length: int
    truncation: str
    settings: Mapping[str, Any]
    kind: str
    version: int
    row_words: tuple[str, str] = ("conversation", "its assistant turns")
    max_new_tokens: int = 64
    format: str = "auto"

    @classmethod
    def of(
        cls,
        args: Any,
        kind: str,
        version: int,
        row_words: tuple[str, str],
        max_new_tokens: int | None = None,
    ) -> ChatFeatures:
        """The chat features of a task's settings (a :class:`ChatRowsConfig`); the answers'
        ``max_new_tokens`` a :class:`ChatConfig`'s ``generation_max_new_tokens`` unless given
        (a task that answers no prompt has none)."""
        if max_new_tokens is None:
            max_new_tokens = args.generation_max_new_tokens
        return cls(
            args.chat_template,
            args.text_rows,
            args.max_seq_length,
            args.truncation,
            args.features_key(),
            kind,
            version,
            row_words,
            max_new_tokens,
            args.format,
        )

    def predict_data(
        self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, fmt: str
    ) -> ChatData:
        """:func:`predict_data` in the task's template."""
        return predict_data(cfg, tokenizer, self.chat_template, fmt)

    def predict(self, model: torch.nn.Module, data: ChatData, run: RunContext) -> dict[str, Any]:
        """:func:`predict` within ``max_seq_length``."""
        return predict(model, data, run, self.max_new_tokens, self.max_seq_length)

    def answer_held_out(
        self, model: torch.nn.Module, data: ChatData, run: RunContext
    ) -> dict[str, Any]:
        """:func:`answer_held_out` within ``max_seq_length``."""
        return answer_held_out(model, data, run, self.max_new_tokens, self.max_seq_length)

    def use_template(self, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
        """:func:`use_template` with the task's settings."""
        return use_template(tokenizer, self.chat_template, self.text_rows)

    def fit(self, whole: dict[str, list[int]]) -> dict[str, list[int]] | None:
        """A tokenized row within ``max_seq_length`` tokens, or None where it is dropped."""
        return fit_length(whole, self.max_seq_length, self.truncation)

    def pair_sides(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        pair: Mapping[str, Any],
        where: str,
    ) -> list[dict[str, list[int]]] | None:
        """A preference pair's two sides (the prompt then the chosen, then the rejected
        completion) tokenized, labelled on the completion and fitted (:meth:`fit`); None where
        the length policy drops a side, and with it the pair. A plain-string pair under
        ``text_rows=raw`` is text as TRL tokenizes it (no template, EOS after each side), any
        other is rendered with ``template``. ``pair``: a row of
        :data:`recipes.tasks.chat.preference.COLUMNS`."""
        prompt, tools = pair["prompt"], pair["tools"]
        completions = (pair["chosen"], pair["rejected"])
        if pair["text"] and self.text_rows == "raw":
            texts = [side[0]["content"] for side in completions]
            wholes = tokenize_text(tokenizer, prompt[0]["content"], texts)
        else:
            wholes = [
                templated_reply(tokenizer, template, prompt, c, tools, where) for c in completions
            ]
        sides = [self.fit(w) for w in wholes]
        return None if None in sides else sides

    def read_splits(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        read: Read,
        normalise: Normalise,
        tokenize: Tokenize,
        check: CheckRows | None = None,
    ) -> ChatSplits:
        """Both splits read in the task's ``format`` by a row module's ``read`` and
        ``normalise``, checked by ``check`` and tokenized by ``tokenize`` in the task's template
        (:meth:`use_template`), cached (:meth:`tokenized`)."""
        chat_template = self.use_template(tokenizer)
        template = chat_template.template
        splits = data_lib.load_splits(cfg, lambda path: read(path, self.format))
        rows, features, keys = {}, {}, {}
        for role, split in splits.items():
            rows[role] = normalise(split.examples, self.format, split.source)
            if check is not None:
                check(rows[role], split.source, template)
            keys[role], features[role] = self.tokenized(
                cfg, tokenizer, template, role, split, rows[role], tokenize
            )
        return ChatSplits(chat_template, rows, features, keys)

    def report_pairs(self, role: str, pairs: Dataset, built: Dataset) -> None:
        """How many preference pairs of a split became features, and what the length policy
        did to a long side."""
        log.info(
            "%s: %d pairs -> %d features; a side longer than task.max_seq_length=%d is %s",
            role,
            len(pairs),
            len(built),
            self.max_seq_length,
            "cut at its end" if self.truncation == "truncate" else "dropped with its pair",
        )

    def tokenized(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        role: str,
        split: data_lib.Split,
        rows: Dataset,
        tokenize: Tokenize,
    ) -> tuple[str, Dataset]:
        """``rows`` mapped by ``tokenize`` (batched), cached on disk by the data, the tokenizer,
        the template and the task's settings; and that cache key. A split of which no row is
        kept is refused (:meth:`none_kept`)."""
        key = data_lib.split_key(
            role,
            split,
            tokenizer,
            template=template,
            task=dict(self.settings),
            version=self.version,
        )

        def build() -> Dataset:
            with data_lib.map_progress(len(rows)):
                built = tokenize_rows(
                    rows,
                    tokenize,
                    tokenizer,
                    template,
                    split.source,
                    num_proc=cfg.preprocessing_num_workers,
                    desc=f"{role}: render and tokenize ({self.kind})",
                )
            if len(built) == 0:  # refused here: an empty split cannot be cached
                raise DataError(self.none_kept(role, split.source, len(rows)))
            return built

        cached = data_lib.cached(data_lib.cache_root(cfg) / f"{self.kind}-{role}-{key}", build)
        return key, cached

    def none_kept(self, role: str, source: str, rows: int) -> str:
        """Why no row of a split was kept, and the fix (``rows``: how many there were)."""
        what, reply = self.row_words
        if self.truncation == "drop":
            why = (
                f"as longer than task.max_seq_length={self.max_seq_length} (task.truncation="
                "drop); raise task.max_seq_length, or set task.truncation=truncate to cut them"
            )
        else:
            why = (
                f"after a cut to task.max_seq_length={self.max_seq_length} tokens (task.truncation="
                f"truncate), none kept a token of {reply}; raise task.max_seq_length"
            )
        return f"{role} data {source}: every {what} ({rows}) was dropped {why}."

    def check_model(self, model: torch.nn.Module, packing: bool = False) -> None:
        """Refuse a ``max_seq_length`` beyond the model's positions, and packed rows under an
        attention implementation that cannot keep them apart."""
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions and self.max_seq_length > positions:
            raise ConfigError(
                f"task.max_seq_length={self.max_seq_length} is longer than the model's "
                f"{positions} positions; set task.max_seq_length={positions} or less."
            )
        if packing and (reason := packing_unsupported_reason(attention_of(model))):
            raise ConfigError(
                f"task.packing=true: {reason}; use model.attn_implementation=sdpa (or eager), "
                "or task.packing=false."
            )
