"""A reward model on preference pairs (``task=reward_model``), as TRL 1.16's RewardTrainer.

What the task adds to the shared loop, from the shared chat parts
(:mod:`recipes.tasks.chat.preference` reads the pairs, :class:`ChatFeatures` renders and tokenizes
both sides as DPO does):

* the model: ``AutoModelForSequenceClassification`` with one output (``num_labels=1``) and the
  tokenizer's pad token in its config (the reward is read at the last token that is not
  padding); under LoRA its ``score`` head trains in full (peft's ``modules_to_save``);
* each side is the whole conversation, prompt then completion, rendered with the chat template
  (TRL's conversational rows), or TRL's plain text plus EOS (``text_rows=raw``); a pair with a
  side longer than ``max_seq_length`` is left out (``truncation=drop``, TRL's filter);
* the loss per pair (:mod:`recipes.losses.reward`), TRL's ``compute_loss``:
  ``-logsigmoid(r_chosen - r_rejected - margin)`` (``margin``: the row's optional column, 0
  without one), plus
  ``center_rewards_coefficient * (r_chosen + r_rejected)^2`` when set; the mean over pairs is
  TRL's loss;
* TRL's metrics: ``accuracy`` (the share of pairs whose chosen side scores higher: the main
  metric), ``margin`` (r_chosen - r_rejected), ``mean_reward``; evaluation adds ``min_reward`` /
  ``max_reward``. TRL averages per-batch means; here every mean is over pairs (equal for equal
  batches);
* ``mode=predict``: a file of pairs gets each row's ``chosen_reward`` and ``rejected_reward``, a
  file of conversations (any layout SFT reads) a ``reward`` per conversation.

Each pair is one loss term (:class:`SummedLoss`): accumulation and process counts give the
full batch's mean.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import DataConfig
from recipes.data import DataError
from recipes.evaluation import gather_rows
from recipes.log import get_logger
from recipes.losses.reward import STATS, bradley_terry_loss
from recipes.tasks import chat
from recipes.tasks.base import Averaging, LossShape, RunContext, SummedLoss, Task, TaskData
from recipes.tasks.chat import ChatFeatures
from recipes.tasks.configs.reward_model import RewardModelConfig
from recipes.tasks.outputs import row_ids, write_predictions

log = get_logger(__name__)

FEATURES_VERSION = 2
SIDES = ("chosen", "rejected")
# STATS: TRL's training metrics (RewardTrainer.compute_loss), summed per pair beside the loss.


@dataclass
class RewardData(TaskData):
    """Pairs' features (``chosen_input_ids``, ``rejected_input_ids``, ``margin``), the pad id the
    model reads rewards by; in mode=predict, whether the rows are pairs or single texts, and
    their ids."""

    pad_token_id: int | None = None
    pairs: bool = True
    row_ids: list[Any] | None = None


class RewardModel(Task[RewardData]):
    """A reward model (``task=reward_model``); its settings:
    :class:`recipes.tasks.configs.reward_model.RewardModelConfig`."""

    auto_model_class = AutoModelForSequenceClassification
    main_metric = "accuracy"
    greater_is_better = True
    args: RewardModelConfig

    def __init__(self, args: RewardModelConfig) -> None:
        super().__init__(args)
        # It answers no prompt: no answer length.
        self.chat = ChatFeatures.of(
            args, "reward_model", FEATURES_VERSION, ("pair", "both its replies"), max_new_tokens=0
        )

    def loss_shape(self) -> LossShape:
        """One summed term per pair, TRL's metrics summed beside it."""
        return LossShape(Averaging.sum, terms_per_example=1, stats=STATS)

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> RewardData:
        pairs = self.chat.read_splits(
            cfg,
            tokenizer,
            chat.preference.read_pairs,
            chat.preference.normalise,
            self._tokenize,
            lambda rows, source, template: _check_margins(rows, source),
        )
        features = pairs.features
        for role, built in features.items():
            self.chat.report_pairs(role, pairs.rows[role], built)
        collator = PairCollator(tokenizer.pad_token_id)
        return RewardData(
            train=features["train"],
            eval=features["eval"],
            train_collator=collator,
            eval_collator=collator,
            max_length=self.args.max_seq_length,
            new_tokens=pairs.template.new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        source: str,
        features: ChatFeatures | None = None,
    ) -> dict[str, list]:
        features = features or self.chat
        out: dict[str, list] = {"chosen_input_ids": [], "rejected_input_ids": [], "margin": []}
        out["length"] = []
        for values in zip(*(batch[k] for k in chat.preference.COLUMNS), strict=True):
            pair = dict(zip(chat.preference.COLUMNS, values, strict=True))
            sides = features.pair_sides(tokenizer, template, pair, f"{source} {pair['place']}")
            if sides is None:
                continue
            for side, fitted in zip(SIDES, sides, strict=True):
                out[f"{side}_input_ids"].append(fitted["input_ids"])
            out["margin"].append(pair["margin"] or 0.0)
            out["length"].append(max(len(s["input_ids"]) for s in sides))
        return out

    # ------------------------------------------------------------------------------ model

    def model_kwargs(self, data: RewardData) -> dict[str, Any]:
        """One output, the reward; the tokenizer's pad token, past which no reward is read."""
        return {"num_labels": 1, "pad_token_id": data.pad_token_id}

    def check_model(self, model: torch.nn.Module) -> None:
        self.chat.check_model(model)

    def before_training(
        self, model: torch.nn.Module, data: RewardData, run: RunContext, batch_size: int
    ) -> None:
        if self.args.disable_dropout:
            chat.reference.disable_dropout(run.accelerator.unwrap_model(model))

    # ------------------------------------------------------------------------------- loss

    def _batch_losses(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per pair: TRL's loss and metrics (:func:`recipes.losses.bradley_terry_loss`), and
        the (pairs, 2) rewards of chosen and rejected."""
        rewards = pair_rewards(model, batch)
        margin = batch["margin"].to(rewards.dtype)
        losses, stats = bradley_terry_loss(rewards, margin, self.args.center_rewards_coefficient)
        return losses, stats, rewards

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The pairs' summed loss and their count; TRL's metrics summed over them."""
        losses, stats, _ = self._batch_losses(model, batch)
        count = losses.new_full((), float(len(losses)))
        return SummedLoss(losses.sum(), count, dict(zip(STATS, stats.sum(0), strict=True)))

    # ------------------------------------------------------------------------ evaluation

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        losses, stats, rewards = self._batch_losses(model, batch)
        return {"loss": losses, "stats": stats, "rewards": rewards.detach()}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: RewardData, run: RunContext
    ) -> dict[str, float]:
        """The mean loss and TRL's metrics over the held-out pairs."""
        pairs = max(float(len(rows["loss"])), 1.0)
        means = (rows["stats"].double().sum(0) / pairs).tolist()
        rewards = rows["rewards"].double()
        return {
            "loss": rows["loss"].double().sum().item() / pairs,
            "pairs": float(len(rows["loss"])),
            **dict(zip(STATS, means, strict=True)),
            "min_reward": rewards.min().item(),
            "max_reward": rewards.max().item(),
        }

    # ----------------------------------------------------------------------------- predict

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> RewardData:
        """The rows of ``data.predict_file``: preference pairs (both sides scored), or else
        conversations (each scored whole); a side longer than ``max_seq_length`` is cut at its
        end (every row gets its reward, a prompt that fills the length too)."""
        template = self.chat.use_template(tokenizer).template
        fmt = self.args.format
        split = data_lib.load_predict_file(cfg, lambda path: _read_predict_rows(path, fmt))
        # Every row is read whole here and cut below: a prompt that fills the length still
        # gets a reward.
        features = dataclasses.replace(self.chat, max_seq_length=sys.maxsize)
        pairs = tuple(split.examples.column_names) == chat.preference.COLUMNS or (
            tuple(split.examples.column_names) != chat.COLUMNS
            and chat.preference.detect_format(split.examples[0]) is not None
        )
        if pairs:
            rows = chat.preference.normalise(split.examples, fmt, split.source)
            tokenize = self._tokenize
        else:
            rows = chat.normalise(split.examples, "auto", split.source)
            tokenize = _tokenize_conversations
        whole = functools.partial(tokenize, features=features)
        built = chat.tokenize_rows(rows, whole, tokenizer, template, split.source)
        built = _cut(built, self.args.max_seq_length)
        collator = PairCollator(tokenizer.pad_token_id, pairs)
        return RewardData(
            train=built.select([]),
            eval=built,
            eval_collator=collator,
            pad_token_id=tokenizer.pad_token_id,
            pairs=pairs,
            row_ids=row_ids(split.examples),
        )

    def predict(
        self, model: torch.nn.Module, loader: Any, data: RewardData, run: RunContext
    ) -> dict[str, Any]:
        """``predictions.jsonl``: per row its id and ``chosen_reward`` / ``rejected_reward``
        (pairs) or ``reward`` (conversations)."""
        run.accelerator.unwrap_model(model).config.pad_token_id = data.pad_token_id
        step = pair_rewards if data.pairs else text_rewards
        rows = gather_rows(lambda m, b: {"rewards": step(m, b)}, model, loader, run.accelerator)
        records = (
            None
            if rows is None
            else (
                {"id": row, "chosen_reward": value[0], "rejected_reward": value[1]}
                if data.pairs
                else {"id": row, "reward": value}
                for row, value in zip(data.row_ids or [], rows["rewards"].tolist(), strict=True)
            )
        )
        return write_predictions(run, len(data.eval), records)


def text_rewards(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's reward of each row of a padded batch, (rows,), in float32."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    return model(**inputs, use_cache=False).logits[:, 0].float()


def pair_rewards(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(pairs, 2) rewards of a :class:`PairCollator` batch (chosen rows, then rejected rows):
    one forward for both sides, as TRL."""
    return torch.stack(text_rewards(model, batch).chunk(2), dim=1)


class PairCollator:
    """Pads a batch of pairs as TRL's DataCollatorForPreference: the chosen rows, then the
    rejected rows, padded on the right (to the longest, or with ``padding="max_length"`` to
    ``max_length``), with ``attention_mask`` and ``margin`` (pairs,); (``pairs=False``) single
    texts alone."""

    def __init__(self, pad_token_id: int, pairs: bool = True) -> None:
        self.pad_token_id = pad_token_id
        self.pairs = pairs
        self.pad_to_multiple_of: int | None = None  # the loop sets trainer.pad_to_multiple_of
        # trainer.padding=max_length: every batch padded to max_length (one shape per run).
        self.padding: str = "longest"
        self.max_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.pairs:
            rows = [{"input_ids": e[f"{side}_input_ids"]} for side in SIDES for e in examples]
        else:
            rows = [{"input_ids": e["input_ids"]} for e in examples]
        longest = chat.padded_length(rows, self.pad_to_multiple_of)
        if self.padding == "max_length" and self.max_length:
            longest = max(longest, self.max_length)
        batch = {
            "input_ids": chat.pad_rows(rows, "input_ids", self.pad_token_id, longest),
            "attention_mask": chat.attention_mask(rows, longest),
        }
        if self.pairs:
            batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float32)
        return batch


def _cut(rows: Dataset, limit: int) -> Dataset:
    """``rows``' token columns cut at their end to ``limit`` tokens, the cut rows counted in
    the log."""
    columns = [c for c in rows.column_names if c.endswith("input_ids")]
    cut = sum(any(len(r[c]) > limit for c in columns) for r in rows)
    if not cut:
        return rows
    log.info(
        "%d of %d row(s) longer than task.max_seq_length=%d: cut at their end",
        cut,
        len(rows),
        limit,
    )
    return rows.map(lambda r: {c: r[c][:limit] for c in columns})


def _check_margins(pairs: Dataset, source: str) -> None:
    """Margins are all given or all absent (TRL reads the column of every row or of none)."""
    given = [m is not None for m in pairs["margin"]]
    if any(given) and not all(given):
        missing = pairs[given.index(False)]["place"]
        raise DataError(
            f"{source}: {given.count(False)} pair(s) have no 'margin' where others have one "
            f"(first: {missing}); give every pair a margin (0 for none), or none."
        )


def _read_predict_rows(path: Path, fmt: str) -> Dataset | None:
    """A predict file as pairs, or, where its rows are no pairs, as conversations."""
    try:
        return chat.preference.read_pairs(path, fmt)
    except DataError:
        return chat.read_conversations(path, "auto")


def _tokenize_conversations(
    batch: Mapping[str, list],
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    source: str,
    features: ChatFeatures,
) -> dict[str, list]:
    """Each conversation rendered whole with the template and fitted (mode=predict)."""
    out: dict[str, list] = {"input_ids": []}
    for messages, tools, place in zip(
        batch["messages"], batch["tools"], batch["place"], strict=True
    ):
        try:
            whole = chat.tokenize_conversation(
                tokenizer, template, messages, train_on_prompt=True, tools=tools
            )
        except (chat.TemplateMismatch, chat.RowError) as err:
            raise chat.refusal(err, f"{source} {place}") from None
        fitted = features.fit(whole)
        if fitted is not None:
            out["input_ids"].append(fitted["input_ids"])
    return out
