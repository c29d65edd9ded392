"""Supervised fine-tuning of a causal LM on conversations (``task=sft``).

What the task adds to the shared loop: conversations read in the common layouts and rendered
with a chat template (:mod:`recipes.tasks.chat`), loss on the assistant's tokens only, a
length policy, optional packing without cross-talk between the packed conversations, and after
training greedy answers to a few held-out prompts. Evaluation is the loss and perplexity of the
held-out conversations' labelled tokens (the assistant's), summed exactly across processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from recipes import moe
from recipes.config import DataConfig
from recipes.log import get_logger
from recipes.tasks import chat
from recipes.tasks.base import Averaging, LossShape, RunContext, SummedLoss, Task
from recipes.tasks.chat import ChatData, ChatFeatures, PromptAnswers, token_losses
from recipes.tasks.configs.sft import SftConfig

log = get_logger(__name__)

FEATURES_VERSION = 4  # bump when feature building changes, to invalidate cached features


class SupervisedFineTuning(Task[ChatData]):
    """Chat SFT (``task=sft``); its settings: :class:`recipes.tasks.configs.sft.SftConfig`."""

    auto_model_class = AutoModelForCausalLM
    # Its losses read the logits a chunk at a time (trainer.fused_linear_loss).
    fused_linear_loss = True
    args: SftConfig

    def __init__(self, args: SftConfig) -> None:
        super().__init__(args)
        self.chat = ChatFeatures.of(
            args, "sft", FEATURES_VERSION, ("conversation", "its assistant turns")
        )
        self.predictor = PromptAnswers(self.chat, args.format)
        self.conversations = Conversations(self.chat, args)

    def loss_shape(self) -> LossShape:
        """Summed over labelled tokens (at most ``max_seq_length`` per conversation)."""
        return LossShape(Averaging.sum, terms_per_example=self.args.max_seq_length)

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChatData:
        return self.conversations.build(cfg, tokenizer)

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        self.chat.check_model(model, packing=self.args.packing)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """Summed cross-entropy of the labelled tokens, and their count: the loop normalises by
        the labelled tokens of the whole optimizer step on every process."""
        with moe.router_loss(model) as router:
            nll, count = token_losses(
                chat.forward(model, batch, lazy_head=True).logits, batch["labels"]
            )
        return router.added(SummedLoss(nll.sum(), count.sum()))

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        nll, count = token_losses(
            chat.forward(model, batch, lazy_head=True).logits, batch["labels"]
        )
        return {"nll": nll, "count": count}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: ChatData, run: RunContext
    ) -> dict[str, float]:
        """Loss and perplexity over every labelled token of the held-out conversations (sums,
        not a mean of per-batch means)."""
        nll, count = rows["nll"].double().sum().item(), rows["count"].double().sum().item()
        loss = nll / max(count, 1.0)
        perplexity = float(torch.tensor(loss, dtype=torch.float64).exp().clamp(max=1e30))
        return {"loss": loss, "perplexity": perplexity, "tokens": count}

    def after_training(
        self, model: torch.nn.Module, data: ChatData, run: RunContext
    ) -> dict[str, Any]:
        """Greedy answers to held-out prompts (:func:`chat.answer_held_out`)."""
        return self.chat.answer_held_out(model, data, run)


@dataclass(frozen=True)
class Conversations:
    """SFT's feature builder: conversations read in any layout (``args.format``), rendered with
    the template, labelled, fitted to ``max_seq_length`` and cached (``chat``), packed with
    ``args.packing``; GKD builds its rows with it too. ``args``: SFT's settings."""

    chat: ChatFeatures
    args: SftConfig

    def build(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChatData:
        """Both splits' features, the collator, and the held-out prompts."""
        dialogues = self.chat.read_splits(
            cfg,
            tokenizer,
            chat.read_conversations,
            chat.normalise,
            self._tokenize,
            lambda rows, source, template: _check_first(
                tokenizer, template, rows, source, self.args
            ),
        )
        features = {}
        for role, built in dialogues.features.items():
            self._report(role, dialogues.rows[role], built)
            features[role] = built.remove_columns(["cut"])
        train = features["train"]
        if self.args.packing:
            train = self._pack(train)
        collator = chat.ChatCollator(tokenizer.pad_token_id)
        held_out = held_out_prompts(dialogues.rows["eval"], self.args.num_generations)
        return ChatData(
            train=train,
            eval=features["eval"],
            train_collator=collator,
            eval_collator=collator,
            max_length=self.args.max_seq_length,
            **dialogues.template.data_fields(held_out),
        )

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        source: str,
    ) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "cut": []}
        on_prompt = self.args.train_on_prompt
        names = ("messages", "tools", "prompt_turns", "text", "place")
        for messages, tools, turns, text, place in zip(*(batch[k] for k in names), strict=True):
            if text and self.args.text_rows == "raw":
                prompt, completion = (m["content"] for m in messages)
                whole = chat.tokenize_text(tokenizer, prompt, [completion], on_prompt)[0]
            else:
                chat.require_template(template, f"{source} {place}")
                try:
                    whole = chat.tokenize_conversation(
                        tokenizer, template, messages, on_prompt, tools, turns
                    )
                except (chat.TemplateMismatch, chat.RowError) as err:
                    raise chat.refusal(err, f"{source} {place}") from None
            fitted = self.chat.fit(whole)
            if fitted is not None:
                out["input_ids"].append(fitted["input_ids"])
                out["labels"].append(fitted["labels"])
                out["cut"].append(len(fitted["input_ids"]) < len(whole["input_ids"]))
        return out

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
            self.args.max_seq_length,
            cut,
            dropped,
            self.args.truncation,
        )

    def _pack(self, train: Dataset) -> Dataset:
        capacity = self.args.max_seq_length
        packed = Dataset.from_dict(chat.packed_rows(train, capacity))
        tokens = sum(len(ids) for ids in train["input_ids"])
        log.info(
            "packing: %d conversations in %d rows of at most %d tokens (%.1f%% filled)",
            len(train),
            len(packed),
            capacity,
            100 * tokens / max(1, len(packed) * capacity),
        )
        return packed


def _check_first(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    dialogues: Dataset,
    source: str,
    args: SftConfig,
) -> None:
    """Refuse a missing template, or one that cannot render the split's first conversation,
    in one line before any row is tokenized (a raw text row needs none)."""
    first = dialogues[0]
    if not (first["text"] and args.text_rows == "raw"):
        where = f"{source} {first['place']}"
        chat.require_template(template, where)
        chat.check_template(tokenizer, template, first["messages"], where, first["tools"])


def held_out_prompts(dialogues: Iterable[Mapping[str, Any]], count: int) -> list[dict[str, Any]]:
    """The first ``count`` evaluation conversations, cut before their last assistant turn with
    text (one that opens the conversation leaves no prompt, so that conversation is passed)."""
    return chat.held_out_prompts(dialogues, count, _before_last_reply)


def _before_last_reply(row: Mapping[str, Any]) -> tuple[list, str] | None:
    messages = row["messages"]
    texts = [(m["content"] or "").strip() if m["role"] == "assistant" else "" for m in messages]
    last = max((i for i, text in enumerate(texts) if text), default=0)
    return (messages[:last], messages[last]["content"]) if last else None
