"""Sequence to sequence: summarization, translation, generative QA (``task=seq2seq``).

What the task adds to the shared loop, as run_summarization / run_translation / run_seq2seq_qa
do it: a source and a target text per row (``data.source_column`` / ``data.target_column``; a
dotted name reads a field of a dict column, ``translation.en``; SQuAD data becomes "question: ...
context: ..." with its first answer as the target), ``data.source_prefix`` before every source,
separate source and target lengths, labels padded with -100 (the model builds its
``decoder_input_ids`` from them), and evaluation by batched generation (KV cache, on every
process, ``generation.*``) scored with ROUGE (summarization), sacreBLEU (translation) or SQuAD
EM / F1 (QA), plus the eval loss and the mean generated length. The decoding the evaluation used
is written into the model's generation config, so ``final/`` reproduces it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from datasets import Dataset
from torch import nn
from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerBase
from transformers.modeling_outputs import BaseModelOutput

from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes import tracking
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.metrics.seq2seq import bleu_scores, rouge_scores
from recipes.metrics.squad import squad_v1
from recipes.tasks.base import (
    IGNORE_INDEX,
    Averaging,
    Batches,
    LossShape,
    Metrics,
    Report,
    RunContext,
    SummedLoss,
    Task,
    TaskData,
)
from recipes.tasks.configs.seq2seq import METRICS, Seq2SeqConfig
from recipes.tasks.outputs import row_ids, write_jsonl, write_predictions
from recipes.tasks.qa_examples import check_examples, read_squad_json

log = get_logger(__name__)

FEATURES_VERSION = 1  # bump when feature building changes, to invalidate cached features
TIE_METRICS = {"rouge": "loss", "bleu": "chrf", "squad": "exact_match"}
# The decoding settings final/generation_config.json carries (generation.* names them alike).
DECODING = ("max_new_tokens", "do_sample", "num_beams", "length_penalty", "temperature", "top_p")
MAX_REPORTED = 5
_MISSING = object()  # a dotted field a row lacks (already reported)


@dataclass
class Seq2SeqData(TaskData):
    """Features plus, per evaluation row (its ``row`` feature), the reference texts it is scored
    against and its id."""

    references: list[list[str]] = field(default_factory=list)
    row_ids: list[Any] = field(default_factory=list)


class Seq2SeqCollator:
    """Pads ``input_ids`` / ``attention_mask`` on the right with the pad id and ``labels`` with
    -100 (DataCollatorForSeq2Seq's padding; the model shifts labels into decoder inputs);
    ``row`` (evaluation rows' numbers) passes through. With ``padding="max_length"`` sources
    are padded to ``max_length`` (trainer.padding=max_length); targets keep their own length."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding: str = "longest"
        self.max_length: int | None = None

    def _width(self, rows: list[list[int]], at_least: int = 0) -> int:
        width = max(at_least, *(len(r) for r in rows))
        multiple = self.pad_to_multiple_of
        return -(-width // multiple) * multiple if multiple else width

    def _pad(self, rows: list[list[int]], value: int, at_least: int = 0) -> torch.Tensor:
        width = self._width(rows, at_least)
        return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [f["input_ids"] for f in features]
        fixed = (self.max_length or 0) if self.padding == "max_length" else 0
        batch = {
            "input_ids": self._pad(ids, self.pad_token_id, fixed),
            "attention_mask": self._pad([[1] * len(r) for r in ids], 0, fixed),
        }
        if "labels" in features[0]:
            batch["labels"] = self._pad([f["labels"] for f in features], IGNORE_INDEX)
        if "row" in features[0]:
            batch["row"] = torch.tensor([f["row"] for f in features], dtype=torch.long)
        return batch


class SequenceToSequence(Task[Seq2SeqData]):
    """Encoder-decoder fine-tuning scored by generation (``task=seq2seq``; settings in
    :class:`Seq2SeqConfig`, decoding in the run's ``generation.*``)."""

    auto_model_class = AutoModelForSeq2SeqLM
    args: Seq2SeqConfig
    greater_is_better = True

    @property
    def main_metric(self) -> str:
        return METRICS[self.args.metric]

    @property
    def tie_metric(self) -> str:
        """What decides when the main metric ties: chrF for BLEU (a short run's BLEU stays 0
        while chrF moves), exact match for SQuAD's F1, the loss for ROUGE."""
        return TIE_METRICS[self.args.metric]

    @property
    def tie_greater_is_better(self) -> bool:
        return self.tie_metric != "loss"

    def loss_shape(self) -> LossShape:
        """Summed target-token cross-entropy (:meth:`loss`); a row adds at most
        ``max_target_length`` terms."""
        return LossShape(Averaging.sum, terms_per_example=self.args.max_target_length)

    @property
    def _eval_target_length(self) -> int:
        return self.args.eval_max_target_length or self.args.max_target_length

    # ------------------------------------------------------------------------------- data

    def _squad_layout(self, cfg: DataConfig) -> bool:
        return self.args.metric == "squad" and cfg.source_column is None

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Seq2SeqData:
        _check_tokenizer(tokenizer)
        squad = self._squad_layout(cfg)
        splits = data_lib.load_splits(cfg, reader=read_squad_json if squad else None)
        texts = {}
        for role, split in splits.items():
            if squad:
                check_examples(split.examples, f"{role} data {split.source}", False)
                texts[role] = _squad_texts(split.examples, cfg.source_prefix)
            else:
                texts[role] = _column_texts(cfg, split, role)
        log.info(
            "seq2seq on %s; source prefix %r; %d train / %d eval rows; scored by %s",
            "SQuAD question + context -> first answer"
            if squad
            else f"{cfg.source_column} -> {cfg.target_column}",
            cfg.source_prefix,
            len(texts["train"][0]),
            len(texts["eval"][0]),
            self.args.metric,
        )
        train = self._features(cfg, tokenizer, "train", splits["train"], texts["train"])
        eval_ = self._features(cfg, tokenizer, "eval", splits["eval"], texts["eval"])
        # Longest sources first: each generated batch holds sources of similar lengths.
        order = np.argsort(-data_lib.feature_lengths(eval_), kind="stable")
        collator = Seq2SeqCollator(tokenizer.pad_token_id)
        return Seq2SeqData(
            train=train.remove_columns("row"),
            eval=eval_.select(order),
            train_collator=collator,
            eval_collator=collator,
            max_length=self.args.max_source_length,
            references=texts["eval"][2],
            row_ids=texts["eval"][3],
        )

    def _features(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        role: str,
        split: data_lib.Split,
        texts: tuple[list[str], list[str] | None, Any, Any],
    ) -> Dataset:
        sources, targets = texts[0], texts[1]
        target_length = self.args.max_target_length if role == "train" else self._eval_target_length

        def build() -> Dataset:
            return _tokenized(
                tokenizer,
                sources,
                targets,
                self.args.max_source_length,
                target_length,
                role,
                cfg.preprocessing_num_workers,
            )

        built = data_lib.cached_features(
            cfg,
            "s2s",
            role,
            split,
            tokenizer,
            build,
            columns=(cfg.source_column, cfg.target_column, cfg.source_prefix, self.args.metric),
            task=self.features_key(),
            version=FEATURES_VERSION,
        )
        cut = int((data_lib.feature_lengths(built) >= self.args.max_source_length).sum())
        if cut:
            log.warning(
                "%s: %d of %d sources reach task.max_source_length=%d tokens (cut there)",
                role,
                cut,
                len(built),
                self.args.max_source_length,
            )
        return built

    def build_predict_data(
        self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase
    ) -> Seq2SeqData:
        """The sources of ``data.predict_file`` (the source column, or SQuAD's question and
        context; no target needed)."""
        _check_tokenizer(tokenizer)
        squad = self._squad_layout(cfg)
        reader = (lambda path: read_squad_json(path, answers_required=False)) if squad else None
        split = data_lib.load_predict_file(cfg, reader=reader)
        if squad:
            sources, _, _, ids = _squad_texts(split.examples, cfg.source_prefix, labelled=False)
        else:
            sources, _, _, ids = _column_texts(cfg, split, "predict", labelled=False)
        features = _tokenized(tokenizer, sources, None, self.args.max_source_length, 0, "predict")
        return Seq2SeqData(
            train=features.select([]),
            eval=features,
            eval_collator=Seq2SeqCollator(tokenizer.pad_token_id),
            max_length=self.args.max_source_length,
            row_ids=ids,
        )

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        config = model.config
        if not getattr(config, "is_encoder_decoder", False):
            raise ConfigError(
                f"model.name_or_path: {type(model).__name__} is not an encoder-decoder model; "
                "task=seq2seq trains T5 / BART / EncoderDecoderModel-style models."
            )
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(model.generation_config, "decoder_start_token_id", None)
        if start is None:
            raise ConfigError(
                f"model.name_or_path: {type(model).__name__}'s config has no "
                "decoder_start_token_id, which builds the decoder inputs from the labels; set "
                "model.config_overrides.decoder_start_token_id=<id> (a BERT-based "
                "EncoderDecoderModel: the [CLS] id)."
            )
        encoder = getattr(config, "encoder", None)
        positions = getattr(encoder or config, "max_position_embeddings", None)
        if positions and self.args.max_source_length > positions:
            raise ConfigError(
                f"task.max_source_length={self.args.max_source_length} is longer than the model's "
                f"{positions} positions; set task.max_source_length={positions} or less."
            )

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The model's cross-entropy of the target tokens (its mean over the labelled tokens,
        times their count): the loop normalises by the target tokens of the whole optimizer
        step on every process, so each token weighs the same however batches split."""
        count = (batch["labels"] != IGNORE_INDEX).sum()
        loss = model(**batch, use_cache=False).loss  # no decoder KV cache built for nothing
        return SummedLoss(loss * count, count.float())

    def _set_generation(self, model: torch.nn.Module, gen: GenerationConfig) -> dict[str, Any]:
        """Write the decoding of ``gen`` (the run's ``generation.*``) into the unwrapped
        model's generation config, so that ``final/`` carries it; returns it, for the log."""
        base = _base_model(model)
        config = base.generation_config
        updates: dict[str, Any] = {
            "max_new_tokens": gen.max_new_tokens or self._eval_target_length,
            "max_length": None,
            "do_sample": gen.do_sample,
        }
        if config.decoder_start_token_id is None:
            updates["decoder_start_token_id"] = base.config.decoder_start_token_id
        if config.pad_token_id is None:
            updates["pad_token_id"] = base.config.pad_token_id
        if gen.num_beams is not None:
            updates["num_beams"] = gen.num_beams
        beams = updates.get("num_beams", config.num_beams or 1)
        if gen.length_penalty is not None:
            if beams > 1:
                updates["length_penalty"] = gen.length_penalty
            else:
                log.warning(
                    "generation.length_penalty=%s has no effect without beam search "
                    "(generation.num_beams > 1)",
                    gen.length_penalty,
                )
        if gen.do_sample:
            updates |= {"temperature": gen.temperature, "top_p": gen.top_p}
        for key, value in updates.items():
            setattr(config, key, value)
        return {k: getattr(config, k) for k in ("num_beams", "max_new_tokens", "do_sample")} | {
            "length_penalty": config.length_penalty
        }

    def before_training(
        self, model: torch.nn.Module, data: Seq2SeqData, run: RunContext, batch_size: int
    ) -> None:
        decoding = self._set_generation(run.accelerator.unwrap_model(model), run.generation)
        log.info("evaluation decodes with %s (saved in final/generation_config.json)", decoding)

    # ------------------------------------------------------------------------- generation

    def _generate(
        self,
        model: torch.nn.Module,
        batch: Mapping[str, torch.Tensor],
        accelerator: Accelerator,
        encoded: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Generated token ids of a batch (decoder start token included), on every process;
        padded across processes so that they can be gathered. ``encoded``: the encoder's
        output for the batch, already computed (by the evaluation loss's forward pass), which
        generate then reuses instead of encoding the sources again."""
        unwrapped = accelerator.unwrap_model(model)
        sharded = accelerator.distributed_type == DistributedType.FSDP
        reuse = {} if encoded is None else {"encoder_outputs": BaseModelOutput(encoded)}
        with generation_lib.whole_root(model, unwrapped) if sharded else contextlib.nullcontext():
            generated = generation_lib.generate(
                unwrapped,
                batch["input_ids"],
                batch["attention_mask"],
                **reuse,
                **self._row_sampling(unwrapped, rows),
                # Every rank steps until all are done: a sharded model's forward is collective.
                synced_gpus=sharded,
            )
        pad = _base_model(unwrapped).generation_config.pad_token_id
        return accelerator.pad_across_processes(generated, dim=1, pad_index=pad)

    @staticmethod
    def _row_sampling(model: torch.nn.Module, rows: torch.Tensor | None) -> dict[str, Any]:
        """Sampled decoding (the generation config's do_sample): each row's tokens drawn from
        its own stream, seeded by its row number, whichever batch and process it falls in."""
        config = _base_model(model).generation_config
        if not config.do_sample or rows is None or (config.num_beams or 1) > 1:
            return {}  # greedy or beam search; beam sampling is transformers' own
        sampled = GenerationConfig(
            do_sample=True, temperature=config.temperature or 1.0, top_p=config.top_p or 1.0
        )
        seed = torch.initial_seed()
        streams = [generation_lib.row_stream(seed, row) for row in rows.tolist()]
        return generation_lib.sample_rows(model, streams, sampled)

    def _generated_texts(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        loader: Iterable[dict[str, torch.Tensor]],
        accelerator: Accelerator,
        with_loss: bool,
    ) -> tuple[dict[int, str], dict[str, float]]:
        """Every row's generated text by its ``row`` number (main process; empty elsewhere),
        and the evaluation loss, mean generated length and generation time."""
        pad = tokenizer.pad_token_id
        totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
        rows, outputs = [], []
        generate_s = 0.0
        for batch in loader:
            row = batch.pop("row")
            encoded = None
            # Each row's summed target-token loss and its count, gathered as rows are (every
            # process's rows, the duplicates that pad the last batch dropped).
            summed = torch.zeros((len(row), 2), dtype=torch.float64, device=row.device)
            if with_loss:
                out = model(**batch)
                labels = batch["labels"]
                nll = torch.nn.functional.cross_entropy(
                    out.logits.float().transpose(1, 2),
                    labels,
                    ignore_index=IGNORE_INDEX,
                    reduction="none",
                )
                summed[:, 0] = nll.sum(1).double()
                summed[:, 1] = (labels != IGNORE_INDEX).sum(1).double()
                encoded = out.encoder_last_hidden_state
            started = time.perf_counter()
            generated = self._generate(model, batch, accelerator, encoded, row)
            generate_s += time.perf_counter() - started
            row, generated, summed = accelerator.gather_for_metrics((row, generated, summed))
            totals[:2] += summed.sum(0)
            totals[2] += (generated[:, 1:] != pad).sum()  # the decoder start token left out
            rows.append(row.cpu())
            outputs.append(generated.cpu())
        stats = {"generate_s": generate_s}
        nll, count, generated_tokens = totals.tolist()
        numbers = torch.cat(rows).tolist() if rows else []
        stats["gen_len"] = generated_tokens / max(len(numbers), 1)
        if with_loss:
            stats["loss"] = nll / max(count, 1.0)
        texts: dict[int, str] = {}
        if accelerator.is_main_process:
            width = max((o.shape[1] for o in outputs), default=0)
            ids = [
                seq
                for o in outputs
                for seq in torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad).tolist()
            ]
            decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
            texts = {n: text.strip() for n, text in zip(numbers, decoded, strict=True)}
        return texts, stats

    def evaluate(
        self, model: nn.Module, loader: Batches, data: Seq2SeqData, run: RunContext
    ) -> Metrics:
        """Generate every evaluation row's answer and score it (main process), with the loss,
        the mean generated length and the generation time; ``eval_predictions.jsonl`` in the
        run folder holds each row's answer and references."""
        texts, stats = self._generated_texts(model, run.tokenizer, loader, run.accelerator, True)
        if not run.accelerator.is_main_process:
            return {}
        order = sorted(texts)
        predictions = [texts[n] for n in order]
        references = [data.references[n] for n in order]
        metrics = self.score_texts(predictions, references)
        metrics |= {"loss": stats["loss"], "gen_len": stats["gen_len"]}
        metrics["generate_s"] = stats["generate_s"]
        if run.output_dir is not None:
            write_jsonl(
                run.output_dir / "eval_predictions.jsonl",
                (
                    {"id": data.row_ids[n], "generated": texts[n], "references": data.references[n]}
                    for n in order
                ),
            )
        return metrics

    def score_texts(
        self, predictions: Sequence[str], references: Sequence[Sequence[str]]
    ) -> dict[str, float]:
        """The task's metric of ``predictions`` against each row's references."""
        if self.args.metric == "rouge":
            return rouge_scores(predictions, references)
        if self.args.metric == "bleu":
            return bleu_scores(predictions, references)
        scores = squad_v1(
            {str(i): p for i, p in enumerate(predictions)},
            {str(i): list(r) for i, r in enumerate(references)},
        )
        return {"exact_match": scores["exact_match"], "f1": scores["f1"]}

    # ------------------------------------------------------------------------- mode=predict

    def predict(
        self, model: nn.Module, loader: Batches, data: Seq2SeqData, run: RunContext
    ) -> Report:
        """``predictions.jsonl``: per row (in file order) its id and the generated text, decoded
        as the training run's evaluation decoded (``final/generation_config.json``;
        ``generation.*`` set on the command line wins)."""
        unwrapped = run.accelerator.unwrap_model(model)
        config = _base_model(unwrapped).generation_config
        given = {key for key in tracking.given_on_command_line("generation.") if key in DECODING}
        # A run's final/ always sets max_new_tokens; a model from elsewhere decodes with the
        # run's generation.* (and the task's target length), as its evaluation would.
        saved = config.max_new_tokens is not None
        kept = {k: getattr(config, k) for k in DECODING if saved and k not in given}
        self._set_generation(unwrapped, run.generation)
        for key, value in kept.items():
            setattr(config, key, value)
        decoding = {k: getattr(config, k) for k in DECODING}
        where = "the model's generation_config" if saved else "generation.*"
        log.info("predict decodes with %s (%s; command line: %s)", decoding, where, given or "-")
        texts, _ = self._generated_texts(model, run.tokenizer, loader, run.accelerator, False)
        records = ({"id": data.row_ids[n], "generated": texts[n]} for n in sorted(texts))
        return write_predictions(
            run, len(data.eval), records if run.accelerator.is_main_process else None
        )


# ----------------------------------------------------------------------------------- helpers


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside an unwrapped model (a peft model's base model): the one
    whose generation config is saved."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.pad_token_id is None:
        raise ConfigError(
            f"model.name_or_path: the tokenizer ({type(tokenizer).__name__}) has no pad token, "
            "which pads sources and generated answers; use a tokenizer with one."
        )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _field(name: str, have: Sequence[str], where: str, key: str) -> tuple[str, str | None]:
    """(column, field) of ``data.<key>=name``: a column, or ``column.field`` (a field of a dict
    column); refuses a name the data does not have."""
    if name in have:
        return name, None
    column, dot, inner = name.partition(".")
    if dot and column in have:
        return column, inner
    raise DataError(
        f"{where}: no column {name!r} (data.{key}={name}); it has {', '.join(have)}. Name the "
        f"column with data.{key}=..., or a field of a dict column as column.field "
        "(translation.en)."
    )


def _values(examples: Dataset, name: str, key: str, where: str, problems: list[str]) -> list[Any]:
    """The values of column ``name`` (or of a dotted field), one per row; a row whose dict
    lacks the field adds a problem and gives ``_MISSING``."""
    column, inner = _field(name, examples.column_names, where, key)
    values = examples[column]
    if inner is None:
        return values
    if not any(isinstance(v, Mapping) and v.get(inner) is not None for v in values):
        # No row has it: a misnamed field (or a column of plain values), said once, with the
        # fields the rows do have, rather than row by row.
        have = sorted({k for v in values if isinstance(v, Mapping) for k in v if v[k] is not None})
        if have:
            fix = f"the rows' fields: {', '.join(have)}; name one with data.{key}={column}.<field>"
        else:
            kinds = ", ".join(sorted({_kind(v) for v in values}))
            fix = f"it holds {kinds}, not objects; name it with data.{key}={column}"
        raise DataError(
            f"{where}: no row has field {inner!r} in column {column!r} ({len(values)} rows; "
            f"data.{key}={name}): {fix}."
        )
    out = []
    for i, value in enumerate(values):
        if isinstance(value, Mapping) and value.get(inner) is not None:
            out.append(value[inner])
            continue
        if isinstance(value, Mapping):
            what = f"has no field {inner!r}" + (
                f" (it has {', '.join(k for k in value if value[k] is not None)})" if value else ""
            )
        else:
            what = f"is {_kind(value)}, not an object with a field {inner!r}"
        problems.append(f"row {i + 1}: column {column!r} {what}")
        out.append(_MISSING)
    return out


def _text_problem(value: Any, key: str, name: str) -> str | None:
    if value is None:
        return f"data.{key} {name!r} is missing (no value, or null)"
    if not isinstance(value, str):
        return f"data.{key} {name!r} holds {_kind(value)} {value!r:.40}, not text"
    if not value.strip():
        return f"data.{key} {name!r} is empty"
    return None


def _refuse(where: str, problems: list[str]) -> None:
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED])
        more = len(problems) - MAX_REPORTED
        raise DataError(
            f"{where}: {len(problems)} bad row(s) (counted from 1): {shown}"
            + (f"; and {more} more" if more > 0 else "")
            + ". Fix or remove those rows."
        )


def _column_texts(
    cfg: DataConfig, split: data_lib.Split, role: str, labelled: bool = True
) -> tuple[list[str], list[str] | None, list[list[str]], list[Any]]:
    """(sources with the prefix, targets, each row's references, row ids) of a split read from
    ``data.source_column`` / ``data.target_column``. A target column holding lists of texts
    trains on the first and scores against all of them."""
    where = f"{role} data {split.source}"
    for key in ("source_column",) + (("target_column",) if labelled else ()):
        if getattr(cfg, key) is None:
            raise ConfigError(
                f"data.{key} is not set: name the column of the {key.split('_')[0]} texts in "
                f"{split.source} (it has {', '.join(split.examples.column_names)}), e.g. "
                f"data.{key}=..."
            )
    examples = split.examples
    problems: list[str] = []
    raw_sources = _values(examples, cfg.source_column, "source_column", where, problems)
    raw_targets = (
        _values(examples, cfg.target_column, "target_column", where, problems)
        if labelled
        else [None] * len(raw_sources)
    )
    sources, targets, references = [], [], []
    for i, (source, target) in enumerate(zip(raw_sources, raw_targets, strict=True)):
        if source is _MISSING or target is _MISSING:
            continue
        problem = _text_problem(source, "source_column", cfg.source_column)
        if problem:
            problems.append(f"row {i + 1}: {problem}")
        sources.append(cfg.source_prefix + (source if isinstance(source, str) else ""))
        if not labelled:
            continue
        refs = list(target) if isinstance(target, (list, tuple)) and target else [target]
        for ref in refs:
            problem = _text_problem(ref, "target_column", cfg.target_column)
            if problem:
                problems.append(f"row {i + 1}: {problem}")
                break
        targets.append(refs[0] if isinstance(refs[0], str) else "")
        references.append([r.strip() for r in refs if isinstance(r, str)])
    _refuse(where, problems)
    return sources, targets if labelled else None, references, row_ids(examples)


def _squad_texts(
    examples: Dataset, prefix: str, labelled: bool = True
) -> tuple[list[str], list[str] | None, list[list[str]], list[Any]]:
    """run_seq2seq_qa's rows: "question: <q> context: <c>" -> the first answer; scored against
    every answer."""
    sources = [
        f"{prefix}question: {q.lstrip()} context: {c.lstrip()}"
        for q, c in zip(examples["question"], examples["context"], strict=True)
    ]
    references = [list(a["text"]) for a in examples["answers"]] if labelled else []
    targets = [refs[0] for refs in references] if labelled else None
    return sources, targets, references, list(examples["id"])


def _tokenized(
    tokenizer: PreTrainedTokenizerBase,
    sources: list[str],
    targets: list[str] | None,
    max_source_length: int,
    max_target_length: int,
    role: str,
    workers: int | None = None,
) -> Dataset:
    """``input_ids`` (cut at ``max_source_length``), ``labels`` (the targets, cut at
    ``max_target_length``, end of sequence kept) and each row's number, built in Arrow
    batches (a large corpus never becomes Python lists of ids)."""
    texts = {"source": sources, "row": list(range(len(sources)))}
    if targets is not None:
        texts["target"] = targets

    def encode(batch: Mapping[str, list]) -> dict[str, list]:
        out = {
            "input_ids": tokenizer(batch["source"], max_length=max_source_length, truncation=True)[
                "input_ids"
            ]
        }
        if "target" in batch:
            out["labels"] = tokenizer(
                text_target=batch["target"], max_length=max_target_length, truncation=True
            )["input_ids"]
        return out

    rows = Dataset.from_dict(texts)
    with data_lib.map_progress(len(rows)):
        return rows.map(
            encode,
            batched=True,
            remove_columns=[c for c in ("source", "target") if c in texts],
            num_proc=workers,
            desc=f"{role} features",
        )
