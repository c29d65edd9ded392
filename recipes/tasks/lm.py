"""Language-model fine-tuning: causal (GPT-2, Llama) and masked (BERT).

What the tasks add to the shared loop: tokenizing text and packing it into ``block_size`` blocks
(no padding), the masking of a masked LM, and perplexity. Perplexity is ``exp`` of the mean loss
over every predicted token of the evaluation split, summed exactly across processes (so N
processes report what one does), not a mean of per-batch means.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerBase,
    default_data_collator,
)

from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.tasks.base import IGNORE_INDEX, Batches, Report, RunContext, Seeding, Task, TaskData
from recipes.tasks.configs.lm import ClmConfig, MlmConfig
from recipes.tasks.outputs import write_jsonl

log = get_logger(__name__)

FEATURES_VERSION = 1  # bump when feature building changes, to invalidate cached features


@dataclass
class PromptData(TaskData):
    """mode=predict: the texts to continue."""

    prompts: list[str] = field(default_factory=list)


class LanguageModeling(Task[TaskData]):
    """Text in, packed blocks out; perplexity on the evaluation split. Subclasses say how a
    block becomes inputs and labels."""

    main_metric = "perplexity"
    greater_is_better = False
    add_special_tokens = False
    args: ClmConfig | MlmConfig

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def _adds_eos(self) -> bool:
        """Whether each text ends with EOS before packing (task.add_eos_token)."""
        return False

    def _refuse_longer_than(self, positions: int | None) -> None:
        if positions and self.block_size > positions:
            raise ConfigError(
                f"task.block_size={self.block_size} is longer than the model's {positions} "
                f"positions; set task.block_size={positions} or less."
            )

    def _check_block_size(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Before any data is built, when the tokenizer knows the length (not its sentinel)."""
        limit = tokenizer.model_max_length
        self._refuse_longer_than(limit if limit < 1_000_000 else None)

    def check_model(self, model: torch.nn.Module) -> None:
        config = model.config
        self._refuse_longer_than(
            getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        )

    def _blocks(
        self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, keep_offsets: bool = False
    ) -> dict[str, Dataset]:
        """Train and eval splits as packed blocks of ``block_size`` tokens (cached on disk)."""
        self._check_block_size(tokenizer)
        column = cfg.text_column or "text"
        blocks = {}
        for role, split in data_lib.load_splits(cfg).items():
            examples = split.examples
            if column not in examples.column_names:
                raise DataError(
                    f"{role} data {split.source}: no column {column!r} (has "
                    f"{', '.join(examples.column_names)}); name the text column with "
                    "data.text_column=..."
                )
            blocks[role] = data_lib.cached_features(
                cfg,
                "lm",
                role,
                split,
                tokenizer,
                lambda role=role, split=split: self._build_blocks(
                    cfg, tokenizer, role, split, column, keep_offsets
                ),
                column=column,
                task=self.features_key(),
                offsets=keep_offsets,
                kind=type(self).__name__,
                version=FEATURES_VERSION,
            )
            log.info(
                "%s: %d texts -> %d blocks of %d tokens",
                role,
                len(examples),
                len(blocks[role]),
                self.block_size,
            )
        return blocks

    def _build_blocks(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        role: str,
        split: data_lib.Split,
        column: str,
        keep_offsets: bool,
    ) -> Dataset:
        """Drop empty texts, tokenize, and pack the tokens into blocks."""
        with data_lib.map_progress(len(split.examples)):
            texts = split.examples.select_columns([column]).filter(
                lambda batch: [bool(t) for t in batch[column]],
                batched=True,
                desc=f"{role}: drop empty texts",
            )
            tokens = texts.map(
                self._tokenize,
                batched=True,
                remove_columns=[column],
                fn_kwargs={"tokenizer": tokenizer, "column": column, "offsets": keep_offsets},
                num_proc=cfg.preprocessing_num_workers,
                desc=f"{role}: tokenize",
            )
            packed = tokens.map(
                self._pack,
                batched=True,
                batch_size=1000,
                num_proc=cfg.preprocessing_num_workers,
                desc=f"{role}: pack into {self.block_size}-token blocks",
            )
        if len(packed) == 0:
            raise DataError(
                f"{role} data {split.source}: {len(split.examples)} texts make no full "
                f"block of {self.block_size} tokens; lower task.block_size or add text."
            )
        return packed

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        column: str,
        offsets: bool,
    ) -> dict[str, list]:
        encoded = tokenizer(
            batch[column],
            add_special_tokens=self.add_special_tokens,
            return_offsets_mapping=offsets,
            return_attention_mask=True,
            verbose=False,  # texts longer than the model are cut into blocks, not fed whole
        )
        encoded = dict(encoded)
        if self._adds_eos() and tokenizer.eos_token_id is not None:
            encoded["input_ids"] = [[*ids, tokenizer.eos_token_id] for ids in encoded["input_ids"]]
            encoded["attention_mask"] = [[*mask, 1] for mask in encoded["attention_mask"]]
        return encoded

    def _pack(self, batch: Mapping[str, list]) -> dict[str, list]:
        """Concatenate the texts of the batch and cut them into full blocks (the tail that does
        not fill a block is dropped, as in the Hugging Face examples)."""
        joined = {k: list(chain.from_iterable(v)) for k, v in batch.items()}
        usable = (len(joined["input_ids"]) // self.block_size) * self.block_size
        return {
            k: [v[i : i + self.block_size] for i in range(0, usable, self.block_size)]
            for k, v in joined.items()
        }

    # ----------------------------------------------------------------------------- evaluation

    @abc.abstractmethod
    def _token_losses(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence: the summed cross-entropy of its predicted tokens, and their count."""

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        nll, count = self._token_losses(model, batch)
        return {"nll": nll, "count": count}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: TaskData, run: RunContext
    ) -> dict[str, float]:
        """Loss and perplexity over every predicted token of the split (sums, not a mean of
        per-batch means)."""
        nll, count = rows["nll"].double().sum().item(), rows["count"].double().sum().item()
        loss = nll / max(count, 1.0)
        return {"loss": loss, "perplexity": _perplexity(loss), "tokens": count}


def _perplexity(loss: float) -> float:
    return float(torch.tensor(loss, dtype=torch.float64).exp().clamp(max=1e30))


def _sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    losses = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    return losses.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1).float()


class CausalLanguageModeling(LanguageModeling):
    """Next-token prediction on packed blocks (``task=clm``).

    Args:
        block_size: tokens per training sequence.
        add_eos_token: end each text with the end-of-text token before packing (useful when the
            texts are separate documents; off for line-by-line text such as a play).
        sample_prompt: after training, greedily continue this prompt and log the result
            (null: no sample).
        sample_max_new_tokens: length of that continuation.
    """

    auto_model_class = AutoModelForCausalLM
    args: ClmConfig

    def _adds_eos(self) -> bool:
        return self.args.add_eos_token

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TaskData:
        blocks = self._blocks(cfg, tokenizer)
        return TaskData(
            train=blocks["train"],
            eval=blocks["eval"],
            train_collator=default_data_collator,
            eval_collator=default_data_collator,
        )

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model shifts the labels itself: position t predicts token t + 1. No KV cache:
        a training forward would build one on the device for nothing."""
        return model(**batch, labels=batch["input_ids"], use_cache=False).loss

    def _token_losses(self, model, batch):
        logits = model(**batch, use_cache=False).logits[:, :-1]
        labels = batch["input_ids"][:, 1:].masked_fill(
            batch["attention_mask"][:, 1:] == 0, IGNORE_INDEX
        )
        return _sequence_nll(logits, labels)

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PromptData:
        """The texts of ``data.predict_file`` (a text file's lines, or the ``text`` column,
        ``data.text_column``, of JSON lines / CSV / parquet) as prompts to continue; blank
        texts are passed over."""
        split = data_lib.load_predict_file(cfg)
        column = cfg.text_column or "text"
        if column not in split.examples.column_names:
            raise DataError(
                f"data.predict_file={split.source}: no {column!r} column (it has "
                f"{', '.join(split.examples.column_names)}); name it with data.text_column=..."
            )
        texts = split.examples[column]
        wrong = [n for n, text in enumerate(texts) if not isinstance(text, str)]
        if wrong:
            raise DataError(
                f"data.predict_file={split.source}: {len(wrong)} row(s) hold no text in "
                f"{column!r} (rows {', '.join(map(str, wrong[:3]))}); fix or remove them."
            )
        prompts = [text for text in texts if text.strip()]
        if len(prompts) < len(texts):
            log.info("predict: %d blank texts passed over", len(texts) - len(prompts))
        empty = Dataset.from_dict({"input_ids": []})
        return PromptData(train=empty, eval=empty, prompts=prompts)

    def predict(
        self, model: nn.Module, loader: Batches, data: PromptData, run: RunContext
    ) -> Report:
        """``generations.jsonl``: each prompt and its continuation (greedy, or sampled with
        ``generation.do_sample``), prompt and continuation within ``block_size`` tokens."""
        tokenizer, generation = run.tokenizer, run.generation
        answers = generation_lib.complete(
            model,
            [tokenizer(text)["input_ids"] for text in data.prompts],
            tokenizer,
            generation,
            generation.max_new_tokens or self.args.sample_max_new_tokens,
            max_length=self.block_size,
            accelerator=run.accelerator,
        )
        if run.accelerator.is_main_process:
            records = (
                {"prompt": prompt, "generated": answer}
                for prompt, answer in zip(data.prompts, answers, strict=True)
            )
            write_jsonl(run.output_dir / "generations.jsonl", records)
        return {"rows": len(answers), "file": "generations.jsonl"}

    def after_training(
        self, model: torch.nn.Module, data: TaskData, run: RunContext
    ) -> dict[str, Any]:
        """A greedy continuation of ``sample_prompt``, so a person sees what the model learnt."""
        if not self.args.sample_prompt:
            return {}
        tokenizer = run.tokenizer
        ids = tokenizer(self.args.sample_prompt)["input_ids"]
        (continuation,) = generation_lib.complete_ids(
            model,
            [ids],
            tokenizer,
            generation_lib.on_engine(GenerationConfig(), run.generation),
            self.args.sample_max_new_tokens,
            accelerator=run.accelerator,
        )
        text = tokenizer.decode(ids + continuation, skip_special_tokens=True)
        log.info("greedy sample after training:\n%s", text)
        if run.accelerator.is_main_process:
            (run.output_dir / "sample.txt").write_text(text + "\n", encoding="utf-8")
        return {"sample/text": text}


class MaskedLanguageModeling(LanguageModeling):
    """Masked-token prediction on packed blocks (``task=mlm``), BERT's recipe.

    Args:
        block_size: tokens per training sequence.
        mlm_probability: share of tokens chosen for prediction; of those 80 % become [MASK],
            10 % a random token and 10 % stay as they are.
        whole_word_mask: choose whole words rather than single word pieces (each chosen word
            becomes [MASK]; transformers cannot swap in random words then).
        eval_mask_seed: the evaluation split is masked once, with this seed, so every
            evaluation (and every process count) scores the same positions.
    """

    auto_model_class = AutoModelForMaskedLM
    add_special_tokens = True
    args: MlmConfig

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TaskData:
        if tokenizer.mask_token is None:
            raise ConfigError(
                f"model.name_or_path: the tokenizer of {tokenizer.name_or_path} has no mask "
                "token, so it cannot be trained as a masked LM; use a BERT-style model."
            )
        collator, needs_offsets = _masking_collator(
            tokenizer, self.args.mlm_probability, self.args.whole_word_mask
        )
        blocks = self._blocks(cfg, tokenizer, keep_offsets=needs_offsets)
        rows = len(blocks["eval"])
        with torch.random.fork_rng(devices=[]), data_lib.map_progress(rows):
            torch.manual_seed(self.args.eval_mask_seed)
            masked_eval = blocks["eval"].map(
                lambda batch: _mask_batch(collator, batch),
                batched=True,
                batch_size=256,
                remove_columns=[c for c in ("offset_mapping",) if c in blocks["eval"].column_names],
                desc="mask evaluation blocks",
                keep_in_memory=True,  # small, and no cache file for ranks to race on
                new_fingerprint=f"{blocks['eval']._fingerprint}-masked-{self.args.eval_mask_seed}",
            )
        return TaskData(
            train=blocks["train"],
            eval=masked_eval,
            train_collator=collator,
            eval_collator=default_data_collator,
            seeding=Seeding.batch,
        )

    def _token_losses(self, model, batch):
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return _sequence_nll(logits, batch["labels"])


def _masking_collator(
    tokenizer: PreTrainedTokenizerBase, probability: float, whole_word: bool
) -> tuple[Callable[[list[dict]], dict], bool]:
    """transformers' MLM collator; returns it and whether it needs offset mappings.

    transformers >= 4.56 masks whole words from the offset mappings; older releases have a
    separate collator that recognises BERT's ``##`` word pieces.
    """
    if (
        whole_word
        and "whole_word_mask" not in inspect.signature(DataCollatorForLanguageModeling).parameters
    ):
        from transformers import DataCollatorForWholeWordMask

        return DataCollatorForWholeWordMask(tokenizer, mlm_probability=probability), False
    # transformers replaces every chosen word with [MASK] under whole-word masking (it cannot
    # swap in random words); saying so up front also avoids 4.57's broken warning on that path.
    extra = (
        {"whole_word_mask": True, "mask_replace_prob": 1.0, "random_replace_prob": 0.0}
        if whole_word
        else {}
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=probability, **extra)
    return collator, whole_word


def _mask_batch(collator: Callable, batch: Mapping[str, list]) -> dict[str, list]:
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    masked = collator(rows)
    return {k: v.tolist() for k, v in masked.items()}
