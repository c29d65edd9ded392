"""Supervised fine-tuning of a causal LM on conversations (``task=sft``).

What the task adds to the shared loop: conversations read in the common layouts and rendered
with a chat template (:mod:`recipes.tasks.conversations`), loss on the assistant's tokens only, a
length policy, optional packing without cross-talk between the packed conversations, and after
training greedy answers to a few held-out prompts. Evaluation is the loss and perplexity of the
held-out conversations' labelled tokens (the assistant's), summed exactly across processes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.metrics.squad import exact_match_score, f1_score
from recipes.tasks import conversations
from recipes.tasks.base import (
    SummedLoss,
    Task,
    TaskData,
    write_jsonl,
)
from recipes.tasks.token_loss import token_losses

log = get_logger(__name__)

FEATURES_VERSION = 3  # bump when feature building changes, to invalidate cached features


@dataclass
class ChatData(TaskData):
    """The features, the chat template in use, and the held-out prompts answered greedily."""

    template: str | None = None
    prompts: list[dict[str, Any]] = field(default_factory=list)


class SupervisedFineTuning(Task[ChatData]):
    """Chat SFT (``task=sft``).

    Args:
        format: layout of the rows: auto (detected per row), messages, sharegpt, alpaca, dolly,
            prompt_completion.
        chat_template: null (the tokenizer's), a name (chatml, llama3, zephyr) or a Jinja file.
        text_rows: plain-string prompt/completion rows as chat turns (chat) or as text, the way
            TRL tokenizes them (raw).
        max_seq_length: tokens per conversation (and per packed row).
        truncation: truncate (cut the end) or drop conversations longer than max_seq_length.
        train_on_prompt: label every token, not only the assistant's.
        packing: share rows between conversations (training split only).
        num_generations: held-out prompts answered greedily after training (0: none).
        generation_max_new_tokens: length limit of those answers.
        generation: the run's ``generation.*`` (``generation.batch_size`` for those answers).
    """

    auto_model_class = AutoModelForCausalLM
    sums_loss_terms = True
    main_metric = "loss"
    greater_is_better = False
    _row_words = ("conversation", "its assistant turns")  # in _none_kept's message

    def __init__(
        self,
        *,
        format: str,
        chat_template: str | None,
        max_seq_length: int,
        truncation: str,
        train_on_prompt: bool,
        packing: bool,
        num_generations: int,
        generation_max_new_tokens: int,
        generation: Mapping[str, Any] | GenerationConfig | None,
        text_rows: str,
    ) -> None:
        if text_rows not in conversations.TEXT_ROWS:
            raise ConfigError(
                f"task.text_rows={text_rows!r}: choose chat (plain-string rows as a user turn and "
                "an assistant reply, rendered with the chat template) or raw (as text, as TRL)."
            )
        if format not in conversations.FORMATS:
            raise ConfigError(f"task.format={format!r}: choose {', '.join(conversations.FORMATS)}.")
        if truncation not in conversations.TRUNCATION:
            raise ConfigError(
                f"task.truncation={truncation!r}: choose truncate (cut the end of a long "
                "conversation) or drop (leave it out)."
            )
        if max_seq_length < 2:
            raise ConfigError(f"task.max_seq_length={max_seq_length}: must be at least 2.")
        if num_generations < 0:
            raise ConfigError(f"task.num_generations={num_generations}: must be >= 0.")
        self.format = format
        self.chat_template = chat_template
        self.max_seq_length = max_seq_length
        self.truncation = truncation
        self.train_on_prompt = train_on_prompt
        self.packing = packing
        self.num_generations = num_generations
        self.generation_max_new_tokens = generation_max_new_tokens
        self.generation = generation_lib.typed(generation)
        self.text_rows = text_rows
        self._attn = "sdpa"  # the model's attention implementation, read in check_model

    def settings(self) -> dict[str, Any]:
        keys = ("format", "chat_template", "max_seq_length", "truncation", "train_on_prompt")
        return {k: getattr(self, k) for k in keys} | {
            "packing": self.packing,
            "text_rows": self.text_rows,
        }

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChatData:
        template = self._template(tokenizer)
        new_tokens = _add_template_tokens(tokenizer, self.chat_template)
        tokenizer.chat_template = template  # saved with it: final/ renders prompts as trained
        splits = data_lib.load_splits(
            cfg, lambda path: conversations.read_conversations(path, self.format)
        )
        features, dialogues = {}, {}
        for role, split in splits.items():
            dialogues[role] = conversations.normalise(split.examples, self.format, split.source)
            features[role] = self._features(cfg, tokenizer, template, role, split, dialogues[role])
        train = features["train"]
        if self.packing:
            train = self._pack(train)
        collator = conversations.ChatCollator(tokenizer.pad_token_id)
        return ChatData(
            train=train,
            eval=features["eval"],
            train_collator=collator,
            eval_collator=collator,
            template=template,
            prompts=_answerable(
                _held_out_prompts(dialogues["eval"], self.num_generations), template
            ),
            new_tokens=new_tokens,
            stop_tokens=_end_of_turn(tokenizer, template),
        )

    def _template(self, tokenizer: PreTrainedTokenizerBase) -> str | None:
        """The chat template; with ``text_rows=raw`` and none to be had (a base model), None:
        plain-text rows need none, and a row of messages is refused when it is met."""
        if self.text_rows == "raw" and not self.chat_template and not tokenizer.chat_template:
            return None
        return conversations.resolve_chat_template(tokenizer, self.chat_template)

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChatData:
        """The prompts of ``data.predict_file``: conversations (any layout training reads, the
        answer's field optional) or TRL's prompt-only rows; a conversation that ends with an
        assistant reply is asked what comes before it, and the reply is kept as its reference."""
        template = conversations.resolve_chat_template(tokenizer, self.chat_template)
        new_tokens = _add_template_tokens(tokenizer, self.chat_template)
        tokenizer.chat_template = template
        fmt = (
            self.format if self.format in conversations.FORMATS else "auto"
        )  # DPO's layouts are pairs
        split = data_lib.load_predict_file(
            cfg, lambda path: conversations.read_conversations(path, fmt, prompt=True)
        )
        prompts = []
        for row in conversations.normalise(split.examples, fmt, split.source, prompt=True):
            messages, reference = row["messages"], None
            if messages[-1]["role"] == "assistant":
                messages, reference = messages[:-1], messages[-1]["content"]
            prompts.append({"messages": messages, "tools": row["tools"], "reference": reference})
        empty = Dataset.from_dict({"input_ids": []})
        return ChatData(
            train=empty,
            eval=empty,
            template=template,
            prompts=prompts,
            new_tokens=new_tokens,
            stop_tokens=_end_of_turn(tokenizer, template),
        )

    def predict(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        loader: Iterable[dict[str, torch.Tensor]],
        data: ChatData,
        accelerator: Accelerator,
        output_dir: Path,
        generation: GenerationConfig,
    ) -> dict[str, Any]:
        """``generations.jsonl``: per prompt, its messages, the answer generated with the chat
        template (greedy, or sampled with ``generation.do_sample``) and the reference, if any."""
        prompts = [
            conversations.render(tokenizer, data.template, p["messages"], True, p["tools"])
            for p in data.prompts
        ]
        answers = generation_lib.complete(
            model,
            prompts,
            tokenizer,
            generation,
            generation.max_new_tokens or self.generation_max_new_tokens,
            max_length=self.max_seq_length,
            accelerator=accelerator,
        )
        if accelerator.is_main_process:
            records = (
                {"messages": p["messages"], "generated": answer}
                | ({"reference": p["reference"]} if p["reference"] is not None else {})
                for p, answer in zip(data.prompts, answers, strict=True)
            )
            write_jsonl(output_dir / "generations.jsonl", records)
        return {"rows": len(answers), "file": "generations.jsonl"}

    def _features(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        role: str,
        split: data_lib.Split,
        dialogues: Dataset,
    ) -> Dataset:
        """Token ids and labels of each conversation, length policy applied (cached on disk)."""
        first = dialogues[0]
        if not (first["text"] and self.text_rows == "raw"):
            where = f"{split.source} {first['place']}"
            self._check_has_template(template, where)
            conversations.check_template(
                tokenizer, template, first["messages"], where, first["tools"]
            )
        _, built = self._tokenized(
            cfg, tokenizer, template, role, split, dialogues, "sft", FEATURES_VERSION
        )
        self._report(role, dialogues, built)
        return built.remove_columns(["cut"])

    def _tokenized(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        role: str,
        split: data_lib.Split,
        rows: Dataset,
        kind: str,
        version: int,
    ) -> tuple[str, Dataset]:
        """``rows`` mapped by the task's ``_tokenize`` (batched), cached on disk by the data, the
        tokenizer, the template and the task's settings; and that cache key."""
        key = data_lib.cache_key(
            role=role,
            data=split.fingerprint,
            tokenizer=data_lib.tokenizer_fingerprint(tokenizer),
            template=template,
            task=self.settings(),
            version=version,
        )

        def build() -> Dataset:
            with data_lib.map_progress(len(rows)):
                built = rows.map(
                    self._tokenize,
                    batched=True,
                    remove_columns=rows.column_names,
                    fn_kwargs={
                        "tokenizer": tokenizer,
                        "template": template,
                        "source": split.source,
                    },
                    num_proc=cfg.preprocessing_num_workers,
                    desc=f"{role}: render and tokenize ({kind})",
                )
            if len(built) == 0:  # refused here: an empty split cannot be cached
                raise DataError(self._none_kept(role, split.source, len(rows)))
            return built

        return key, data_lib.cached(data_lib.cache_root(cfg) / f"{kind}-{role}-{key}", build)

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        source: str,
    ) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "cut": []}
        names = ("messages", "tools", "prompt_turns", "text", "place")
        for messages, tools, turns, text, place in zip(*(batch[k] for k in names), strict=True):
            if text and self.text_rows == "raw":
                prompt, completion = (m["content"] for m in messages)
                whole = conversations.tokenize_text(
                    tokenizer, prompt, [completion], self.train_on_prompt
                )[0]
            else:
                self._check_has_template(template, f"{source} {place}")
                try:
                    whole = conversations.tokenize_conversation(
                        tokenizer, template, messages, self.train_on_prompt, tools, turns
                    )
                except (conversations.TemplateMismatch, conversations.RowError) as err:
                    raise conversations.refusal(err, f"{source} {place}") from None
            fitted = conversations.fit_length(whole, self.max_seq_length, self.truncation)
            if fitted is not None:
                out["input_ids"].append(fitted["input_ids"])
                out["labels"].append(fitted["labels"])
                out["cut"].append(len(fitted["input_ids"]) < len(whole["input_ids"]))
        return out

    def _check_has_template(self, template: str | None, place: str) -> None:
        if template is None:
            raise ConfigError(
                f"{place} holds messages, which need a chat template, and the tokenizer has none "
                "(task.text_rows=raw reads only plain-string rows without one); name one with "
                f"task.chat_template={'|'.join(conversations.CHAT_TEMPLATES)} or a Jinja file."
            )

    def _report(self, role: str, dialogues: Dataset, built: Dataset) -> None:
        dropped = len(dialogues) - len(built)
        cut = sum(built["cut"])
        log.info(
            "%s: %d conversations -> %d features; longer than task.max_seq_length=%d: %d "
            "truncated, %d dropped (task.truncation=%s; a truncated conversation left with no "
            "assistant token is dropped too)",
            role,
            len(dialogues),
            len(built),
            self.max_seq_length,
            cut,
            dropped,
            self.truncation,
        )

    def _none_kept(self, role: str, source: str, rows: int) -> str:
        """Why no row of a split was kept, and the fix (``rows``: how many there were)."""
        what, reply = self._row_words
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

    def _pack(self, train: Dataset) -> Dataset:
        packed = Dataset.from_dict(conversations.packed_rows(train, self.max_seq_length))
        tokens = sum(len(ids) for ids in train["input_ids"])
        log.info(
            "packing: %d conversations in %d rows of at most %d tokens (%.1f%% filled)",
            len(train),
            len(packed),
            self.max_seq_length,
            100 * tokens / max(1, len(packed) * self.max_seq_length),
        )
        return packed

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions and self.max_seq_length > positions:
            raise ConfigError(
                f"task.max_seq_length={self.max_seq_length} is longer than the model's "
                f"{positions} positions; set task.max_seq_length={positions} or less."
            )
        self._attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if self.packing and (reason := conversations.packing_unsupported_reason(self._attn)):
            raise ConfigError(
                f"task.packing=true: {reason}; use model.attn_implementation=sdpa (or eager), "
                "or task.packing=false."
            )

    def forward(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> Any:
        """The model on a batch without its labels or a KV cache. Packed rows get their
        block-diagonal mask, or under flash attention run as one row (:func:`padding_free`)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if "position_ids" in inputs and self._attn in conversations.POSITION_ID_ATTENTION:
            rows, length = inputs["input_ids"].shape
            out = model(**padding_free(inputs), use_cache=False)
            out.logits = out.logits.view(rows, length, -1)  # back to the batch's rows
            return out
        if "position_ids" in inputs:
            dtype = next(model.parameters()).dtype
            inputs["attention_mask"] = conversations.block_causal_mask(
                inputs["position_ids"], self._attn, dtype
            )
        return model(**inputs, use_cache=False)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """Summed cross-entropy of the labelled tokens, and their count: the loop normalises by
        the labelled tokens of the whole optimizer step on every process."""
        nll, count = token_losses(self.forward(model, batch).logits, batch["labels"])
        return SummedLoss(nll.sum(), count.sum())

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Any,
        data: ChatData,
        accelerator: Accelerator,
        output_dir: Path | None,
    ) -> dict[str, float]:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        for batch in loader:
            nll, count = token_losses(self.forward(model, batch).logits, batch["labels"])
            pairs = accelerator.gather_for_metrics(torch.stack([nll, count], dim=1))
            total += pairs.sum(dim=0).double()
        model.train()
        nll, count = total.tolist()
        loss = nll / max(count, 1.0)
        perplexity = float(torch.tensor(loss, dtype=torch.float64).exp().clamp(max=1e30))
        metrics = {"loss": loss, "perplexity": perplexity, "tokens": count}
        return broadcast_object_list([metrics])[0]

    # -------------------------------------------------------------------------- generation

    def after_training(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        data: ChatData,
        accelerator: Accelerator,
        output_dir: Path,
    ) -> dict[str, Any]:
        """Greedy answers to held-out prompts, in ``generations.jsonl`` and the log (batched,
        every process answering its share)."""
        if not data.prompts:
            return {}
        prompts = [
            conversations.render(tokenizer, data.template, p["messages"], True, p["tools"])
            for p in data.prompts
        ]
        greedy = GenerationConfig(batch_size=self.generation.batch_size)
        answers = generation_lib.complete(
            model,
            prompts,
            tokenizer,
            greedy,
            self.generation_max_new_tokens,
            max_length=self.max_seq_length,
            accelerator=accelerator,
        )
        model.train()
        records = [
            {"messages": p["messages"], "reference": p["reference"], "generated": answer}
            for p, answer in zip(data.prompts, answers, strict=True)
        ]
        if accelerator.is_main_process:
            write_jsonl(output_dir / "generations.jsonl", records)
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


def padding_free(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed rows as the one row flash attention reads as packed, TRL's padding-free layout.

    Flash kernels get no mask: transformers finds where conversations start from
    ``position_ids`` restarting at 0, but only in a batch of one row (``_is_packed_sequence``);
    a (2, L) batch would read as two plain sequences, and attention would cross the
    dialogues packed in each. Row padding (position 0) becomes one-token sequences with no
    label; the logits are viewed back as rows, so the loss never pairs tokens of two rows."""
    return {k: v.reshape(1, -1) for k, v in inputs.items()}


# Special tokens the named templates write (task.chat_template=<name>). A tokenizer without them
# gets them added, and the model embedding rows for them, as TRL's clone_chat_template does: else
# "<|im_end|>" is seven ordinary tokens and the model never learns one token that ends a turn.
TEMPLATE_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}


def _add_template_tokens(tokenizer: PreTrainedTokenizerBase, choice: str | None) -> list[int]:
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


def _end_of_turn(tokenizer: PreTrainedTokenizerBase, template: str | None) -> list[int]:
    """The special token that ends an assistant turn under ``template`` (the last labelled token
    of a probe conversation's reply that is not whitespace: a template's markers may wrap the
    newline after it), if it is a special token; [] otherwise, and without a template."""
    if template is None:
        return []
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    labels = conversations.tokenize_conversation(tokenizer, template, probe)["labels"]
    labelled = [t for t in labels if t != conversations.IGNORE_INDEX]
    while labelled and not tokenizer.decode(labelled[-1]).strip():
        labelled.pop()
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    return [labelled[-1]] if labelled and labelled[-1] in special else []


def _answerable(prompts: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """Held-out prompts to answer after training: none without a chat template to render them
    with (plain-text rows on a base model, task.text_rows=raw)."""
    if prompts and template is None:
        log.info("no held-out answers after training: there is no chat template to ask with")
        return []
    return prompts


def _held_out_prompts(dialogues: Dataset, count: int) -> list[dict[str, Any]]:
    """The first ``count`` evaluation conversations, cut before their last assistant turn with
    text (one that opens the conversation leaves no prompt, so that conversation is passed)."""
    prompts = []
    for row in dialogues:
        if len(prompts) >= count:
            break
        messages = row["messages"]
        texts = [(m["content"] or "").strip() if m["role"] == "assistant" else "" for m in messages]
        last = max((i for i, text in enumerate(texts) if text), default=0)
        if last:
            reference = messages[last]["content"]
            prompts.append(
                {"messages": messages[:last], "tools": row["tools"], "reference": reference}
            )
    return prompts
