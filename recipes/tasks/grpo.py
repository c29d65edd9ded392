"""Group relative policy optimisation on rewards that code checks (``task=grpo``).

Each micro-batch of prompts becomes a group of ``num_generations`` sampled completions per
prompt (the batched generation path, :mod:`recipes.generation`), scored by the reward functions
of ``task.rewards`` (:mod:`recipes.rewards`); rewards are normalised within each group into
advantages, and the policy takes TRL's clipped policy-gradient step. The definitions are TRL's
(``trl/trainer/grpo_trainer.py`` and ``grpo_config.py``, TRL 1.16), and so are the defaults:

* ``loss_type``: ``dapo`` (every completion token of the step weighs the same), ``grpo`` (each
  completion's token mean, then the mean over completions), ``bnpo`` (the token mean of each
  micro-batch), ``dr_grpo`` (the token sum over completions x ``max_completion_length``);
* advantages: reward minus its group's mean, divided by the group's standard deviation (n - 1)
  plus 1e-4 (``scale_rewards=group``), by the whole batch's (``batch``, over every process) or
  not at all (``none``, Dr. GRPO); a completion every reward returned None for gets advantage 0;
* the ratio to the old policy clipped to [1 - ``epsilon``, 1 + ``epsilon_high``] (0.2 each);
  log-probabilities of the completion at the sampling temperature, as TRL computes them;
* ``beta`` (0: no KL term and no reference): the k3 estimate of KL to the reference, times the
  ratio to the old policy (TRL's ``use_bias_correction_kl``); the reference is the model with its
  LoRA adapter disabled, or a frozen copy of the starting weights, as DPO's;
* ``num_iterations``: optimizer steps on each generation batch (the loop's sampler repeats each
  step's prompts that many times); the old policy's log-probabilities are taken when they are
  generated. With 1 (the default) the ratio is 1 and the old log-probs are the detached current
  ones, as in TRL.

Sampling is seeded per completion from the run's seed, the epoch and the prompt's row (never the
batch or the process), so a resumed run, or one on another number of processes, draws the same
completions from the same weights; the rollouts kept for ``num_iterations`` > 1 are saved with
each checkpoint (:class:`RolloutBuffer`). Logged, as TRL names them: ``reward``,
``reward_std``, ``rewards/<name>/mean`` and ``/std``, ``frac_reward_zero_std``,
``completions/mean_length``, ``/min_length``, ``/max_length``, ``/clipped_ratio``, ``entropy``,
``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``, ``kl`` (with ``beta``), and the
generation's own ``generation/tokens_per_second`` and ``generation/seconds``. Evaluation is the
held-out prompts' rewards of greedy completions (``eval/reward`` ranks checkpoints).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from recipes import adapters
from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes import rewards as reward_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.tasks import conversations
from recipes.tasks.base import SummedLoss
from recipes.tasks.dpo import _peft_model
from recipes.tasks.sft import (
    ChatData,
    SupervisedFineTuning,
    _add_template_tokens,
    _end_of_turn,
)

log = get_logger(__name__)

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GrpoData(ChatData):
    """Prompt features (``input_ids``, ``index``), and per split each row's prompt and other
    columns, which the rewards read."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class Rollout:
    """One micro-batch's completions and what the loss needs of them."""

    prompt_ids: torch.Tensor  # (B*G, P) left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # (B*G, C) right-padded
    completion_mask: torch.Tensor
    advantages: torch.Tensor  # (B*G,)
    old_logps: torch.Tensor | None  # (B*G, C), num_iterations > 1
    ref_logps: torch.Tensor | None  # (B*G, C), beta > 0
    stats: dict[str, float]
    uses_left: int = 0


class RolloutBuffer:
    """Rollouts generated for a later step (``num_iterations`` > 1), keyed by the epoch and the
    prompts' rows; saved with each checkpoint (``accelerator.register_for_checkpointing``), every
    process's own, so a resumed run steps on the completions and old log-probs it had."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Rollout] = {}
        self.accelerator: Accelerator | None = None

    def state_dict(self) -> dict[str, Any]:
        mine = {key: _to_cpu(value) for key, value in self.entries.items()}
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            return {"per_process": gather_object([mine])}
        return {"per_process": [mine]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rank = self.accelerator.process_index if self.accelerator else 0
        saved = state.get("per_process", [])
        device = self.accelerator.device if self.accelerator else torch.device("cpu")
        self.entries = {}
        if rank < len(saved):
            self.entries = {k: _to_device(v, device) for k, v in saved[rank].items()}


def _to_cpu(rollout: Rollout) -> Rollout:
    return _moved(rollout, torch.device("cpu"))


def _to_device(rollout: Rollout, device: torch.device) -> Rollout:
    return _moved(rollout, device)


def _moved(rollout: Rollout, device: torch.device) -> Rollout:
    values = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(rollout).items()
    }
    return Rollout(**values)


class GroupRelativePolicy(SupervisedFineTuning):
    """GRPO (``task=grpo``); see the module's docstring and conf/task/grpo.yaml."""

    main_metric = "reward"
    greater_is_better = True
    _row_words = ("prompt", "its completions")

    def __init__(
        self,
        *,
        chat_template: str | None,
        text_rows: str,
        max_prompt_length: int,
        max_completion_length: int,
        num_generations: int,
        temperature: float,
        top_p: float,
        top_k: int,
        loss_type: str,
        beta: float,
        epsilon: float,
        epsilon_high: float | None,
        num_iterations: int,
        scale_rewards: str,
        mask_truncated_completions: bool,
        rewards: Sequence[Mapping[str, Any]],
        num_held_out_answers: int,
        generation: Mapping[str, Any] | GenerationConfig | None,
    ) -> None:
        checks = (
            (loss_type in LOSS_TYPES, f"task.loss_type={loss_type!r}: choose {', '.join(LOSS_TYPES)} (TRL's; dapo is its default)."),
            (scale_rewards in SCALE_REWARDS, f"task.scale_rewards={scale_rewards!r}: choose {', '.join(SCALE_REWARDS)}."),
            (num_generations >= 2, f"task.num_generations={num_generations}: must be >= 2 (advantages compare completions of one prompt; TRL's default is 8)."),
            (num_iterations >= 1, f"task.num_iterations={num_iterations}: must be >= 1."),
            (beta >= 0, f"task.beta={beta}: must be >= 0 (0: no KL term, TRL's default)."),
            (epsilon > 0, f"task.epsilon={epsilon}: must be > 0 (TRL's default is 0.2)."),
            (epsilon_high is None or epsilon_high > 0, f"task.epsilon_high={epsilon_high}: must be > 0, or null for task.epsilon."),
            (temperature > 0, f"task.temperature={temperature}: must be > 0 (completions are sampled)."),
            (0 < top_p <= 1, f"task.top_p={top_p}: must be in (0, 1]."),
            (max_prompt_length >= 1, f"task.max_prompt_length={max_prompt_length}: must be >= 1."),
            (max_completion_length >= 1, f"task.max_completion_length={max_completion_length}: must be >= 1."),
            (bool(rewards), "task.rewards is empty: name at least one reward function (docs/configuration.md#reinforcement-learning-with-verifiable-rewards-taskgrpo)."),
        )  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        super().__init__(
            format="auto",
            chat_template=chat_template,
            max_seq_length=max_prompt_length + max_completion_length,
            truncation="truncate",
            train_on_prompt=False,
            packing=False,
            num_generations=num_held_out_answers,
            generation_max_new_tokens=max_completion_length,
            generation=generation,
            text_rows=text_rows,
        )
        self.num_held_out_answers = num_held_out_answers
        self.num_generations = num_generations  # completions per prompt (TRL's name)
        self.max_prompt_length = max_prompt_length
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.loss_type = loss_type
        self.beta = beta
        self.epsilon_low = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.num_iterations = num_iterations
        self.scale_rewards = scale_rewards
        self.mask_truncated_completions = mask_truncated_completions
        built = [reward_lib.build(spec, max_completion_length) for spec in rewards]
        names = [name for name, _, _ in built]
        if len(set(names)) != len(names):
            raise ConfigError(
                f"task.rewards: names repeat ({', '.join(names)}); each is logged on its own."
            )
        self.reward_names = names
        self.reward_weights = torch.tensor([w for _, w, _ in built], dtype=torch.float32)
        self.reward_fns = [fn for _, _, fn in built]
        self.logged_stats = self._stat_names()
        self._accelerator: Accelerator | None = None
        self._data: GrpoData | None = None
        self._reference = None
        self.buffer = RolloutBuffer()

    def _stat_names(self) -> tuple[str, ...]:
        per_reward = [f"rewards/{n}/{s}" for n in self.reward_names for s in ("mean", "std")]
        return (
            "reward",
            "reward_std",
            *per_reward,
            "frac_reward_zero_std",
            "completions/mean_length",
            "completions/min_length",
            "completions/max_length",
            "completions/clipped_ratio",
            "entropy",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/region_mean",
            *(("kl",) if self.beta else ()),
            "generation/tokens_per_second",
            "generation/seconds",
        )

    @property
    def terms_per_example(self) -> int:
        if self.loss_type == "dapo":
            return self.num_generations * self.max_completion_length
        return 1 if self.loss_type == "bnpo" else self.num_generations

    def settings(self) -> dict[str, Any]:
        keys = ("chat_template", "text_rows", "max_prompt_length")
        return {k: getattr(self, k) for k in keys}

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> GrpoData:
        template = self._template(tokenizer)
        new_tokens = _add_template_tokens(tokenizer, self.chat_template)
        tokenizer.chat_template = template  # saved with it: final/ renders prompts as trained
        splits = data_lib.load_splits(cfg)
        features, rows = {}, {}
        for role, split in splits.items():
            rows[role] = prompt_rows(split.examples, split.source)
            ids = [self._prompt_ids(tokenizer, template, r, split.source) for r in rows[role]]
            cut = sum(len(i) > self.max_prompt_length for i in ids)
            if cut:
                log.warning(
                    "%s: %d of %d prompts are longer than task.max_prompt_length=%d and keep "
                    "their last tokens",
                    role,
                    cut,
                    len(ids),
                    self.max_prompt_length,
                )
            ids = [i[-self.max_prompt_length :] for i in ids]
            features[role] = Dataset.from_dict({"input_ids": ids, "index": list(range(len(ids)))})
            log.info("%s: %d prompts, %d completions each", role, len(ids), self.num_generations)
        held_out = [
            {"messages": r["prompt"], "tools": None, "reference": r["answer"]}
            for r in rows["eval"][: self.num_held_out_answers]
            if isinstance(r["prompt"], list) and isinstance(r.get("answer"), str)
        ]
        self.bind_tokenizer(tokenizer, _end_of_turn(tokenizer, template))
        return GrpoData(
            train=features["train"],
            eval=features["eval"],
            train_collator=PromptCollator(tokenizer.pad_token_id, repeat=self.num_iterations),
            eval_collator=PromptCollator(tokenizer.pad_token_id),
            template=template,
            prompts=held_out if template else [],
            new_tokens=new_tokens,
            stop_tokens=_end_of_turn(tokenizer, template),
            rows=rows,
        )

    def _prompt_ids(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str | None,
        row: Mapping[str, Any],
        source: str,
    ) -> list[int]:
        prompt = row["prompt"]
        if isinstance(prompt, str) and self.text_rows == "raw":
            return tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        self._check_has_template(template, f"{source} {row['place']}")
        return conversations.render(tokenizer, template, prompt, True)

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        super().check_model(model)

    def before_training(
        self, model: torch.nn.Module, data: GrpoData, accelerator: Accelerator, batch_size: int
    ) -> None:
        """Keep the accelerator and the prompts' rows; the reference when ``beta`` > 0; the
        rollout buffer registered with the checkpoints when ``num_iterations`` > 1."""
        self._accelerator, self._data = accelerator, data
        self.buffer.accelerator = accelerator
        if accelerator.distributed_type == DistributedType.FSDP:
            raise ConfigError(
                "task=grpo under FSDP: each process samples its own prompts' completions, which "
                "a sharded model cannot do alone; use DDP (conf/accelerate/multi_musa.yaml) with "
                "peft=lora for models that fit one device."
            )
        if self.num_iterations > 1:
            accelerator.register_for_checkpointing(self.buffer)
        if not self.beta:
            return
        unwrapped = accelerator.unwrap_model(model)
        if adapters.is_peft_model(unwrapped):
            log.info("GRPO reference: the model with its LoRA adapter disabled (no copy)")

            def disabled(m: torch.nn.Module, *args: Any) -> torch.Tensor:
                with _peft_model(m).disable_adapter():
                    return self._logps(m, *args)

            self._reference = disabled
            return
        frozen = copy.deepcopy(unwrapped).eval().requires_grad_(False)
        log.info("GRPO reference: a frozen copy of the starting weights")
        self._reference = lambda _, *args: self._logps(frozen, *args)

    # ---------------------------------------------------------------------------- rollouts

    def _rollout(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> Rollout:
        """This micro-batch's rollout: kept from an earlier step (``num_iterations``), or
        generated, scored and turned into advantages now."""
        key = (int(batch["epoch"][0]), *batch["index"].tolist())
        kept = self.buffer.entries.get(key)
        if kept is not None:
            kept.uses_left -= 1
            if kept.uses_left <= 0:
                del self.buffer.entries[key]
            return kept
        rollout = self._generate_and_score(model, batch, self._data.rows["train"])
        if self.num_iterations > 1:
            rollout.uses_left = self.num_iterations - 1
            self.buffer.entries[key] = rollout
        return rollout

    @torch.no_grad()
    def _generate_and_score(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], rows: list[dict]
    ) -> Rollout:
        accelerator = self._accelerator
        unwrapped = accelerator.unwrap_model(model)
        group = self.num_generations
        prompts = _unpadded(batch["input_ids"], batch["attention_mask"])
        seeds = batch["row_seed"].tolist()
        repeated = [p for p in prompts for _ in range(group)]
        streams = [torch.Generator().manual_seed(int(s) + k) for s in seeds for k in range(group)]
        sampling = GenerationConfig(
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            batch_size=max(self.generation.batch_size, group),
        )
        started = time.perf_counter()
        completions = generation_lib.complete_ids(
            unwrapped,
            repeated,
            self._tokenizer,
            sampling,
            self.max_completion_length,
            streams=streams,
        )
        seconds = time.perf_counter() - started
        device = accelerator.device
        prompt_ids, prompt_mask = _pad(repeated, self._pad_id, left=True, device=device)
        completion_ids, completion_mask = _pad(completions, self._pad_id, left=False, device=device)
        stops = set(self._stops)
        truncated = torch.tensor(
            [not ids or ids[-1] not in stops for ids in completions], device=device
        )
        if self.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
        indices = batch["index"].tolist()
        row_list = [rows[i] for i in indices for _ in range(group)]
        per_func = self._rewards(row_list, completions)
        advantages, reward_stats = self.advantages(per_func.to(device))
        old = None
        if self.num_iterations > 1:
            old = self._logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        ref = None
        if self.beta:
            ref = self._reference(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        stats = reward_stats | {
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "generation/tokens_per_second": float(lengths.sum()) / max(seconds, 1e-9),
            "generation/seconds": seconds,
        }
        return Rollout(
            prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, old, ref, stats
        )

    def _rewards(self, row_list: list[dict], completions: list[list[int]]) -> torch.Tensor:
        """(completions, reward functions): each function's rewards, NaN where it gave None."""
        texts = [self._tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return reward_table(self.reward_fns, self.reward_names, row_list, texts, completions)

    def advantages(self, per_func: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Advantages from the (completions, functions) rewards, as TRL's sum_then_normalize,
        and the reward statistics TRL logs."""
        group = self.num_generations
        totals = (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1)
        unscorable = torch.isnan(per_func).all(dim=1)
        totals[unscorable] = torch.nan
        grouped = totals.view(-1, group)
        means = torch.nanmean(grouped, dim=1).repeat_interleave(group)
        if self.scale_rewards == "batch":
            everyone = totals
            accelerator = self._accelerator
            if accelerator is not None and accelerator.num_processes > 1:
                everyone = accelerator.gather(totals)
            std = _nanstd(everyone).expand_as(totals)
        else:
            std = _nanstd(grouped, dim=1).repeat_interleave(group)
        advantages = totals - means
        if self.scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
        advantages = torch.nan_to_num(advantages, nan=0.0)
        group_std = _nanstd(grouped, dim=1)
        stats = {
            "reward": float(torch.nanmean(totals)),
            "reward_std": float(_nanstd(totals)),
            "frac_reward_zero_std": float(
                torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()
            ),
        }
        for i, name in enumerate(self.reward_names):
            column = per_func[:, i]
            stats[f"rewards/{name}/mean"] = _or_zero(torch.nanmean(column))
            stats[f"rewards/{name}/std"] = _or_zero(_nanstd(column))
        return advantages, stats

    # ------------------------------------------------------------------------------- loss

    def _logps(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        entropies: list | None = None,
    ) -> torch.Tensor:
        """Per-token log-probabilities of the completions at the sampling temperature (TRL's),
        (rows, completion length); their entropies appended to ``entropies`` when given."""
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, completion_mask.new_ones(completion_mask.shape)], dim=1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        width = completion_ids.shape[1]
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
        ).logits[:, -width - 1 : -1]
        logits = logits.float() / self.temperature
        logps = torch.log_softmax(logits, dim=-1)
        if entropies is not None:
            with torch.no_grad():
                entropies.append(-(logps.exp() * logps).sum(-1))
        return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        rollout = self._rollout(model, batch)
        entropies: list[torch.Tensor] = []
        logps = self._logps(
            model,
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            rollout.completion_mask,
            entropies,
        )
        total, count, stats = self.policy_loss(
            logps, rollout.old_logps, rollout.ref_logps, rollout.advantages, rollout.completion_mask
        )
        mask = rollout.completion_mask.float()
        stats["entropy"] = (entropies[0] * mask).sum() / mask.sum().clamp(min=1.0)
        stats |= {name: torch.tensor(value) for name, value in rollout.stats.items()}
        weighted = {
            name: stats[name].to(count.device).float() * count for name in self.logged_stats
        }
        return SummedLoss(total, count, weighted)

    def policy_loss(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
        advantages: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss as a sum and its terms (:class:`SummedLoss`: the loop divides
        the step's gradient by the terms of the whole step on every process), with TRL's
        per-token loss and normalisation for ``loss_type``; and the clip and KL statistics
        (means over the micro-batch's completion tokens)."""
        mask = completion_mask.float()
        old = logps.detach() if old_logps is None else old_logps
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        adv = advantages.unsqueeze(1)
        per_token = -torch.min(ratio * adv, clipped * adv)
        stats: dict[str, torch.Tensor] = {}
        tokens = mask.sum().clamp(min=1.0)
        if self.beta:
            kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
            kl = kl * ratio  # use_bias_correction_kl, TRL's default
            per_token = per_token + self.beta * kl
            stats["kl"] = ((kl * mask).sum() / tokens).detach()
        low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
        stats["clip_ratio/low_mean"] = (low * mask).sum() / tokens
        stats["clip_ratio/high_mean"] = (high * mask).sum() / tokens
        stats["clip_ratio/region_mean"] = (((low + high) > 0).float() * mask).sum() / tokens
        masked = per_token * mask
        rows = float(len(mask))
        if self.loss_type == "dapo":
            total, count = masked.sum(), mask.sum()
        elif self.loss_type == "grpo":
            total = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
            count = torch.tensor(rows, device=mask.device)
        elif self.loss_type == "bnpo":
            total, count = masked.sum() / tokens, torch.ones((), device=mask.device)
        else:  # dr_grpo
            total = masked.sum() / self.max_completion_length
            count = torch.tensor(rows, device=mask.device)
        return total, count, {k: v.detach() for k, v in stats.items()}

    # -------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Any,
        data: GrpoData,
        accelerator: Accelerator,
        output_dir: Any,
    ) -> dict[str, float]:
        """The rewards of one greedy completion per held-out prompt (every process answers its
        share): ``reward`` (weighted sum) and each function's mean, and the completions'
        length."""
        prompts = [row["input_ids"] for row in data.eval]
        greedy = GenerationConfig(batch_size=self.generation.batch_size)
        completions = generation_lib.complete_ids(
            model,
            prompts,
            self._tokenizer,
            greedy,
            self.max_completion_length,
            accelerator=accelerator,
        )
        texts = [self._tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        per_func = reward_table(
            self.reward_fns, self.reward_names, data.rows["eval"], texts, completions
        )
        totals = (per_func * self.reward_weights).nansum(dim=1)
        metrics = {
            "reward": float(totals.mean()),
            **{
                f"rewards/{n}/mean": _or_zero(torch.nanmean(per_func[:, i]))
                for i, n in enumerate(self.reward_names)
            },
            "completions/mean_length": float(np.mean([len(c) for c in completions])),
            "prompts": float(len(prompts)),
        }
        model.train()
        return broadcast_object_list([metrics])[0]

    # The tokenizer and stop tokens, set by the loop's data build (the data holds the template).
    @property
    def _tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tok

    def bind_tokenizer(self, tokenizer: PreTrainedTokenizerBase, stop_tokens: list[int]) -> None:
        self._tok = tokenizer
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = tokenizer.eos_token_id
        self._stops = [*stop_tokens, *([eos] if eos is not None else [])]


def reward_table(
    fns: Sequence[reward_lib.RewardFn],
    names: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    texts: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """(completions, functions) rewards, NaN where a function returned None; the function is
    called as TRL calls it: prompts, completions (a list holding the assistant message for a
    conversational prompt), completion_ids and every other column of the row."""
    prompts = [row["prompt"] for row in rows]
    conversational = bool(prompts) and isinstance(prompts[0], list)
    completions = (
        [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)
    )
    columns = [k for k in rows[0] if k not in ("prompt", "completion", "place")] if rows else []
    kwargs = {k: [row.get(k) for row in rows] for k in columns}
    table = torch.full((len(texts), len(fns)), torch.nan)
    for j, (fn, name) in enumerate(zip(fns, names, strict=True)):
        values = list(
            fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        )
        if len(values) != len(texts):
            raise ConfigError(
                f"task.rewards: {name} returned {len(values)} rewards for {len(texts)} "
                "completions; it must return one (a float, or None) per completion."
            )
        table[:, j] = torch.tensor([torch.nan if v is None else float(v) for v in values])
    return table


def prompt_rows(examples: Dataset, source: str) -> list[dict[str, Any]]:
    """Rows as prompts plus their other columns: TRL's prompt-only layout (``prompt``, a string
    or messages), or conversations (``messages``) whose last assistant reply becomes the
    ``answer`` column (unless the row has one)."""
    out = []
    for i, row in enumerate(examples):
        place = f"row {i}"
        row = dict(row)
        if "prompt" in row:
            prompt = row.pop("prompt")
        elif "messages" in row:
            messages = [conversations.parse_message(m, "messages") for m in row.pop("messages")]
            if messages and messages[-1]["role"] == "assistant":
                row.setdefault("answer", messages[-1]["content"])
                messages = messages[:-1]
            prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            raise DataError(
                f"{source} {place}: a GRPO row needs 'prompt' (text or messages) or 'messages'; "
                f"it has {', '.join(row) or 'no columns'}."
            )
        if isinstance(prompt, list):
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if not prompt:
            raise DataError(f"{source} {place}: the prompt is empty.")
        out.append({"prompt": prompt, "place": place, **row})
    return out


class PromptCollator:
    """Left-padded prompts with ``index`` (the row), ``epoch`` and ``row_seed``: the seed each
    row's completions are sampled from (the run's seed, the epoch and the row, so neither the
    batch nor the process changes them). The loop sets ``epoch`` and ``seed``."""

    seeds_by_row = True  # tells the loop to set seed and epoch

    def __init__(self, pad_token_id: int | None, repeat: int = 1) -> None:
        self.pad_token_id = 0 if pad_token_id is None else pad_token_id
        self.pad_to_multiple_of: int | None = None
        self.epoch = 0
        self.seed = 0
        # The loop's sampler gives each step's prompts this many times (num_iterations).
        self.repeat_steps = repeat

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, mask = _pad([r["input_ids"] for r in rows], self.pad_token_id, left=True)
        index = torch.tensor([r["index"] for r in rows])
        seeds = [
            int(np.random.SeedSequence([self.seed, self.epoch, int(i)]).generate_state(1)[0])
            for i in index
        ]
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "index": index,
            "epoch": torch.full((len(rows),), self.epoch),
            "row_seed": torch.tensor(seeds, dtype=torch.long),
        }


def _pad(
    rows: Sequence[Sequence[int]], pad: int, left: bool, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        if not row:
            continue
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[r, span] = torch.tensor(list(row), dtype=torch.long)
        mask[r, span] = 1
    return (ids.to(device), mask.to(device)) if device is not None else (ids, mask)


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]


def _nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction (TRL's ``nanstd``)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    count = (~torch.isnan(values)).sum(dim=dim).float()
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim) * count / (count - 1)
    return variance.sqrt()


def _or_zero(value: torch.Tensor) -> float:
    number = float(value)
    return 0.0 if number != number else number
