"""Kahneman-Tversky optimisation of a causal LM on unpaired rows (``task=kto``).

KTO (Ethayarajh et al., 2024) learns from completions judged one at a time, desirable or not,
rather than from pairs. This task follows TRL 1.16's ``KTOTrainer``
(``trl/trainer/kto_trainer.py``, ``kto_config.py``), whose defaults are: ``loss_type="kto"``,
``beta=0.1``, ``desirable_weight=1.0``, ``undesirable_weight=1.0``, ``max_length=1024``,
``disable_dropout=True``, ``precompute_ref_log_probs=False``, ``learning_rate=1e-6`` and
``train_sampling_strategy="sequential"`` (below: why this loop shuffles).

* Rows (:mod:`recipes.tasks.unpaired`): TRL's ``prompt`` / ``completion`` / ``label``, text or
  messages, or preference pairs unpaired as TRL unpairs them. Each row is rendered with the chat
  template as DPO renders a side and labelled on its completion only.
* The reference, exactly as DPO's (:meth:`DirectPreference.before_training`): under LoRA the
  model with its adapter disabled, else a frozen copy of the starting weights, or (for
  ``apo_zero_unpaired`` only) its log-probabilities precomputed once. Its log lines read
  "DPO reference" (they are DPO's).
* The KL estimate (``loss_type=kto``): each row's prompt is paired with the completion of the
  row before it in the micro-batch, the first with the last's, as TRL's
  ``add_kl_completion_ids`` rotates completions by one within each batch:
  (x1, y1) ... (xn, yn) -> (x1, yn), (x2, y1) ... (xn, yn-1). The policy's and reference's
  summed log-probs of those completions (both without gradient, as TRL) give
  ``kl = mean(policy - reference)`` over the micro-batch, averaged over the processes (TRL
  gathers it), clamped at 0 and detached. It depends on which rows share a micro-batch: the
  per-device batch size changes it (a batch of one gives a row its own completion, which TRL
  refuses; so does this task), as does accumulation (each micro-batch has its own).
* The loss per row (``kto``): desirable ``1 - sigmoid(beta * (log-ratio - kl))``, undesirable
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
  ``logps/chosen``, ``logps/rejected``, and ``kl`` averaged over the evaluation batches.

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

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from recipes import adapters
from recipes import data as data_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.log import get_logger
from recipes.tasks import conversations, unpaired
from recipes.tasks.base import SummedLoss
from recipes.tasks.dpo import DirectPreference, PreferenceData
from recipes.tasks.sft import _add_template_tokens, _answerable, _end_of_turn
from recipes.tasks.token_loss import token_losses

log = get_logger(__name__)

FEATURES_VERSION = 1
LOSS_TYPES = ("kto", "apo_zero_unpaired")
# Summed over rows, logged divided by the rows (SummedLoss.stats); see the module's docstring.
STATS = (
    "kl",
    "rewards/chosen_sum",
    "rewards/rejected_sum",
    "logps/chosen_sum",
    "logps/rejected_sum",
    "count/chosen",
    "count/rejected",
)


# TRL refuses per_device_train_batch_size=1 for the same reason. A last micro-batch of one row
# (the split's remainder) is let through, as TRL's last KL chunk of one row is.
_ONE_ROW = (
    "task=kto: {key}=1 puts each row alone in its micro-batch, so its KL completion is its own "
    "and the KL estimate is its reward; set {key}=2 or more, or task.loss_type=apo_zero_unpaired "
    "(no KL term)."
)


class KahnemanTversky(DirectPreference):
    """KTO (``task=kto``).

    Args:
        format: layout of the rows: auto (detected per row), unpaired (TRL's prompt /
            completion / label), or a pair layout (explicit, implicit, ultrafeedback) unpaired.
        chat_template: null (the tokenizer's), a name (chatml, llama3, zephyr) or a Jinja file.
        text_rows: plain-string rows as chat turns (chat) or as text, as TRL (raw).
        max_seq_length: tokens of prompt and completion per row (a KL row is cut to it too).
        truncation: truncate (cut the end of a long row) or drop the row.
        beta: strength of the pull to the reference (TRL's default 0.1).
        loss_type: kto (with the KL estimate) or apo_zero_unpaired (without).
        desirable_weight: weight of a desirable row's loss (TRL's default 1.0).
        undesirable_weight: weight of an undesirable row's loss (TRL's default 1.0).
        precompute_reference: the reference's log-probs computed once (apo_zero_unpaired only).
        disable_dropout: no dropout in the model (TRL's default).
        num_generations: held-out prompts answered greedily after training (0: none).
        generation_max_new_tokens: length limit of those answers.
    """

    logged_stats = STATS
    _row_words = ("row", "its completion")

    def __init__(
        self,
        *,
        format: str,
        chat_template: str | None,
        max_seq_length: int,
        truncation: str,
        beta: float,
        loss_type: str,
        desirable_weight: float,
        undesirable_weight: float,
        precompute_reference: bool,
        disable_dropout: bool,
        num_generations: int,
        generation_max_new_tokens: int,
        generation: Mapping[str, Any] | GenerationConfig | None,
        text_rows: str,
    ) -> None:
        if format not in unpaired.FORMATS:
            raise ConfigError(f"task.format={format!r}: choose {', '.join(unpaired.FORMATS)}.")
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"task.loss_type={loss_type!r}: choose {', '.join(LOSS_TYPES)}.")
        for name, weight in (("desirable", desirable_weight), ("undesirable", undesirable_weight)):
            if not weight >= 0:
                raise ConfigError(
                    f"task.{name}_weight={weight}: must be >= 0 (TRL's default is 1.0)."
                )
        if not desirable_weight + undesirable_weight > 0:
            raise ConfigError("task.desirable_weight and task.undesirable_weight are both 0.")
        if precompute_reference and loss_type == "kto":
            raise ConfigError(
                "task.precompute_reference=true with task.loss_type=kto: the KL estimate pairs "
                "each row's prompt with another completion of its micro-batch, drawn anew each "
                "epoch, so the reference's log-probs of those pairs cannot be computed beforehand; "
                "keep the reference live (the LoRA adapter disabled, or a frozen copy), or use "
                "task.loss_type=apo_zero_unpaired (no KL term)."
            )
        super().__init__(
            format="auto",
            chat_template=chat_template,
            max_seq_length=max_seq_length,
            truncation=truncation,
            beta=beta,
            loss_type="sigmoid",  # DPO's own setting, unused here
            label_smoothing=0.0,
            simpo_gamma=0.0,
            nll_weight=0.0,
            precompute_reference=precompute_reference,
            padding_free=False,
            disable_dropout=disable_dropout,
            num_generations=num_generations,
            generation_max_new_tokens=generation_max_new_tokens,
            generation=generation,
            text_rows=text_rows,
        )
        self.format = format
        self.loss_type = loss_type
        self.logged_stats = STATS  # DirectPreference sets its own for its loss type
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight
        self._accelerator: Accelerator | None = None  # set in before_training: the KL's gather
        self._batches_seen = False  # a run's first micro-batch of one row: the batch size is 1

    @property
    def uses_kl(self) -> bool:
        return self.loss_type == "kto"

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PreferenceData:
        template = self._template(tokenizer)
        new_tokens = _add_template_tokens(tokenizer, self.chat_template)
        tokenizer.chat_template = template  # saved with it: final/ renders prompts as trained
        splits = data_lib.load_splits(cfg, lambda path: unpaired.read_unpaired(path, self.format))
        features, rows, keys = {}, {}, {}
        for role, split in splits.items():
            rows[role] = unpaired.normalise(split.examples, self.format, split.source)
            keys[role], built = self._tokenized(
                cfg, tokenizer, template, role, split, rows[role], "kto", FEATURES_VERSION
            )
            self._report(role, rows[role], built)
            features[role] = built.add_column("index", list(range(len(built))))
        self._check_weights(features["train"])
        return PreferenceData(
            feature_keys=keys,
            cache=data_lib.cache_root(cfg),
            train=features["train"],
            eval=features["eval"],
            train_collator=UnpairedCollator(
                tokenizer.pad_token_id, self.max_seq_length, self.uses_kl
            ),
            eval_collator=UnpairedCollator(
                tokenizer.pad_token_id, self.max_seq_length, self.uses_kl
            ),
            template=template,
            prompts=_answerable(_held_out_prompts(rows["eval"], self.num_generations), template),
            new_tokens=new_tokens,
            stop_tokens=_end_of_turn(tokenizer, template),
        )

    def _report(self, role: str, rows: Dataset, built: Dataset) -> None:
        desirable = sum(built["label"])
        log.info(
            "%s: %d rows -> %d features (%d desirable, %d undesirable); a row longer than "
            "task.max_seq_length=%d is %s",
            role,
            len(rows),
            len(built),
            desirable,
            len(built) - desirable,
            self.max_seq_length,
            "cut at its end" if self.truncation == "truncate" else "dropped",
        )

    def _check_weights(self, train: Dataset) -> None:
        """TRL's warning: with unequal numbers of desirable and undesirable rows, the weights
        should bring their weighted counts within Eq. (8) of the KTO paper's range [1, 4/3]."""
        desirable = max(sum(train["label"]), 1)
        undesirable = max(len(train) - desirable, 1)
        if desirable == undesirable:
            return
        ratio_d = undesirable * self.undesirable_weight / desirable
        ratio_u = desirable * self.desirable_weight / undesirable
        d_range = (round(ratio_d, 2), round(ratio_d * 1.33, 2))
        u_range = (round(ratio_u / 1.33, 2), round(ratio_u, 2))
        if not (
            d_range[0] <= self.desirable_weight <= d_range[1]
            or u_range[0] <= self.undesirable_weight <= u_range[1]
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
        out: dict[str, list] = {"input_ids": [], "labels": [], "prompt_length": [], "label": []}
        columns = ("prompt", "completion", "label", "tools", "text", "place")
        for prompt, completion, label, tools, text, place in zip(
            *(batch[k] for k in columns), strict=True
        ):
            if text and self.text_rows == "raw":
                whole = conversations.tokenize_text(
                    tokenizer, prompt[0]["content"], [completion[0]["content"]]
                )[0]
            else:
                whole = self._templated_reply(
                    tokenizer, template, prompt, completion, tools, f"{source} {place}"
                )
            fitted = conversations.fit_length(whole, self.max_seq_length, self.truncation)
            if fitted is None:
                continue
            labelled = [
                i for i, t in enumerate(fitted["labels"]) if t != conversations.IGNORE_INDEX
            ]
            if not labelled:
                continue
            out["input_ids"].append(fitted["input_ids"])
            out["labels"].append(fitted["labels"])
            # Where the completion starts: a KL row is this prompt and another row's completion.
            out["prompt_length"].append(labelled[0])
            out["label"].append(bool(label))
        return out

    # ------------------------------------------------------------------------------ model

    def before_training(
        self,
        model: torch.nn.Module,
        data: PreferenceData,
        accelerator: Accelerator,
        batch_size: int,
    ) -> None:
        """DPO's choice of reference (see :meth:`DirectPreference.before_training`)."""
        self._accelerator = accelerator
        if self.uses_kl and batch_size < 2:
            raise ConfigError(_ONE_ROW.format(key="trainer.per_device_eval_batch_size"))
        peft = adapters.is_peft_model(accelerator.unwrap_model(model))
        fsdp = accelerator.distributed_type == DistributedType.FSDP
        if fsdp and not peft and not self.precompute_reference:
            raise ConfigError(
                "task=kto with full fine-tuning under FSDP: the frozen reference copy cannot be "
                "sharded here; train LoRA adapters (peft=lora), or with "
                "task.loss_type=apo_zero_unpaired set task.precompute_reference=true."
            )
        super().before_training(model, data, accelerator, batch_size)

    def _logps_of(
        self, model: torch.nn.Module, batch: Mapping
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the summed log-probability of its completion and of its KL completion
        (another row's, without gradient, as TRL; 0 without a KL term), and their tokens: two
        (rows, 2) tensors (the layout DPO's reference machinery keeps)."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        nll, count = token_losses(self.forward(model, inputs).logits, batch["labels"])
        if "KL_input_ids" in batch:
            with torch.no_grad():
                kl_inputs = {
                    "input_ids": batch["KL_input_ids"],
                    "attention_mask": batch["KL_attention_mask"],
                }
                logits = self.forward(model, kl_inputs).logits
                kl_nll, kl_count = token_losses(logits, batch["KL_labels"])
        else:
            kl_nll, kl_count = torch.zeros_like(nll), torch.zeros_like(count)
        return torch.stack([-nll, -kl_nll], dim=1), torch.stack([count, kl_count], dim=1)

    def batch_kl(
        self,
        policy: torch.Tensor,
        reference: torch.Tensor,
        accelerator: Accelerator | None = None,
    ) -> torch.Tensor:
        """TRL's KL estimate from the (rows, 2) log-probs: the mean over the micro-batch of the
        KL completions' log-ratios, averaged over the processes, clamped at 0, detached."""
        if not self.uses_kl:
            return torch.zeros((), device=policy.device)
        kl = (policy[:, 1] - reference[:, 1]).mean().detach()
        accelerator = accelerator or self._accelerator
        if accelerator is not None and accelerator.num_processes > 1:
            kl = accelerator.gather(kl.reshape(1)).mean()
        return kl.clamp(min=0)

    def row_losses(
        self,
        policy: torch.Tensor,
        reference: torch.Tensor,
        desirable: torch.Tensor,
        kl: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the weighted loss, from the summed log-probs of the policy and the reference
        of its completion, its label and the batch's KL; and its :data:`STATS`, (rows, 7)."""
        ratios = policy - reference
        if self.loss_type == "kto":  # Eq. (7) of the KTO paper, as TRL
            losses = torch.where(
                desirable,
                1 - torch.sigmoid(self.beta * (ratios - kl)),
                1 - torch.sigmoid(self.beta * (kl - ratios)),
            )
        else:  # apo_zero_unpaired: the unpaired variant of Eq. (7) of the APO paper
            losses = torch.where(
                desirable,
                1 - torch.sigmoid(self.beta * ratios),
                torch.sigmoid(self.beta * ratios),
            )
        weights = torch.where(
            desirable,
            torch.full_like(losses, self.desirable_weight),
            torch.full_like(losses, self.undesirable_weight),
        )
        rewards = (self.beta * ratios).detach()
        chosen, rejected = desirable.float(), (~desirable).float()
        logps = policy.detach()
        stats = torch.stack(
            [
                kl.expand_as(rewards).float(),
                rewards * chosen,
                rewards * rejected,
                logps * chosen,
                logps * rejected,
                chosen,
                rejected,
            ],
            dim=1,
        )
        return losses * weights, stats

    def _row_terms(
        self, model: torch.nn.Module, batch: Mapping, accelerator: Accelerator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reference = self._reference_logps(model, batch)
        policy, _ = self._logps_of(model, batch)
        kl = self.batch_kl(policy, reference, accelerator)
        return self.row_losses(policy[:, 0], reference[:, 0], batch["label"], kl)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The rows' summed weighted loss and their count; :data:`STATS` summed over them."""
        if self.uses_kl and len(batch["label"]) < 2 and not self._batches_seen:
            raise ConfigError(_ONE_ROW.format(key="trainer.per_device_train_batch_size"))
        self._batches_seen = True
        losses, stats = self._row_terms(model, batch)
        count = torch.tensor(float(len(losses)), device=losses.device)
        return SummedLoss(losses.sum(), count, dict(zip(STATS, stats.sum(0), strict=True)))

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Any,
        data: PreferenceData,
        accelerator: Accelerator,
        output_dir: Any,
    ) -> dict[str, float]:
        """The mean loss over the held-out rows on all processes, TRL's means of the desirable
        and undesirable rows' rewards and log-probs, and the KL averaged over the batches."""
        model.eval()
        totals = torch.zeros(2 + len(STATS), dtype=torch.float64, device=accelerator.device)
        kls = []
        for batch in loader:
            losses, stats = self._row_terms(model, batch, accelerator)
            kls.append(float(stats[0, 0]))
            per_row = torch.cat([losses[:, None], torch.ones_like(losses)[:, None], stats], dim=1)
            totals += accelerator.gather_for_metrics(per_row).sum(dim=0).double()
        model.train()
        loss, rows, _, *sums = totals.tolist()
        named = dict(zip(STATS[1:], sums, strict=True))
        metrics = {"loss": loss / max(rows, 1.0), "rows": rows}
        metrics["kl"] = sum(kls) / max(len(kls), 1)
        metrics |= {name: value / max(rows, 1.0) for name, value in named.items()}
        for side in ("chosen", "rejected"):
            count = named[f"count/{side}"]
            for what in ("rewards", "logps"):
                metrics[f"{what}/{side}"] = named[f"{what}/{side}_sum"] / max(count, 1.0)
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return broadcast_object_list([metrics])[0]


class UnpairedCollator:
    """Pads a batch of rows: ``input_ids``, ``attention_mask``, ``labels`` (the completion's),
    ``label`` (desirable or not) and ``index`` (each row's position in its split); with ``kl``,
    the KL rows too (``KL_input_ids``, ``KL_attention_mask``, ``KL_labels``): each row's prompt
    with the completion of the row before it in the batch (the first row's from the last), cut
    to ``max_length``, as TRL's ``add_kl_completion_ids`` and ``DataCollatorForUnpairedPreference``
    build them; ``reference_logps`` the precomputed reference (when set)."""

    def __init__(self, pad_token_id: int, max_length: int, kl: bool) -> None:
        self.pad_token_id = pad_token_id
        self.truncate_at = max_length
        self.kl = kl
        self.pad_to_multiple_of: int | None = None  # the loop sets trainer.pad_to_multiple_of
        self.reference: torch.Tensor | None = None  # (rows of the split, 2), when precomputed

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self._padded(
            [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows], ""
        )
        if self.kl:
            shifted = [rows[-1], *rows[:-1]]  # TRL: [completions[-1]] + completions[:-1]
            kl_rows = []
            for row, other in zip(rows, shifted, strict=True):
                cut, start = row["prompt_length"], other["prompt_length"]
                ids = list(row["input_ids"][:cut]) + list(other["input_ids"][start:])
                labels = [conversations.IGNORE_INDEX] * cut + list(other["labels"][start:])
                kl_rows.append(
                    {"input_ids": ids[: self.truncate_at], "labels": labels[: self.truncate_at]}
                )
            batch |= self._padded(kl_rows, "KL_")
        batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
        batch["index"] = torch.tensor([r["index"] for r in rows])
        if self.reference is not None:
            batch["reference_logps"] = self.reference[batch["index"]]
        return batch

    def _padded(self, rows: list[dict[str, Any]], prefix: str) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ones = [{"m": [1] * len(r["input_ids"])} for r in rows]
        return {
            f"{prefix}input_ids": conversations._pad(rows, "input_ids", self.pad_token_id, longest),
            f"{prefix}attention_mask": conversations._pad(ones, "m", 0, longest),
            f"{prefix}labels": conversations._pad(
                rows, "labels", conversations.IGNORE_INDEX, longest
            ),
        }


def _held_out_prompts(rows: Dataset, count: int) -> list[dict[str, Any]]:
    """The first ``count`` desirable evaluation rows' prompts, their completion the reference."""
    prompts = []
    for row in rows:
        if len(prompts) >= count:
            break
        if row["label"]:
            reference = row["completion"][0]["content"]
            prompts.append(
                {"messages": row["prompt"], "tools": row["tools"], "reference": reference}
            )
    return prompts
