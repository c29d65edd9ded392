"""Direct preference optimisation of a causal LM on preference pairs (``task=dpo``).

What the task adds to the shared loop, beside SFT's chat rendering it reuses:

* pairs read in the layouts users have (:mod:`recipes.tasks.preference`), each side rendered
  with the chat template and labelled on its completion only (the prompt, its earlier replies
  included, carries no label); TRL's plain-string pairs are a user turn and two replies, or,
  with ``text_rows=raw``, text as TRL tokenizes them (no template, EOS after each side);
* the losses as TRL (1.x) computes them, from the summed log-probabilities of each completion
  under the policy and the reference: ``sigmoid`` (DPO, Rafailov et al.), ``ipo`` (on
  log-probabilities divided by the completion's tokens, as TRL) and ``robust`` (robust DPO,
  ``label_smoothing`` the share of flipped labels, which is what TRL applies it to);
* two losses without a reference model, on the policy's average (per-token) log-probabilities
  of each completion, as TRL 1.16 defines them (see :data:`REFERENCE_FREE`): ``orpo`` and
  ``simpo``;
* the reference (not for ``orpo`` / ``simpo``): under LoRA the same model with its adapter
  disabled (no second copy); with full fine-tuning a frozen copy of the starting weights; or,
  with ``precompute_reference``, its log-probabilities computed once before training (and
  cached with the features), which needs neither;
* TRL's metrics, in training and evaluation: ``rewards/chosen``, ``rewards/rejected``,
  ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; ORPO adds
  ``nll_loss``, ``log_odds_ratio`` and ``log_odds_chosen``, SimPO with an NLL term ``nll_loss``.

Each pair is one loss term (:class:`SummedLoss`): the loop divides the gradient of an optimizer
step by the pairs of the whole step on all processes, so accumulation and process counts give
the full batch's mean. Batches hold the chosen rows, then the rejected rows; with
``padding_free`` each pair is one row (chosen then rejected, ``position_ids`` restarting), which
saves the padding of a short side to a long one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from recipes import adapters
from recipes import data as data_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.log import get_logger
from recipes.tasks import conversations, preference
from recipes.tasks.base import SummedLoss
from recipes.tasks.sft import (
    ChatData,
    SupervisedFineTuning,
    _add_template_tokens,
    _answerable,
    _end_of_turn,
)
from recipes.tasks.token_loss import token_losses

log = get_logger(__name__)

FEATURES_VERSION = 2
# The losses without a reference model, as TRL 1.16 defines them (trl/experimental/orpo/
# orpo_trainer.py and orpo_config.py; trl/experimental/cpo/cpo_trainer.py and cpo_config.py,
# SimPO being CPOTrainer's loss_type="simpo"). Both read the policy's average log-probability
# per completion token of each side (TRL's get_batch_logps(average_log_prob=True)).
#
# orpo (ORPOTrainer; ORPOConfig defaults: beta=0.1, disable_dropout=True, max_length=1024,
#   learning_rate=1e-6): per pair
#       nll(chosen) - beta * logsigmoid(log_odds),
#       log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))
#   with a_c / a_r the average log-probs; TRL's NLL is the chosen row's cross-entropy over its
#   whole sequence, prompt included ("orpo chosen nll loss is computed over the full prompt and
#   response"), every token but the first, as here. rewards = beta * a (no reference).
# simpo (CPOTrainer, loss_type="simpo"; CPOConfig defaults: beta=0.1, simpo_gamma=0.5,
#   label_smoothing=0.0, cpo_alpha=1.0, alpha=0.0 (AlphaPO off), disable_dropout=True,
#   max_length=1024, learning_rate=1e-6): per pair, with z = beta * (a_c - a_r) - gamma,
#       -(1 - ls) * logsigmoid(z) - ls * logsigmoid(-z) + nll_weight * nll(chosen)
#   (ls = label_smoothing, the conservative form, not robust DPO's; CPO's NLL is on the chosen
#   completion's tokens only). TRL's cpo_alpha=1.0 default is CPO's behaviour-cloning term; pure
#   SimPO has none (the SimPO paper; TRL's docs/source/cpo_trainer.md: SimPO "does not use BC
#   regularization ... loss_type="simpo" and cpo_alpha=0"; cpo_alpha > 0 is their "CPO-SimPO";
#   cpo_config.py's alphapo also sets cpo_alpha=0.0), so task.nll_weight defaults to 0. The
#   SimPO paper trains with beta ~2-2.5 and gamma/beta ~0.5; task.beta keeps TRL's 0.1 default
#   for every loss.
#
# Where the project differs: TRL's NLL is one token-weighted mean over a micro-batch's chosen
# rows, so its value depends on how pairs fall into micro-batches; here each pair's NLL is the
# mean over its own tokens (one term per pair, SummedLoss), which equals TRL's for a batch of
# one pair and keeps accumulation and process counts giving the full batch's mean. TRL's
# logits/chosen and logits/rejected (the mean raw logit over every position and the vocabulary,
# padding included) are not logged; its other metrics are, under its names.
REFERENCE_FREE = ("orpo", "simpo")
LOSS_TYPES = ("sigmoid", "ipo", "robust", *REFERENCE_FREE)
SIDES = ("chosen", "rejected")
STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_STATS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


@dataclass
class PreferenceData(ChatData):
    """The pairs' features; ``prompts`` are held-out prompts with their chosen answer;
    ``feature_keys`` and ``cache`` say where precomputed reference log-probs are cached."""

    feature_keys: dict[str, str] = field(default_factory=dict)
    cache: Path | None = None


class DirectPreference(SupervisedFineTuning):
    """DPO (``task=dpo``).

    Args:
        format: layout of the rows: auto (detected per row), explicit, implicit, ultrafeedback.
        chat_template: null (the tokenizer's), a name (chatml, llama3, zephyr) or a Jinja file.
        text_rows: plain-string pairs as chat turns (chat) or as text, as TRL (raw).
        max_seq_length: tokens of prompt and completion, per side.
        truncation: truncate (cut the end of a long side) or drop the pair.
        beta: strength of the pull to the reference (TRL's beta); ORPO: the weight of the
            odds-ratio term; SimPO: the scale of the average log-prob margin.
        loss_type: sigmoid (DPO), ipo, robust; orpo or simpo (no reference model).
        label_smoothing: robust: the share of pairs assumed mislabelled; simpo: TRL's
            conservative label smoothing.
        simpo_gamma: SimPO's target reward margin (simpo only; TRL's default 0.5).
        nll_weight: weight of the chosen side's NLL added to SimPO (TRL's cpo_alpha; 0: pure
            SimPO, 1: CPO-SimPO). ORPO's NLL term is part of the loss (weight 1, as TRL).
        precompute_reference: compute the reference's log-probabilities once before training
            (not with orpo / simpo, which have no reference).
        padding_free: each pair in one row, chosen then rejected (no padding between them).
        disable_dropout: no dropout in the model (TRL's default: policy and reference agree).
        num_generations: held-out prompts answered greedily after training (0: none).
        generation_max_new_tokens: length limit of those answers.
    """

    sums_loss_terms = True
    logged_stats: tuple[str, ...] = STATS  # per instance: the loss type adds its own
    terms_per_example = 1  # one term per pair
    main_metric = "loss"
    greater_is_better = False
    _row_words = ("pair", "both its replies")

    def __init__(
        self,
        *,
        format: str,
        chat_template: str | None,
        max_seq_length: int,
        truncation: str,
        beta: float,
        loss_type: str,
        label_smoothing: float,
        simpo_gamma: float,
        nll_weight: float,
        precompute_reference: bool,
        padding_free: bool,
        disable_dropout: bool,
        num_generations: int,
        generation_max_new_tokens: int,
        generation: Mapping[str, Any] | GenerationConfig | None,
        text_rows: str,
    ) -> None:
        if format not in preference.FORMATS:
            raise ConfigError(f"task.format={format!r}: choose {', '.join(preference.FORMATS)}.")
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"task.loss_type={loss_type!r}: choose {', '.join(LOSS_TYPES)}.")
        if not beta > 0:
            raise ConfigError(f"task.beta={beta}: must be > 0 (TRL's default is 0.1).")
        if not 0 <= label_smoothing < 0.5:
            raise ConfigError(
                f"task.label_smoothing={label_smoothing}: must be in [0, 0.5) (the share of "
                "pairs assumed mislabelled)."
            )
        if label_smoothing and loss_type not in ("robust", "simpo"):
            raise ConfigError(
                f"task.label_smoothing={label_smoothing} is for task.loss_type=robust (robust "
                "DPO) or simpo, where TRL applies it; set it there, or to 0."
            )
        if not 0 <= simpo_gamma < math.inf:
            raise ConfigError(
                f"task.simpo_gamma={simpo_gamma}: must be a finite number >= 0 (SimPO's target "
                "reward margin; TRL's default is 0.5)."
            )
        if not 0 <= nll_weight < math.inf:
            raise ConfigError(f"task.nll_weight={nll_weight}: must be a finite number >= 0.")
        if nll_weight and loss_type != "simpo":
            raise ConfigError(
                f"task.nll_weight={nll_weight} is for task.loss_type=simpo (TRL's cpo_alpha); "
                "ORPO's NLL term is always in its loss; set it to 0."
            )
        if precompute_reference and loss_type in REFERENCE_FREE:
            raise ConfigError(
                f"task.precompute_reference=true: task.loss_type={loss_type} uses no reference "
                "model; set task.precompute_reference=false."
            )
        super().__init__(
            format="auto",
            chat_template=chat_template,
            max_seq_length=max_seq_length,
            truncation=truncation,
            train_on_prompt=False,
            packing=padding_free,
            num_generations=num_generations,
            generation_max_new_tokens=generation_max_new_tokens,
            generation=generation,
            text_rows=text_rows,
        )
        self.format = format
        self.beta = beta
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.simpo_gamma = simpo_gamma
        self.nll_weight = nll_weight
        self.reference_free = loss_type in REFERENCE_FREE
        # The chosen side's NLL: ORPO's, over the whole chosen row (prompt included, as TRL);
        # SimPO's (nll_weight > 0), over its completion.
        self.sequence_nll = loss_type == "orpo"
        self.with_nll = loss_type == "orpo" or (loss_type == "simpo" and nll_weight > 0)
        self.logged_stats = STATS + (
            ORPO_STATS if loss_type == "orpo" else ("nll_loss",) if self.with_nll else ()
        )
        self.precompute_reference = precompute_reference
        self.padding_free = padding_free
        self.disable_dropout = disable_dropout
        # The reference forward, set in before_training: the model with its adapter disabled,
        # a frozen copy, or None where the batches carry precomputed log-probabilities.
        self._reference: Callable[[torch.nn.Module, Mapping], torch.Tensor] | None = None

    def settings(self) -> dict[str, Any]:
        keys = ("format", "chat_template", "max_seq_length", "truncation", "padding_free")
        return {k: getattr(self, k) for k in keys} | {"text_rows": self.text_rows}

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PreferenceData:
        template = self._template(tokenizer)
        new_tokens = _add_template_tokens(tokenizer, self.chat_template)
        tokenizer.chat_template = template  # saved with it: final/ renders prompts as trained
        splits = data_lib.load_splits(cfg, lambda path: preference.read_pairs(path, self.format))
        features, pairs, keys = {}, {}, {}
        for role, split in splits.items():
            pairs[role] = preference.normalise(split.examples, self.format, split.source)
            keys[role], features[role] = self._pair_features(
                cfg, tokenizer, template, role, split, pairs[role]
            )
        return PreferenceData(
            feature_keys=keys,
            cache=data_lib.cache_root(cfg),
            train=features["train"],
            eval=features["eval"],
            train_collator=self._collator(tokenizer),
            eval_collator=self._collator(tokenizer),
            template=template,
            prompts=_answerable(_held_out_prompts(pairs["eval"], self.num_generations), template),
            new_tokens=new_tokens,
            stop_tokens=_end_of_turn(tokenizer, template),
        )

    def _collator(self, tokenizer: PreTrainedTokenizerBase) -> PairCollator:
        return PairCollator(tokenizer.pad_token_id, self.padding_free, self.sequence_nll)

    def _pair_features(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        role: str,
        split: data_lib.Split,
        pairs: Dataset,
    ) -> tuple[str, Dataset]:
        """Both sides' token ids and completion labels, length policy applied (cached), and
        their cache key."""
        key, built = self._tokenized(
            cfg, tokenizer, template, role, split, pairs, "dpo", FEATURES_VERSION
        )
        log.info(
            "%s: %d pairs -> %d features; a side longer than task.max_seq_length=%d is %s",
            role,
            len(pairs),
            len(built),
            self.max_seq_length,
            "cut at its end" if self.truncation == "truncate" else "dropped with its pair",
        )
        # Positions in the split (for precomputed reference log-probabilities).
        return key, built.add_column("index", list(range(len(built))))

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        source: str,
    ) -> dict[str, list]:
        names = [f"{side}_{key}" for side in SIDES for key in ("input_ids", "labels")]
        out: dict[str, list] = {name: [] for name in (*names, "length")}
        columns = ("prompt", "chosen", "rejected", "tools", "text", "place")
        for prompt, chosen, rejected, tools, text, place in zip(
            *(batch[k] for k in columns), strict=True
        ):
            if text and self.text_rows == "raw":
                completions = [side[0]["content"] for side in (chosen, rejected)]
                wholes = conversations.tokenize_text(tokenizer, prompt[0]["content"], completions)
            else:
                wholes = [
                    self._templated_reply(
                        tokenizer, template, prompt, c, tools, f"{source} {place}"
                    )
                    for c in (chosen, rejected)
                ]
            sides = [
                conversations.fit_length(w, self.max_seq_length, self.truncation) for w in wholes
            ]
            if None in sides:
                continue
            for side, fitted in zip(SIDES, sides, strict=True):
                out[f"{side}_input_ids"].append(fitted["input_ids"])
                out[f"{side}_labels"].append(fitted["labels"])
            lengths = [len(s["input_ids"]) for s in sides]
            out["length"].append(sum(lengths) if self.padding_free else max(lengths))
        return out

    def _templated_reply(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        prompt: list,
        completion: list,
        tools: Any,
        where: str,
    ) -> dict[str, list[int]]:
        """``prompt`` then ``completion`` rendered with the template, labelled on the completion;
        a row the template cannot render is refused naming ``where``."""
        self._check_has_template(template, where)
        try:
            return conversations.tokenize_conversation(
                tokenizer, template, prompt + completion, tools=tools, label_from=len(prompt)
            )
        except (conversations.TemplateMismatch, conversations.RowError) as err:
            raise conversations.refusal(err, where) from None

    # ------------------------------------------------------------------------------ model

    def before_training(
        self,
        model: torch.nn.Module,
        data: PreferenceData,
        accelerator: Accelerator,
        batch_size: int,
    ) -> None:
        """Choose the reference (see the module's docstring) from the starting weights; none
        for ``orpo`` / ``simpo``: no copy, no reference pass with the adapter disabled."""
        unwrapped = accelerator.unwrap_model(model)
        if self.disable_dropout:
            _disable_dropout(unwrapped)
        if self.reference_free:
            self._reference = None
            log.info("task.loss_type=%s: no reference model (none is built)", self.loss_type)
            return
        peft = adapters.is_peft_model(unwrapped)
        if self.precompute_reference:
            tables = self._precomputed(model, data, accelerator, batch_size)
            data.train_collator.reference, data.eval_collator.reference = tables
            self._reference = None
            return
        if peft:
            self._reference = self._adapter_disabled
            log.info("DPO reference: the model with its LoRA adapter disabled (no copy)")
            return
        if accelerator.distributed_type == DistributedType.FSDP:
            raise ConfigError(
                "task=dpo with full fine-tuning under FSDP: the frozen reference copy cannot be "
                "sharded here; set task.precompute_reference=true (the reference's log-probs "
                "computed once before training), or train LoRA adapters (peft=lora)."
            )
        frozen = copy.deepcopy(unwrapped).eval().requires_grad_(False)
        autocast = accelerator.autocast
        log.info("DPO reference: a frozen copy of the starting weights")

        def frozen_copy(_: torch.nn.Module, batch: Mapping) -> torch.Tensor:
            with autocast():
                return self._logps_of(frozen, batch)[0]

        self._reference = frozen_copy

    def _adapter_disabled(self, model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
        """The base model's log-probabilities: the policy with its LoRA adapter disabled."""
        with _peft_model(model).disable_adapter():
            return self._logps_of(model, batch)[0]

    def _precomputed(
        self,
        model: torch.nn.Module,
        data: PreferenceData,
        accelerator: Accelerator,
        batch_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference log-probs of the train and eval pairs: read from the feature cache,
        keyed by the features, the starting weights (:func:`_weights_fingerprint`) and the
        precision, or computed once and cached there."""
        key = data_lib.cache_key(
            features=data.feature_keys,
            weights=_weights_fingerprint(model, accelerator),
            precision=accelerator.mixed_precision,
            loss_type=self.loss_type,
            version=FEATURES_VERSION,
        )
        path = (data.cache or Path(".")) / f"dpo-reference-{key}.pt"
        if path.exists():
            tables = torch.load(path)
            log.info("DPO reference: precomputed log-probs read from the cache, %s", path)
            return tables["train"], tables["eval"]
        unwrapped = accelerator.unwrap_model(model)
        peft = adapters.is_peft_model(unwrapped)
        reference = self._adapter_disabled if peft else (lambda m, b: self._logps_of(m, b)[0])
        tables = {
            role: self._precompute(model, reference, split, collator, accelerator, batch_size)
            for role, split, collator in (
                ("train", data.train, data.train_collator),
                ("eval", data.eval, data.eval_collator),
            )
        }
        if accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{accelerator.process_index}")
            torch.save(tables, tmp)
            tmp.replace(path)
            log.info("DPO reference: precomputed log-probs cached in %s", path)
        accelerator.wait_for_everyone()
        return tables["train"], tables["eval"]

    @torch.no_grad()
    def _precompute(
        self,
        model: torch.nn.Module,
        reference: Callable[[torch.nn.Module, Mapping], torch.Tensor],
        split: Dataset,
        collator: PairCollator,
        accelerator: Accelerator,
        batch_size: int,
    ) -> torch.Tensor:
        """The reference log-probabilities of every pair of ``split``, (pairs, 2), the same on
        every process: each computes a strided share (all the same number of batches, as FSDP
        needs), then they are gathered."""
        rank, world = accelerator.process_index, accelerator.num_processes
        share = math.ceil(len(split) / world)
        mine = [min(rank + world * i, len(split) - 1) for i in range(share)]
        model.eval()
        values, indices = [], []
        for start in range(0, share, batch_size):
            chunk = mine[start : start + batch_size]
            batch = collator([split[i] for i in chunk])
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            values.append(reference(model, batch).float())
            indices.append(batch["index"])
        model.train()
        values = accelerator.gather(torch.cat(values))
        indices = accelerator.gather(torch.cat(indices))
        table = torch.zeros(len(split), 2, dtype=torch.float32)
        table[indices.cpu()] = values.cpu()
        log.info("DPO reference: log-probs of %d pairs computed before training", len(split))
        return table

    # ------------------------------------------------------------------------------- loss

    def _logps_of(
        self, model: torch.nn.Module, batch: Mapping
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probabilities of each pair's chosen and rejected completion, and their
        tokens: two (pairs, 2) tensors."""
        return self._policy_terms(model, batch, with_nll=False)[:2]

    def _policy_terms(
        self, model: torch.nn.Module, batch: Mapping, with_nll: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`_logps_of`'s two tensors from one forward, and (``with_nll``) each pair's
        chosen NLL, (pairs,): ORPO's over the chosen row's tokens, prompt included, as TRL;
        SimPO's over the chosen completion's."""
        inputs = {
            k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch
        }
        logits = self.forward(model, inputs).logits
        pairs = len(batch["index"])
        logps, tokens = [], []
        for side in SIDES:
            nll, count = token_losses(logits, batch[f"{side}_labels"])
            # Padded batches: rows of chosen, then of rejected; padding-free: a row per pair.
            logps.append(-nll.view(-1, pairs).sum(0))
            tokens.append(count.view(-1, pairs).sum(0))
        logps, tokens = torch.stack(logps, dim=1), torch.stack(tokens, dim=1)
        if not with_nll:
            return logps, tokens, None
        if not self.sequence_nll:
            return logps, tokens, -logps[:, 0] / tokens[:, 0].clamp(min=1)
        nll, count = token_losses(logits, batch["chosen_sequence_labels"])
        return logps, tokens, nll.view(-1, pairs).sum(0) / count.view(-1, pairs).sum(0).clamp(1)

    def _reference_logps(self, model: torch.nn.Module, batch: Mapping) -> torch.Tensor | None:
        if self.reference_free:
            return None
        if "reference_logps" in batch:
            return batch["reference_logps"]
        with torch.no_grad():
            return self._reference(model, batch)

    def pair_losses(
        self,
        policy: torch.Tensor,
        reference: torch.Tensor | None,
        tokens: torch.Tensor,
        nll: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pair: the loss, from the (pairs, 2) summed log-probs of the policy and the
        reference (None for orpo / simpo) and the completions' tokens, and for orpo (and simpo
        with ``nll_weight``) the chosen side's NLL, (pairs,); and TRL's metrics
        (:attr:`logged_stats`), (pairs, len(logged_stats))."""
        if self.reference_free:
            return self._reference_free_losses(policy, tokens, nll)
        ratios = policy - reference  # log pi / pi_ref of chosen, rejected
        if self.loss_type == "ipo":  # per token (TRL's normalisation, confirmed by IPO's authors)
            per_token = ratios / tokens.clamp(min=1)
            losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * self.beta)) ** 2
        else:
            scaled = self.beta * (ratios[:, 0] - ratios[:, 1])
            losses = -F.logsigmoid(scaled)
            if self.loss_type == "robust":  # unbiased under a share of flipped labels
                flip = self.label_smoothing
                losses = (losses * (1 - flip) + F.logsigmoid(-scaled) * flip) / (1 - 2 * flip)
        return losses, _reward_stats(self.beta * ratios, policy)

    def _reference_free_losses(
        self, policy: torch.Tensor, tokens: torch.Tensor, nll: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ORPO and SimPO (TRL 1.16's, see :data:`REFERENCE_FREE`) on the average log-probs."""
        average = policy.float() / tokens.clamp(min=1)  # per completion token, (pairs, 2)
        chosen, rejected = average[:, 0], average[:, 1]
        extra: list[torch.Tensor] = []
        if self.loss_type == "orpo":
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            ratio = F.logsigmoid(log_odds)
            losses = nll - self.beta * ratio
            extra = [nll.detach(), ratio.detach(), log_odds.detach()]
        else:  # simpo
            margin = self.beta * (chosen - rejected) - self.simpo_gamma
            smoothing = self.label_smoothing
            losses = -F.logsigmoid(margin) * (1 - smoothing) - F.logsigmoid(-margin) * smoothing
            if self.with_nll:
                losses = losses + self.nll_weight * nll
                extra = [nll.detach()]
        stats = _reward_stats(self.beta * average, average)
        return losses, torch.cat([stats, *(value[:, None] for value in extra)], dim=1)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The pairs' summed loss and their count; TRL's metrics summed over them."""
        losses, stats = self._batch_losses(model, batch)
        count = torch.tensor(float(len(losses)), device=losses.device)
        return SummedLoss(
            losses.sum(), count, dict(zip(self.logged_stats, stats.sum(0), strict=True))
        )

    def _batch_losses(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reference = self._reference_logps(model, batch)
        policy, tokens, nll = self._policy_terms(model, batch, self.with_nll)
        return self.pair_losses(policy, reference, tokens, nll)

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Any,
        data: PreferenceData,
        accelerator: Accelerator,
        output_dir: Any,
    ) -> dict[str, float]:
        """The mean loss and metrics over the held-out pairs, on all processes."""
        model.eval()
        names = self.logged_stats
        totals = torch.zeros(2 + len(names), dtype=torch.float64, device=accelerator.device)
        for batch in loader:
            losses, stats = self._batch_losses(model, batch)
            per_pair = torch.cat([losses[:, None], torch.ones_like(losses)[:, None], stats], dim=1)
            totals += accelerator.gather_for_metrics(per_pair).sum(dim=0).double()
        model.train()
        loss, pairs, *sums = totals.tolist()
        metrics = {"loss": loss / max(pairs, 1.0), "pairs": pairs}
        metrics |= {name: value / max(pairs, 1.0) for name, value in zip(names, sums, strict=True)}
        return broadcast_object_list([metrics])[0]


class PairCollator:
    """Pads a batch of pairs: the chosen rows, then the rejected rows, with ``attention_mask``;
    or (``padding_free``) one row per pair, chosen then rejected, with ``position_ids``.
    ``chosen_labels`` / ``rejected_labels`` label one side each, ``index`` is each pair's
    position in its split, and ``reference_logps`` the precomputed reference (when set);
    ``chosen_sequence_labels`` (``sequence_nll``, ORPO) label the chosen side's every token."""

    def __init__(self, pad_token_id: int, padding_free: bool, sequence_nll: bool = False) -> None:
        self.pad_token_id = pad_token_id
        self.padding_free = padding_free
        self.sequence_nll = sequence_nll
        self.pad_to_multiple_of: int | None = None  # the loop sets trainer.pad_to_multiple_of
        self.reference: torch.Tensor | None = None  # (pairs of the split, 2), when precomputed

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.padding_free:
            rows = [self._joined(p) for p in pairs]
        else:
            rows = [
                {
                    "input_ids": p[f"{side}_input_ids"],
                    f"{side}_labels": p[f"{side}_labels"],
                    f"{other}_labels": [conversations.IGNORE_INDEX] * len(p[f"{side}_input_ids"]),
                    "chosen_sequence_labels": list(p[f"{side}_input_ids"])
                    if side == "chosen"
                    else [conversations.IGNORE_INDEX] * len(p[f"{side}_input_ids"]),
                }
                for side, other in (("chosen", "rejected"), ("rejected", "chosen"))
                for p in pairs
            ]
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": conversations._pad(rows, "input_ids", self.pad_token_id, longest),
            "chosen_labels": conversations._pad(
                rows, "chosen_labels", conversations.IGNORE_INDEX, longest
            ),
            "rejected_labels": conversations._pad(
                rows, "rejected_labels", conversations.IGNORE_INDEX, longest
            ),
            "index": torch.tensor([p["index"] for p in pairs]),
        }
        if self.sequence_nll:
            batch["chosen_sequence_labels"] = conversations._pad(
                rows, "chosen_sequence_labels", conversations.IGNORE_INDEX, longest
            )
        if self.padding_free:
            batch["position_ids"] = conversations._pad(rows, "position_ids", 0, longest)
        else:
            ones = [{"m": [1] * len(r["input_ids"])} for r in rows]
            batch["attention_mask"] = conversations._pad(ones, "m", 0, longest)
        if self.reference is not None:
            batch["reference_logps"] = self.reference[batch["index"]]
        return batch

    @staticmethod
    def _joined(pair: Mapping[str, Any]) -> dict[str, list[int]]:
        chosen, rejected = pair["chosen_input_ids"], pair["rejected_input_ids"]
        return {
            "input_ids": list(chosen) + list(rejected),
            "chosen_labels": list(pair["chosen_labels"])
            + [conversations.IGNORE_INDEX] * len(rejected),
            "rejected_labels": [conversations.IGNORE_INDEX] * len(chosen)
            + list(pair["rejected_labels"]),
            "chosen_sequence_labels": list(chosen) + [conversations.IGNORE_INDEX] * len(rejected),
            "position_ids": list(range(len(chosen))) + list(range(len(rejected))),
        }


def _weights_fingerprint(model: torch.nn.Module, accelerator: Accelerator) -> list[float]:
    """Sums of the starting weights the reference is computed from (LoRA's own weights left
    out: the reference disables them), the same on every process: under FSDP each holds a
    shard, so the shards' sums are added up."""
    sums = []
    for name, param in accelerator.unwrap_model(model).named_parameters():
        if "lora_" not in name:
            local = param.to_local() if hasattr(param, "to_local") else param
            sums.append(local.detach().double().sum())
    total = torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64)
    if accelerator.distributed_type == DistributedType.FSDP:
        total = accelerator.reduce(total.to(accelerator.device), reduction="sum")
    return [float(f"{value:.9g}") for value in total.tolist()]


def _reward_stats(rewards: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """TRL's six metrics per pair, (pairs, 6) (:data:`STATS`), from the (pairs, 2) rewards and
    log-probs of chosen and rejected."""
    rewards, logps = rewards.detach(), logps.detach()
    return torch.stack(
        [
            rewards[:, 0],
            rewards[:, 1],
            (rewards[:, 0] > rewards[:, 1]).float(),
            rewards[:, 0] - rewards[:, 1],
            logps[:, 0],
            logps[:, 1],
        ],
        dim=1,
    )


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (each branch where it is accurate)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _peft_model(model: torch.nn.Module) -> Any:
    """The peft model inside a DDP wrapper (FSDP keeps it as its own module)."""
    inner = getattr(model, "module", model)
    return inner if hasattr(inner, "disable_adapter") else model


def _disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout to 0 (TRL's ``disable_dropout``): the policy's log-probabilities are then
    those the reference sees, not a noisy draw of them."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p = 0.0
            count += 1
    for config in {id(c): c for c in (getattr(model, "config", None),) if c is not None}.values():
        for key in ("attention_dropout", "hidden_dropout", "dropout"):
            if getattr(config, key, 0):
                setattr(config, key, 0.0)
                count += 1
    if count:
        log.info("task.disable_dropout: %d dropout module(s) and setting(s) set to 0", count)


def _held_out_prompts(pairs: Dataset, count: int) -> list[dict[str, Any]]:
    """The first ``count`` evaluation prompts, with their chosen reply as the reference."""
    return [
        {"messages": row["prompt"], "tools": row["tools"], "reference": row["chosen"][0]["content"]}
        for row in pairs.select(range(min(count, len(pairs))))
    ]
