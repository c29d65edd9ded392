"""Kahneman-Tversky optimisation of a causal LM on unpaired rows (``task=kto``).

KTO (Ethayarajh et al., 2024) learns from completions judged one at a time, desirable or not,
rather than from pairs. This task follows TRL 1.16's ``KTOTrainer``
(``trl/trainer/kto_trainer.py``, ``kto_config.py``), whose defaults are: ``loss_type="kto"``,
``beta=0.1``, ``desirable_weight=1.0``, ``undesirable_weight=1.0``, ``max_length=1024``,
``disable_dropout=True``, ``precompute_ref_log_probs=False``, ``learning_rate=1e-6`` and
``train_sampling_strategy="sequential"`` (below: why this loop shuffles).

* Rows (:mod:`recipes.tasks.chat.unpaired`): TRL's ``prompt`` / ``completion`` / ``label``, text or
  messages, or preference pairs unpaired as TRL unpairs them. Each row is rendered with the chat
  template as DPO renders a side and labelled on its completion only.
* The reference, as DPO's (:mod:`recipes.tasks.chat.reference`): under LoRA the model with its
  adapter disabled, else a frozen copy of the starting weights, or (for ``apo_zero_unpaired``
  only) its log-probabilities precomputed once.
* The KL estimate (``loss_type=kto``): each row's prompt is paired with the completion of the
  row before it in the micro-batch, the first with the last's, as TRL's
  ``add_kl_completion_ids`` rotates completions by one within each batch:
  (x1, y1) ... (xn, yn) -> (x1, yn), (x2, y1) ... (xn, yn-1). As in TRL's
  ``DataCollatorForUnpairedPreference``, the whole prompt meets the whole completion (not
  what ``max_seq_length`` left of it in its own row) and only the assembled row is cut at
  ``max_seq_length``, at its end. The policy's and reference's
  summed log-probs of those completions (both without gradient, as TRL) give
  ``kl = mean(policy - reference)`` over the micro-batch, averaged over the processes (TRL
  gathers it), clamped at 0 and detached. It depends on which rows share a micro-batch: the
  per-device batch size changes it (a batch of one gives a row its own completion, which TRL
  refuses; so does this task), as does accumulation (each micro-batch has its own).
* The loss per row (:mod:`recipes.losses.kto`; ``kto``): desirable
  ``1 - sigmoid(beta * (log-ratio - kl))``, undesirable
  ``1 - sigmoid(beta * (kl - log-ratio))``, where log-ratio is log pi(y|x) - log pi_ref(y|x)
  summed over the completion; ``apo_zero_unpaired``: ``1 - sigmoid(beta * log-ratio)`` and
  ``sigmoid(beta * log-ratio)``, no KL. Desirable rows weigh ``desirable_weight``, undesirable
  ones ``undesirable_weight``; TRL averages the weighted losses over the batch's rows. Here each
  row is one term of a :class:`SummedLoss`, so the step's gradient is the mean over all its rows
  on all processes, however they fall into micro-batches (TRL's is the mean of its micro-batches'
  means: the same with equal micro-batches).
* Metrics. Training logs the loop's per-term sums divided by the rows of the log window:
  ``kl`` (each row carries its micro-batch's estimate), ``rewards/chosen_sum``,
  ``rewards/rejected_sum``, ``logps/chosen_sum``, ``logps/rejected_sum`` (sums over the
  desirable / undesirable rows, per row of the window) and ``count/chosen``,
  ``count/rejected`` (their shares of the rows): ``rewards/chosen_sum / count/chosen`` is TRL's
  ``rewards/chosen`` over the window, as TRL 0.x computed it from the same names. Evaluation
  gives TRL's own means as well: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
  ``logps/chosen``, ``logps/rejected``, and ``kl`` averaged over the evaluation batches (each
  row carries its batch's share, so the batches' mean comes out of the gathered rows).

Where this differs from TRL: TRL fixes the KL pairs when it prepares the data (chunks of
``per_device_train_batch_size`` in dataset order) and therefore trains in dataset order; here the
pairs are made in the collator from each micro-batch as drawn, so the loader may shuffle, and
the mismatched completions are always the batch's own (what TRL's comment asks for); in
evaluation they are the evaluation batch's (TRL's come from chunks of the training batch size).
In turn,
reference log-probs of those pairs cannot be precomputed: ``precompute_reference`` is for
``apo_zero_unpaired``. Labels stop at the end-of-turn token, as SFT and DPO label them, where
TRL labels everything after the prompt (the same tokens with a template that writes nothing
after it, as llama3's; zephyr's newline after EOS is TRL's only extra token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from recipes.config import ConfigError, DataConfig
from recipes.log import get_logger
from recipes.losses.kto import STATS, kl_estimate, kto_loss
from recipes.tasks import chat
from recipes.tasks.base import Averaging, Layout, LossShape, RunContext, SummedLoss, Task
from recipes.tasks.chat import PreferenceData, PromptAnswers, token_losses
from recipes.tasks.configs.kto import LOSS_TYPES, KtoConfig  # noqa: F401  (re-exported)

log = get_logger(__name__)

FEATURES_VERSION = 4  # bump when feature building changes, to invalidate cached features


# TRL refuses per_device_train_batch_size=1 for the same reason. A last micro-batch of one row
# (the split's remainder) is let through, as TRL's last KL chunk of one row is.
_ONE_ROW = (
    "task=kto: {key}=1 puts each row alone in its micro-batch, so its KL completion is its own "
    "and the KL estimate is its reward; set {key}=2 or more, or task.loss_type=apo_zero_unpaired "
    "(no KL term)."
)


class KahnemanTversky(Task[PreferenceData]):
    """KTO (``task=kto``); its settings: :class:`recipes.tasks.configs.kto.KtoConfig`."""

    auto_model_class = AutoModelForCausalLM
    # Its losses read the logits a chunk at a time (trainer.fused_linear_loss).
    fused_linear_loss = True
    args: KtoConfig
    parts = ("reference",)

    def __init__(self, args: KtoConfig) -> None:
        super().__init__(args)
        self.against_reference = chat.AgainstReference(
            args,
            "kto",
            FEATURES_VERSION,
            rows="rows",
            fsdp_fix=(
                "train LoRA adapters (peft=lora), or with task.loss_type=apo_zero_unpaired set "
                "task.precompute_reference=true."
            ),
        )
        self.chat = self.against_reference.features(("row", "its completion"))
        self.predictor = PromptAnswers(self.chat, args.format)
        # Chosen in before_training; until then, batches carry their reference's log-probs.
        self.reference = chat.reference.Reference.from_batches()

    @property
    def uses_kl(self) -> bool:
        return self.args.loss_type == "kto"

    def loss_shape(self) -> LossShape:
        """One summed term per row, :data:`STATS` summed beside it."""
        return LossShape(Averaging.sum, terms_per_example=1, stats=STATS)

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PreferenceData:
        rows = self.chat.read_splits(
            cfg, tokenizer, chat.unpaired.read_unpaired, chat.unpaired.normalise, self._tokenize
        )
        features = {}
        for role, built in rows.features.items():
            self._report(role, rows.rows[role], built)
            features[role] = built.remove_columns(["cut"])
        self._check_weights(features["train"])
        held_out = chat.held_out_prompts(
            rows.rows["eval"], self.args.num_generations, _desirable_reply
        )
        return self.against_reference.data(
            cfg,
            features,
            rows.keys,
            lambda layout: UnpairedCollator(
                tokenizer.pad_token_id, self.args.max_seq_length, self.uses_kl, layout
            ),
            rows.template.data_fields(held_out),
        )

    def _report(self, role: str, rows: Dataset, built: Dataset) -> None:
        """How many rows became features, and how many the length policy cut or dropped (as
        SFT reports it): a row whose prompt alone fills ``max_seq_length`` keeps no completion
        token once cut, so it is dropped even under ``truncation=truncate``."""
        desirable = sum(built["label"])
        log.info(
            "%s: %d rows -> %d features (%d desirable, %d undesirable); longer than "
            "task.max_seq_length=%d: %d truncated, %d dropped (task.truncation=%s; a truncated "
            "row left with no completion token is dropped too)",
            role,
            len(rows),
            len(built),
            desirable,
            len(built) - desirable,
            self.args.max_seq_length,
            sum(built["cut"]),
            len(rows) - len(built),
            self.args.truncation,
        )

    def _check_weights(self, train: Dataset) -> None:
        """TRL's warning: with unequal numbers of desirable and undesirable rows, the weights
        should bring their weighted counts within Eq. (8) of the KTO paper's range [1, 4/3]."""
        desirable = max(sum(train["label"]), 1)
        undesirable = max(len(train) - desirable, 1)
        if desirable == undesirable:
            return
        ratio_d = undesirable * self.args.undesirable_weight / desirable
        ratio_u = desirable * self.args.desirable_weight / undesirable
        d_range = (round(ratio_d, 2), round(ratio_d * 1.33, 2))
        u_range = (round(ratio_u / 1.33, 2), round(ratio_u, 2))
        if not (
            d_range[0] <= self.args.desirable_weight <= d_range[1]
            or u_range[0] <= self.args.undesirable_weight <= u_range[1]
        ):
            log.warning(
                "train: %d desirable and %d undesirable rows, and the weights do not balance "
                "them (KTO paper, Eq. 8): set EITHER task.desirable_weight in [%s, %s] OR "
                "task.undesirable_weight in [%s, %s]",
                desirable,
                undesirable,
                *d_range,
                *u_range,
            )

    def _tokenize(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        source: str,
    ) -> dict[str, list]:
        out: dict[str, list] = {
            "input_ids": [],
            "labels": [],
            "prompt_length": [],
            "tail_ids": [],
            "tail_labels": [],
            "label": [],
            "cut": [],
        }
        columns = ("prompt", "completion", "label", "tools", "text", "place")
        for prompt, completion, label, tools, text, place in zip(
            *(batch[k] for k in columns), strict=True
        ):
            if text and self.args.text_rows == "raw":
                whole = chat.tokenize_text(
                    tokenizer, prompt[0]["content"], [completion[0]["content"]]
                )[0]
            else:
                whole = chat.templated_reply(
                    tokenizer, template, prompt, completion, tools, f"{source} {place}"
                )
            fitted = self.chat.fit(whole)
            if fitted is None:
                continue
            labelled = [i for i, t in enumerate(fitted["labels"]) if t != chat.IGNORE_INDEX]
            if not labelled:
                continue
            out["input_ids"].append(fitted["input_ids"])
            out["labels"].append(fitted["labels"])
            # Where the completion starts: a KL row is this prompt and another row's completion.
            out["prompt_length"].append(labelled[0])
            # What the length cut took off the completion, up to max_seq_length completion
            # tokens in all (no KL row holds more): a KL row pairs another row's prompt with
            # this whole completion, as TRL's. Typed arrays: a map batch of empty lists would
            # be typed null, and a later batch's tokens could not be written next to it.
            rest = slice(len(fitted["input_ids"]), labelled[0] + self.args.max_seq_length)
            out["tail_ids"].append(np.asarray(whole["input_ids"][rest], dtype=np.int64))
            out["tail_labels"].append(np.asarray(whole["labels"][rest], dtype=np.int64))
            out["label"].append(bool(label))
            out["cut"].append(len(fitted["input_ids"]) < len(whole["input_ids"]))
        return out

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        setting = chat.padding_free_setting(self.args.padding_free)
        self.chat.check_model(model, packing=setting == "true")

    def flat_batches(self, model: torch.nn.Module) -> bool:
        """The batches' layout under the model's attention (:func:`chat.flat_batches`)."""
        return chat.flat_batches(self.args.padding_free, model)

    @property
    def evaluates_against_start(self) -> bool:
        """Its rewards and KL compare the model with its reference."""
        return True

    def before_training(
        self, model: torch.nn.Module, data: PreferenceData, run: RunContext, batch_size: int
    ) -> None:
        """The reference, as DPO's (:mod:`recipes.tasks.chat.reference`), from the starting
        weights; micro-batches of one row refused where the KL term pairs rows."""
        sizes = {"eval": batch_size, "train": run.train_batch_size}
        for split, size in sizes.items():
            if self.uses_kl and size is not None and size < 2:
                raise ConfigError(_ONE_ROW.format(key=f"trainer.per_device_{split}_batch_size"))
        self.reference = self.against_reference.reference(
            model, data, run.accelerator, batch_size, self._reference_forward
        )

    def _reference_forward(self, model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
        return self._logps_of(model, batch)[0]

    def _logps_of(
        self, model: torch.nn.Module, batch: Mapping
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the summed log-probability of its completion and of its KL completion
        (another row's, without gradient, as TRL; 0 without a KL term), and their tokens: two
        (rows, 2) tensors (the layout the precomputed reference keeps)."""
        nll, count = _row_losses(model, batch, "", len(batch["label"]))
        if "KL_input_ids" in batch:
            with torch.no_grad():
                kl_nll, kl_count = _row_losses(model, batch, "KL_", len(batch["label"]))
        else:
            kl_nll, kl_count = torch.zeros_like(nll), torch.zeros_like(count)
        return torch.stack([-nll, -kl_nll], dim=1), torch.stack([count, kl_count], dim=1)

    def batch_kl(
        self,
        policy: torch.Tensor,
        reference: torch.Tensor,
        accelerator: Accelerator | None = None,
    ) -> torch.Tensor:
        """TRL's KL estimate (:func:`recipes.losses.kto.kl_estimate`) from the (rows, 2)
        log-probs, averaged over the run's processes; 0 without a KL term."""
        if not self.uses_kl:
            return torch.zeros((), device=policy.device)
        return kl_estimate(policy[:, 1], reference[:, 1], _process_mean(accelerator))

    @property
    def loss_settings(self) -> dict[str, Any]:
        """The settings :func:`recipes.losses.kto.kto_loss` reads."""
        args = self.args
        return {
            "beta": args.beta,
            "loss_type": args.loss_type,
            "desirable_weight": args.desirable_weight,
            "undesirable_weight": args.undesirable_weight,
        }

    def _row_terms(
        self, model: torch.nn.Module, batch: Mapping, accelerator: Accelerator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reference = self.reference.logps(model, batch, self._reference_forward)
        policy, _ = self._logps_of(model, batch)
        kl = self.batch_kl(policy, reference, accelerator)
        return kto_loss(policy[:, 0], reference[:, 0], batch["label"], kl, **self.loss_settings)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The rows' summed weighted loss and their count; :data:`STATS` summed over them."""
        return chat.reference.summed_loss(model, STATS, lambda: self._row_terms(model, batch))

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        losses, stats = self._row_terms(model, batch)
        # Each row's share of its batch: the batches' mean KL from the gathered rows.
        share = torch.full_like(losses, 1 / len(losses))
        return {"loss": losses, "stats": stats, "share": share}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: PreferenceData, run: RunContext
    ) -> dict[str, float]:
        """The mean loss over the held-out rows, TRL's means of the desirable and undesirable
        rows' rewards and log-probs, and the KL averaged over the batches."""
        count = float(len(rows["loss"]))
        stats, share = rows["stats"].double(), rows["share"].double()
        named = dict(zip(STATS[1:], stats[:, 1:].sum(0).tolist(), strict=True))
        metrics = {"loss": rows["loss"].double().sum().item() / max(count, 1.0), "rows": count}
        metrics["kl"] = (stats[:, 0] * share).sum().item() / max(share.sum().item(), 1e-12)
        metrics |= {name: value / max(count, 1.0) for name, value in named.items()}
        for side in ("chosen", "rejected"):
            chosen = named[f"count/{side}"]
            for what in ("rewards", "logps"):
                metrics[f"{what}/{side}"] = named[f"{what}/{side}_sum"] / max(chosen, 1.0)
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics

    def after_training(
        self, model: torch.nn.Module, data: PreferenceData, run: RunContext
    ) -> dict[str, Any]:
        """Greedy answers to held-out prompts (:func:`chat.answer_held_out`)."""
        return self.chat.answer_held_out(model, data, run)


def _process_mean(
    accelerator: Accelerator | None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The mean of a 0-d tensor over the run's processes (TRL gathers its KL estimate): over
    ``accelerator``'s, or where none is given over torch.distributed's; None for one."""
    if accelerator is not None:
        if accelerator.num_processes > 1:
            return lambda value: accelerator.gather(value.reshape(1)).mean()
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return lambda value: gather(value.reshape(1)).mean()  # accelerate's state
    return None


def _row_losses(
    model: torch.nn.Module, batch: Mapping, prefix: str, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the summed NLL of its labels (those of the ``prefix``-ed columns: the rows or
    their KL rows) and their count, from padded rows or a padding-free row."""
    if f"{prefix}sequence" in batch:
        inputs = {k: batch[f"{prefix}{k}"] for k in ("input_ids", "position_ids")}
        logits = chat.forward(model, inputs, lazy_head=True).logits
        labels, sequence = batch[f"{prefix}labels"], batch[f"{prefix}sequence"]
        return chat.sequence_losses(logits, labels, sequence, rows)
    inputs = {k: batch[f"{prefix}{k}"] for k in ("input_ids", "attention_mask")}
    logits = chat.forward(model, inputs, lazy_head=True).logits
    return token_losses(logits, batch[f"{prefix}labels"])


class UnpairedCollator:
    """Pads a batch of rows: ``input_ids``, ``attention_mask``, ``labels`` (the completion's),
    ``label`` (desirable or not) and ``index`` (each row's position in its split); with ``kl``,
    the KL rows too (``KL_input_ids``, ``KL_attention_mask``, ``KL_labels``): each row's prompt
    with the whole completion of the row before it in the batch (the first row's from the
    last), the assembled row cut to ``max_length``, as TRL's ``add_kl_completion_ids`` and
    ``DataCollatorForUnpairedPreference`` build them; ``reference_logps`` the precomputed
    reference (when set). With ``layout.flat`` the rows (and the KL rows) are one row each
    without padding, ``position_ids`` and ``sequence`` (each token's row) in place of the mask
    (:func:`chat.flat_rows`)."""

    def __init__(
        self, pad_token_id: int, max_length: int, kl: bool, layout: Layout | None = None
    ) -> None:
        self.pad_token_id = pad_token_id
        self.truncate_at = max_length
        self.kl = kl
        self.layout = layout or Layout()
        self.pad_to_multiple_of: int | None = None  # the loop sets trainer.pad_to_multiple_of
        self.reference: torch.Tensor | None = None  # (rows of the split, 2), when precomputed

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self._padded(
            [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows], ""
        )
        if self.kl:
            shifted = [rows[-1], *rows[:-1]]  # TRL: [completions[-1]] + completions[:-1]
            kl_rows = [self._kl_row(row, other) for row, other in zip(rows, shifted, strict=True)]
            batch |= self._padded(kl_rows, "KL_")
        batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
        batch["index"] = torch.tensor([r["index"] for r in rows])
        if self.reference is not None:
            batch[chat.reference.BATCH_LOGPS] = self.reference[batch["index"]]
        return batch

    def _kl_row(self, row: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, list[int]]:
        """``row``'s prompt and ``other``'s whole completion (its tail the length cut took off
        put back), then cut to ``max_length``: TRL's collator cuts the assembled row."""
        cut, start = row["prompt_length"], other["prompt_length"]
        ids = [*row["input_ids"][:cut], *other["input_ids"][start:], *other["tail_ids"]]
        labels = [chat.IGNORE_INDEX] * cut
        labels += [*other["labels"][start:], *other["tail_labels"]]
        return {"input_ids": ids[: self.truncate_at], "labels": labels[: self.truncate_at]}

    def _padded(self, rows: list[dict[str, Any]], prefix: str) -> dict[str, torch.Tensor]:
        if self.layout.flat:
            rows = [{**row, "group": group} for group, row in enumerate(rows)]
            return chat.flat_rows(
                rows, ["labels"], self.pad_token_id, self.pad_to_multiple_of, prefix
            )
        longest = chat.padded_length(rows, self.pad_to_multiple_of)
        ignore = chat.IGNORE_INDEX
        return {
            f"{prefix}input_ids": chat.pad_rows(rows, "input_ids", self.pad_token_id, longest),
            f"{prefix}attention_mask": chat.attention_mask(rows, longest),
            f"{prefix}labels": chat.pad_rows(rows, "labels", ignore, longest),
        }


def _desirable_reply(row: Mapping[str, Any]) -> tuple[list, str] | None:
    """A desirable held-out row's prompt, its completion the reference (None: undesirable)."""
    return (row["prompt"], row["completion"][0]["content"]) if row["label"] else None
