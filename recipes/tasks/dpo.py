"""Direct preference optimisation of a causal LM on preference pairs (``task=dpo``).

What the task adds to the shared loop, beside the chat features it holds
(:mod:`recipes.tasks.chat`):

* pairs read in the layouts users have (:mod:`recipes.tasks.chat.preference`), each side rendered
  with the chat template and labelled on its completion only (the prompt, its earlier replies
  included, carries no label); TRL's plain-string pairs are a user turn and two replies, or,
  with ``text_rows=raw``, text as TRL tokenizes them (no template, EOS after each side);
* the losses as TRL (1.x) computes them (:mod:`recipes.losses.preference`), from the summed
  log-probabilities of each completion under the policy and the reference: ``sigmoid`` (DPO,
  Rafailov et al.), ``ipo`` (on log-probabilities divided by the completion's tokens, as TRL)
  and ``robust`` (robust DPO, ``label_smoothing`` the share of flipped labels, which is what
  TRL applies it to);
* two losses without a reference model, on the policy's average (per-token) log-probabilities
  of each completion, as TRL 1.16 defines them (see :data:`REFERENCE_FREE`): ``orpo`` and
  ``simpo``;
* the reference (not for ``orpo`` / ``simpo``, :mod:`recipes.tasks.chat.reference`): under LoRA the
  same model with its adapter disabled (no second copy); with full fine-tuning a frozen copy of
  the starting weights; or, with ``precompute_reference``, its log-probabilities computed once
  before training (and cached with the features), which needs neither;
* TRL's metrics, in training and evaluation: ``rewards/chosen``, ``rewards/rejected``,
  ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; ORPO adds
  ``nll_loss``, ``log_odds_ratio`` and ``log_odds_chosen``, SimPO with an NLL term ``nll_loss``.

Each pair is one loss term (:class:`SummedLoss`): the loop divides the gradient of an optimizer
step by the pairs of the whole step on all processes, so accumulation and process counts give
the full batch's mean. Batches hold the chosen rows, then the rejected rows, padded. With
``padding_free`` (``auto``, the default: where the model's attention runs a variable-length
kernel, flash attention's) a micro-batch is one row of its pairs' sides, chosen then rejected,
``position_ids`` restarting at each and no padding token: TRL's padding-free layout, exact under
such a kernel. ``padding_free=true`` under a dense attention (SDPA, eager) puts each pair in one
row under a block-diagonal mask instead, which saves the padding of a short side to a long one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from recipes.config import DataConfig
from recipes.log import get_logger
from recipes.losses.preference import preference_loss, stat_names
from recipes.tasks import chat
from recipes.tasks.base import Averaging, Layout, LossShape, RunContext, SummedLoss, Task
from recipes.tasks.chat import PreferenceData, PromptAnswers, token_losses
from recipes.tasks.configs.dpo import LOSS_TYPES, REFERENCE_FREE, DpoConfig  # noqa: F401

log = get_logger(__name__)

FEATURES_VERSION = 3
# The losses (recipes.losses.preference, as TRL defines them): per pair, from the summed
# log-probabilities this task gathers. ORPO's NLL is the chosen row's cross-entropy over its
# whole sequence, prompt included, every token but the first, as TRL's ("orpo chosen nll loss is
# computed over the full prompt and response"); SimPO's (CPO-SimPO, task.nll_weight > 0) over
# the chosen completion's tokens only, as CPO's.
#
# Where the project differs: TRL's NLL is one token-weighted mean over a micro-batch's chosen
# rows, so its value depends on how pairs fall into micro-batches; here each pair's NLL is the
# mean over its own tokens (one term per pair, SummedLoss), which equals TRL's for a batch of
# one pair and keeps accumulation and process counts giving the full batch's mean. TRL's
# logits/chosen and logits/rejected (the mean raw logit over every position and the vocabulary,
# padding included) are not logged; its other metrics are, under its names.
# REFERENCE_FREE and LOSS_TYPES: recipes.tasks.configs.dpo.
SIDES = ("chosen", "rejected")


class DirectPreference(Task[PreferenceData]):
    """DPO (``task=dpo``); its settings: :class:`recipes.tasks.configs.dpo.DpoConfig`."""

    auto_model_class = AutoModelForCausalLM
    # Its losses read the logits a chunk at a time (trainer.fused_linear_loss).
    fused_linear_loss = True
    args: DpoConfig
    parts = ("reference",)

    def __init__(self, args: DpoConfig) -> None:
        super().__init__(args)
        self.against_reference = chat.AgainstReference(
            args,
            "dpo",
            FEATURES_VERSION,
            rows="pairs",
            fsdp_fix=(
                "set task.precompute_reference=true (the reference's log-probs computed once before "
                "training), or train LoRA adapters (peft=lora)."
            ),
        )
        self.chat = self.against_reference.features(("pair", "both its replies"))
        self.predictor = PromptAnswers(self.chat, args.format)
        loss_type = args.loss_type
        self.reference_free = loss_type in REFERENCE_FREE
        # The chosen side's NLL: ORPO's, over the whole chosen row (prompt included, as TRL);
        # SimPO's (nll_weight > 0), over its completion.
        self.sequence_nll = loss_type == "orpo"
        self.with_nll = loss_type == "orpo" or (loss_type == "simpo" and args.nll_weight > 0)
        self.stats = stat_names(loss_type, self.with_nll)  # TRL's metrics of this loss, per pair
        # Built in before_training from the starting weights; None for orpo / simpo.
        self.reference: chat.reference.Reference | None = None
        self.padding_free = chat.padding_free_setting(args.padding_free)

    def loss_shape(self) -> LossShape:
        """One summed term per pair, TRL's metrics summed beside it."""
        return LossShape(Averaging.sum, terms_per_example=1, stats=self.stats)

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PreferenceData:
        pairs = self.chat.read_splits(
            cfg, tokenizer, chat.preference.read_pairs, chat.preference.normalise, self._tokenize
        )
        for role, built in pairs.features.items():
            self.chat.report_pairs(role, pairs.rows[role], built)
        held_out = chat.held_out_prompts(
            pairs.rows["eval"], self.args.num_generations, _with_chosen_reply
        )
        pair_rows = self.padding_free == "true"
        return self.against_reference.data(
            cfg,
            pairs.features,
            pairs.keys,
            lambda layout: PairCollator(
                tokenizer.pad_token_id, pair_rows, self.sequence_nll, layout
            ),
            pairs.template.data_fields(held_out),
        )

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        source: str,
    ) -> dict[str, list]:
        names = [f"{side}_{key}" for side in SIDES for key in ("input_ids", "labels")]
        out: dict[str, list] = {name: [] for name in (*names, "length")}
        for values in zip(*(batch[k] for k in chat.preference.COLUMNS), strict=True):
            pair = dict(zip(chat.preference.COLUMNS, values, strict=True))
            sides = self.chat.pair_sides(tokenizer, template, pair, f"{source} {pair['place']}")
            if sides is None:
                continue
            for side, fitted in zip(SIDES, sides, strict=True):
                out[f"{side}_input_ids"].append(fitted["input_ids"])
                out[f"{side}_labels"].append(fitted["labels"])
            lengths = [len(s["input_ids"]) for s in sides]
            summed = self.padding_free == "true"
            out["length"].append(sum(lengths) if summed else max(lengths))
        return out

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        """The model's limits: with ``padding_free=true`` its attention must take the mask of a
        pair per row where it has no variable-length kernel."""
        self.chat.check_model(model, packing=self.padding_free == "true")

    def flat_batches(self, model: torch.nn.Module) -> bool:
        """Padding-free under a variable-length kernel (``padding_free`` auto or true); with
        ``true`` elsewhere, a pair per row under a block-diagonal mask (not flat)."""
        return self.padding_free != "false" and chat.flat_batches("auto", model)

    @property
    def evaluates_against_start(self) -> bool:
        """Its rewards and margins compare the model with its reference (not orpo / simpo)."""
        return not self.reference_free

    def before_training(
        self, model: torch.nn.Module, data: PreferenceData, run: RunContext, batch_size: int
    ) -> None:
        """Choose the reference (see the module's docstring) from the starting weights; none
        for ``orpo`` / ``simpo``: no copy, no reference pass with the adapter disabled."""
        self.reference = self.against_reference.reference(
            model,
            data,
            run.accelerator,
            batch_size,
            self._reference_forward,
            live=not self.reference_free,
        )
        if self.reference is None:
            log.info("task.loss_type=%s: no reference model (none is built)", self.args.loss_type)

    # ------------------------------------------------------------------------------- loss

    def _reference_forward(self, model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
        return self._logps_of(model, batch)[0]

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
        logits = chat.forward(model, inputs, lazy_head=True).logits
        pairs = len(batch["index"])
        if "sequence" in batch:  # padding-free: one row, each token's pair in "sequence"
            return self._flat_terms(logits, batch, pairs, with_nll)
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

    def _flat_terms(
        self, logits: torch.Tensor, batch: Mapping, pairs: int, with_nll: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`_policy_terms` of a padding-free batch: the sums per pair of its row."""
        sums = [
            chat.sequence_losses(logits, batch[f"{side}_labels"], batch["sequence"], pairs)
            for side in SIDES
        ]
        logps = -torch.stack([nll for nll, _ in sums], dim=1)
        tokens = torch.stack([count for _, count in sums], dim=1)
        if not with_nll:
            return logps, tokens, None
        if not self.sequence_nll:
            return logps, tokens, -logps[:, 0] / tokens[:, 0].clamp(min=1)
        nll, count = chat.sequence_losses(
            logits, batch["chosen_sequence_labels"], batch["sequence"], pairs
        )
        return logps, tokens, nll / count.clamp(1)

    def _reference_logps(self, model: torch.nn.Module, batch: Mapping) -> torch.Tensor | None:
        if self.reference is None:
            return None
        return self.reference.logps(model, batch, self._reference_forward)

    @property
    def loss_settings(self) -> dict[str, Any]:
        """The settings :func:`recipes.losses.preference.preference_loss` reads."""
        args = self.args
        return {
            "loss_type": args.loss_type,
            "beta": args.beta,
            "label_smoothing": args.label_smoothing,
            "simpo_gamma": args.simpo_gamma,
            "nll_weight": args.nll_weight,
        }

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The pairs' summed loss and their count; TRL's metrics summed over them."""
        return chat.reference.summed_loss(
            model, self.stats, lambda: self._batch_losses(model, batch)
        )

    def _batch_losses(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reference = self._reference_logps(model, batch)
        policy, tokens, nll = self._policy_terms(model, batch, self.with_nll)
        return preference_loss(policy, reference, tokens, nll, **self.loss_settings)

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        losses, stats = self._batch_losses(model, batch)
        return {"loss": losses, "stats": stats}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: PreferenceData, run: RunContext
    ) -> dict[str, float]:
        """The mean loss and TRL's metrics over the held-out pairs."""
        pairs = float(len(rows["loss"]))
        sums = rows["stats"].double().sum(0).tolist()
        metrics = {"loss": rows["loss"].double().sum().item() / max(pairs, 1.0), "pairs": pairs}
        return metrics | {
            name: value / max(pairs, 1.0) for name, value in zip(self.stats, sums, strict=True)
        }

    def after_training(
        self, model: torch.nn.Module, data: PreferenceData, run: RunContext
    ) -> dict[str, Any]:
        """Greedy answers to held-out prompts (:func:`chat.answer_held_out`)."""
        return self.chat.answer_held_out(model, data, run)


class PairCollator:
    """Pads a batch of pairs: the chosen rows, then the rejected rows, with ``attention_mask``;
    or (``pair_rows``) one row per pair, chosen then rejected, with ``position_ids``; or
    (``layout.flat``) every side in one row without padding (:func:`chat.flat_rows`,
    ``sequence`` naming each token's pair).
    ``chosen_labels`` / ``rejected_labels`` label one side each, ``index`` is each pair's
    position in its split, and ``reference_logps`` the precomputed reference (when set);
    ``chosen_sequence_labels`` (``sequence_nll``, ORPO) label the chosen side's every token."""

    def __init__(
        self,
        pad_token_id: int,
        pair_rows: bool,
        sequence_nll: bool = False,
        layout: Layout | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.pair_rows = pair_rows
        self.sequence_nll = sequence_nll
        self.layout = layout or Layout()
        self.pad_to_multiple_of: int | None = None  # the loop sets trainer.pad_to_multiple_of
        self.reference: torch.Tensor | None = None  # (pairs of the split, 2), when precomputed

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.layout.flat:
            return self._flat(pairs)
        if self.pair_rows:
            rows = [self._joined(p) for p in pairs]
        else:
            rows = [
                {
                    "input_ids": p[f"{side}_input_ids"],
                    f"{side}_labels": p[f"{side}_labels"],
                    f"{other}_labels": [chat.IGNORE_INDEX] * len(p[f"{side}_input_ids"]),
                    "chosen_sequence_labels": list(p[f"{side}_input_ids"])
                    if side == "chosen"
                    else [chat.IGNORE_INDEX] * len(p[f"{side}_input_ids"]),
                }
                for side, other in (("chosen", "rejected"), ("rejected", "chosen"))
                for p in pairs
            ]
        longest = chat.padded_length(rows, self.pad_to_multiple_of)
        ignore = chat.IGNORE_INDEX
        batch = {
            "input_ids": chat.pad_rows(rows, "input_ids", self.pad_token_id, longest),
            "chosen_labels": chat.pad_rows(rows, "chosen_labels", ignore, longest),
            "rejected_labels": chat.pad_rows(rows, "rejected_labels", ignore, longest),
            "index": torch.tensor([p["index"] for p in pairs]),
        }
        if self.sequence_nll:
            batch["chosen_sequence_labels"] = chat.pad_rows(
                rows, "chosen_sequence_labels", ignore, longest
            )
        if self.pair_rows:
            batch["position_ids"] = chat.pad_rows(rows, "position_ids", 0, longest)
        else:
            batch["attention_mask"] = chat.attention_mask(rows, longest)
        if self.reference is not None:
            batch[chat.reference.BATCH_LOGPS] = self.reference[batch["index"]]
        return batch

    def _flat(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        labels = ["chosen_labels", "rejected_labels"]
        labels += ["chosen_sequence_labels"] if self.sequence_nll else []
        sides = []
        for group, pair in enumerate(pairs):
            joined = self._joined(pair)
            cut = len(pair["chosen_input_ids"])
            for part in (slice(0, cut), slice(cut, None)):  # chosen, rejected
                sides.append(
                    {k: joined[k][part] for k in ("input_ids", *labels)} | {"group": group}
                )
        batch = chat.flat_rows(sides, labels, self.pad_token_id, self.pad_to_multiple_of)
        batch["index"] = torch.tensor([p["index"] for p in pairs])
        if self.reference is not None:
            batch[chat.reference.BATCH_LOGPS] = self.reference[batch["index"]]
        return batch

    @staticmethod
    def _joined(pair: Mapping[str, Any]) -> dict[str, list[int]]:
        chosen, rejected = pair["chosen_input_ids"], pair["rejected_input_ids"]
        return {
            "input_ids": list(chosen) + list(rejected),
            "chosen_labels": list(pair["chosen_labels"]) + [chat.IGNORE_INDEX] * len(rejected),
            "rejected_labels": [chat.IGNORE_INDEX] * len(chosen) + list(pair["rejected_labels"]),
            "chosen_sequence_labels": list(chosen) + [chat.IGNORE_INDEX] * len(rejected),
            "position_ids": list(range(len(chosen))) + list(range(len(rejected))),
        }


def _with_chosen_reply(row: Mapping[str, Any]) -> tuple[list, str]:
    """A held-out prompt, with its chosen reply as the reference."""
    return row["prompt"], row["chosen"][0]["content"]
