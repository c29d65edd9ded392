"""Group relative policy optimisation on rewards that code checks (``task=grpo``).

Each micro-batch of prompts becomes a group of ``num_generations`` sampled completions per
prompt (the batched generation path, :mod:`recipes.generation`), scored by the reward functions
of ``task.rewards`` (:mod:`recipes.rewards`); rewards are normalised within each group into
advantages, and the policy takes TRL's clipped policy-gradient step. The definitions are TRL's
(``trl/trainer/grpo_trainer.py`` and ``grpo_config.py``, TRL 1.16), and so are the defaults:

* the loss (:mod:`recipes.losses.grpo`, where each is defined): ``loss_type`` ``dapo``,
  ``grpo``, ``bnpo``, ``dr_grpo``, ``cispo``, ``sapo``, ``luspo`` or ``vespo``, with a ratio per
  token or per completion (``importance_sampling_level=sequence``, GSPO), ``delta``'s two-sided
  clipping and ``off_policy_mask_threshold``'s mask;
* advantages: reward minus its group's mean, divided by the group's standard deviation (n - 1)
  plus 1e-4 (``scale_rewards=group``), by the whole batch's (``batch``, over every process) or
  not at all (``none``, Dr. GRPO); a completion every reward returned None for gets advantage 0
  (warned about once per log window), and a step none of whose completions is scored stops the
  run (:class:`ScoreTally`);
* the ratio to the old policy clipped to [1 - ``epsilon``, 1 + ``epsilon_high``] (0.2 each);
  log-probabilities of the completion at the sampling temperature, as TRL computes them;
* ``beta`` (0: no KL term and no reference): the k3 estimate of KL to the reference, times the
  ratio to the old policy (``use_bias_correction_kl``, TRL's default); the reference is the
  model with its LoRA adapter disabled, or a frozen copy of the starting weights, as DPO's;
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
``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (``cispo_clip_ratio``,
``vespo/phi_seq_mean`` for those losses), ``kl`` (with ``beta``), and the
generation's own ``generation/tokens_per_second`` and ``generation/seconds``. Evaluation is the
held-out prompts' rewards of greedy completions (``eval/reward`` ranks checkpoints).

With ``task.tools`` (TRL's ``tools=``), a completion is a conversation: the tools' schemas are in
the prompt, each turn's tool calls are run and their results appended as tool messages, and the
model goes on, drawing from the completion's own stream (:mod:`recipes.tool_calling`); the tool
tokens are left out of the loss, the rewards get the assistant and tool messages, and
``tools/call_frequency`` and ``tools/failure_frequency`` are logged as TRL logs them.

What the task keeps between the loop's calls is declared: its loss samples completions, so it
needs the run's tokenizer and accelerator, the training prompts' rows, the reference and the
rollouts kept for later steps; :meth:`GroupRelativePolicy.before_training` gathers them in one
:class:`Rollouts`, whose buffer is checkpointed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes import moe, tool_calling
from recipes import rewards as reward_lib
from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.faults import TrainingError
from recipes.log import get_logger
from recipes.losses import linear_ce
from recipes.losses.grpo import (
    TOKEN_SUMS,
    PolicyLossSettings,
    advantage_stat_names,
    group_advantages,
    policy_loss,
)
from recipes.losses.grpo import stat_names as loss_stat_names
from recipes.tasks import chat
from recipes.tasks.base import (
    Averaging,
    Batches,
    LossShape,
    Metrics,
    RunContext,
    Seeding,
    SummedLoss,
    Task,
)
from recipes.tasks.chat import ChatData, ChatFeatures, PromptAnswers, Reference
from recipes.tasks.configs.grpo import GrpoConfig

log = get_logger(__name__)

FEATURES_VERSION = 1
FSDP_REFUSAL = (
    "task=grpo under FSDP: each process samples its own prompts' completions, which a sharded "
    "model cannot do alone; use DDP (conf/accelerate/multi_musa.yaml) with peft=lora for models "
    "that fit one device."
)


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
    # Completions that no reward function scored (each returned None or NaN): ScoreTally's.
    unscored: int = 0
    # Padding-free (task.padding_free): the sequences as one row (:func:`_flat_sequences`).
    flat: tuple[torch.Tensor, ...] | None = None


class RolloutBuffer:
    """Rollouts generated for a later step (``num_iterations`` > 1), keyed by the epoch and the
    prompts' rows; saved with each checkpoint (``accelerator.register_for_checkpointing``), every
    process's own, so a resumed run steps on the completions and old log-probs it had."""

    def __init__(self, accelerator: Accelerator | None = None) -> None:
        self.entries: dict[tuple, Rollout] = {}
        self.accelerator = accelerator

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
    def move(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(move(v) for v in value)
        return value.to(device) if isinstance(value, torch.Tensor) else value

    return Rollout(**{k: move(v) for k, v in vars(rollout).items()})


class ScoreTally:
    """Completions that no reward function scored (every one returned None or NaN), counted
    per optimizer step and per log window. TRL's rule stays: such a completion takes no part in
    its group's statistics and gets advantage 0. But a step none of whose completions (on any
    process) was scored would update on nothing, and its logged reward would be no number: it
    stops the run (:class:`TrainingError`) before that step's update. Fewer are warned about
    at the first step that has them, then at most once per log window (TRL warns at every
    generation)."""

    def __init__(self, run: RunContext, names: Sequence[str]) -> None:
        self.accelerator = run.accelerator
        self.every = max(1, run.log_every_n_steps)
        self.names = ", ".join(names)
        self.step = [0, 0]  # unscored, completions: this process, this step
        self.quiet = 0  # steps left before another warning may come

    def count(self, rollout: Rollout) -> None:
        """Count a micro-batch's rollout; at the step's last micro-batch (the optimizer step
        follows), check the step, and warn when due."""
        self.step[0] += rollout.unscored
        self.step[1] += len(rollout.advantages)
        if self.accelerator.sync_gradients:
            self._end_step()

    def _end_step(self) -> None:
        unscored, total = self.step
        self.step = [0, 0]
        if self.accelerator.num_processes > 1:  # one small all-reduce; the sampling syncs anyway
            summed = torch.tensor([unscored, total], device=self.accelerator.device)
            unscored, total = (int(v) for v in self.accelerator.reduce(summed, "sum").tolist())
        if total and unscored == total:
            raise TrainingError(
                f"task.rewards: no function scored any of a training step's {total} "
                f"completions ({self.names} returned None or NaN for every one), so the step "
                "had nothing to learn from and no reward to log; the run stopped before that "
                "step's update. A function returns None (or NaN) only where it does not apply: "
                "check that the functions apply to these rows (their columns, the answer's form)."
            )
        self.quiet -= 1
        if not unscored or self.quiet > 0 or not self.accelerator.is_main_process:
            return
        self.quiet = self.every  # the next warning a log window later at the earliest
        log.warning(
            "%d of a training step's %d completions got no reward from any function (%s "
            "returned None or NaN for them): they count in no group's mean or std and their "
            "advantage is 0 (said at most once per trainer.log_every_n_steps=%d steps)",
            unscored,
            total,
            self.names,
            self.every,
        )


class Rollouts:
    """What GRPO's loss reads besides its batch, built once in ``before_training``: the run
    (the tokenizer and accelerator it samples with, ``generation.batch_size``), the training
    prompts' rows (the rewards read their columns), the tokens that end a completion, the
    reference policy (``beta`` > 0), the :class:`RolloutBuffer` (checkpointed) and the
    :class:`ScoreTally` of completions no function scored."""

    def __init__(
        self,
        run: RunContext,
        data: GrpoData,
        reference: Reference | None,
        reward_names: Sequence[str] = (),
    ) -> None:
        self.run = run
        self.tally = ScoreTally(run, reward_names)
        self.rows = data.rows["train"]
        self.flat = data.layout.flat  # the loss's forwards padding-free (flat_batches)
        self.reference = reference
        self.buffer = RolloutBuffer(run.accelerator)
        tokenizer = run.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = tokenizer.eos_token_id
        self.stops = {*data.stop_tokens, *([eos] if eos is not None else [])}


class GroupRelativePolicy(Task[GrpoData]):
    """GRPO (``task=grpo``); see the module's docstring. Its settings:
    :class:`recipes.tasks.configs.grpo.GrpoConfig`.

    ``rollouts`` is the state its loss keeps between calls (:class:`Rollouts`, None until
    :meth:`before_training`)."""

    auto_model_class = AutoModelForCausalLM
    # Its losses read the logits a chunk at a time (trainer.fused_linear_loss).
    fused_linear_loss = True
    parts = ("rollouts",)
    main_metric = "reward"
    greater_is_better = True
    args: GrpoConfig

    def __init__(self, args: GrpoConfig) -> None:
        super().__init__(args)
        # Prompts and held-out answers: prompt and completion fit max_seq_length.
        self.chat = ChatFeatures(
            args.chat_template,
            args.text_rows,
            max_seq_length=args.max_prompt_length + args.max_completion_length,
            truncation="truncate",
            settings=args.features_key(),
            kind="grpo",
            version=FEATURES_VERSION,
            row_words=("prompt", "its completions"),
            max_new_tokens=args.max_completion_length,
        )
        built = [reward_lib.build(spec, args.max_completion_length) for spec in args.rewards]
        names = [name for name, _, _ in built]
        if len(set(names)) != len(names):
            raise ConfigError(
                f"task.rewards: names repeat ({', '.join(names)}); each is logged on its own."
            )
        self.reward_names = names
        self.reward_weights = torch.tensor([w for _, w, _ in built], dtype=torch.float32)
        self.reward_fns = [fn for _, _, fn in built]
        summed = args.loss_type in (*TOKEN_SUMS, "bnpo", "dr_grpo")
        if args.importance_sampling_level == "sequence" and summed:
            log.warning(  # TRL's warning: GSPO's objective is per completion
                "task.importance_sampling_level=sequence with task.loss_type=%s sums per-token "
                "terms, so each completion weighs as its length; GSPO's setup is loss_type=grpo",
                args.loss_type,
            )
        self.rollouts: Rollouts | None = None
        self.tools = tool_calling.load_tools(args.tools)  # task.tools: multi-turn rollouts
        # mode=predict reads prompts in any conversation layout, or TRL's prompt-only rows; each
        # is answered within max_completion_length new tokens (unless generation.max_new_tokens).
        self.predictor = PromptAnswers(self.chat, "auto")

    @property
    def loss_settings(self) -> PolicyLossSettings:
        """What :func:`recipes.losses.grpo.policy_loss` reads of the task's settings."""
        return PolicyLossSettings.of(self.args)

    def loss_shape(self) -> LossShape:
        """Summed (:meth:`policy_loss`): per prompt at most every completion token (dapo, cispo,
        vespo), one term per completion (grpo, dr_grpo, sapo, luspo) or one per micro-batch
        (bnpo); TRL's statistics."""
        args = self.args
        if args.loss_type in TOKEN_SUMS:
            terms = args.num_generations * args.max_completion_length
        else:
            terms = 1 if args.loss_type == "bnpo" else args.num_generations
        return LossShape(Averaging.sum, terms, self._stat_names())

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
            *loss_stat_names(self.args.loss_type, self.args.beta),
            "generation/tokens_per_second",
            "generation/seconds",
            *(("tools/call_frequency", "tools/failure_frequency") if self.tools else ()),
        )

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> GrpoData:
        chat_template = self.chat.use_template(tokenizer)
        if self.tools:
            tool_calling.check_template(
                tokenizer, chat_template.template, self.tools, chat_template.stop_tokens
            )
            tool_calling.use_parser(tokenizer)
        max_prompt = self.args.max_prompt_length
        splits = data_lib.load_splits(cfg)
        features, rows = {}, {}
        for role, split in splits.items():
            rows[role] = prompt_rows(split.examples, split.source)
            ids = [
                self._prompt_ids(tokenizer, chat_template.template, r, split.source)
                for r in rows[role]
            ]
            cut = sum(len(i) > max_prompt for i in ids)
            if cut:
                log.warning(
                    "%s: %d of %d prompts are longer than task.max_prompt_length=%d and keep "
                    "their last tokens",
                    role,
                    cut,
                    len(ids),
                    max_prompt,
                )
            ids = [i[-max_prompt:] for i in ids]
            features[role] = Dataset.from_dict({"input_ids": ids, "index": list(range(len(ids)))})
            log.info(
                "%s: %d prompts, %d completions each", role, len(ids), self.args.num_generations
            )
        held_out = [
            # With task.tools the answers see the tools' schemas too (their calls are not run).
            {"messages": r["prompt"], "tools": self.tools or None, "reference": r["answer"]}
            for r in rows["eval"][: self.args.num_held_out_answers]
            if isinstance(r["prompt"], list) and isinstance(r.get("answer"), str)
        ]
        return GrpoData(
            train=features["train"],
            eval=features["eval"],
            train_collator=PromptCollator(tokenizer.pad_token_id),
            eval_collator=PromptCollator(tokenizer.pad_token_id),
            seeding=Seeding.row,
            repeat_steps=self.args.num_iterations,
            # Prompt batches keep their own length; with trainer.padding=max_length this only
            # tells the loop that lengths are not grouped.
            max_length=self.chat.max_seq_length,
            **chat_template.data_fields(held_out),
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
        if isinstance(prompt, str) and self.args.text_rows == "raw":
            return tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        chat.require_template(template, f"{source} {row['place']}")
        # `or None`: as TRL, a template may write tool boilerplate for an empty list.
        return chat.render(tokenizer, template, prompt, True, tools=self.tools or None)

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        setting = chat.padding_free_setting(self.args.padding_free)
        self.chat.check_model(model, packing=setting == "true")

    def flat_batches(self, model: torch.nn.Module) -> bool:
        """Whether the loss's forwards run padding-free under the model's attention
        (:func:`chat.flat_batches`)."""
        return chat.flat_batches(self.args.padding_free, model)

    def before_training(
        self, model: torch.nn.Module, data: GrpoData, run: RunContext, batch_size: int
    ) -> None:
        """Build :attr:`rollouts` from the run and the data: with the reference when ``beta`` >
        0 (the model with its LoRA adapter disabled, or a frozen copy of the starting weights,
        run without the run's autocast), its buffer registered with the checkpoints when
        ``num_iterations`` > 1. ``generation.num_beams`` > 1 is warned of: nothing here
        searches beams."""
        accelerator = run.accelerator
        if accelerator.distributed_type == DistributedType.FSDP:
            raise ConfigError(FSDP_REFUSAL)
        if (run.generation.num_beams or 1) > 1:
            log.warning(
                "generation.num_beams=%d (generation.engine=%s) is not used by task=grpo: its "
                "rollouts are sampled (task.temperature, top_p, top_k) and its evaluation answers "
                "greedily, on every engine; only mode=predict's answers search beams. Set "
                "generation.num_beams=null.",
                run.generation.num_beams,
                run.generation.engine,
            )
        self.rollouts = Rollouts(run, data, None, self.reward_names)
        if self.args.num_iterations > 1:
            accelerator.register_for_checkpointing(self.rollouts.buffer)
        if self.args.beta:
            self.rollouts.reference = Reference.build(
                model, accelerator, FSDP_REFUSAL, autocast=False
            )

    # ---------------------------------------------------------------------------- rollouts

    def _rollout(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> Rollout:
        """This micro-batch's rollout: kept from an earlier step (``num_iterations``), or
        generated, scored and turned into advantages now."""
        rollouts = self.rollouts
        if rollouts is None:
            raise RuntimeError("task=grpo: the loss runs after before_training")
        key = (int(batch["epoch"][0]), *batch["index"].tolist())
        kept = rollouts.buffer.entries.get(key)
        if kept is not None:
            kept.uses_left -= 1
            if kept.uses_left <= 0:
                del rollouts.buffer.entries[key]
            return kept
        rollout = self._generate_and_score(model, batch, rollouts)
        if self.args.num_iterations > 1:
            rollout.uses_left = self.args.num_iterations - 1
            rollouts.buffer.entries[key] = rollout
        return rollout

    @torch.no_grad()
    def _generate_and_score(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], rollouts: Rollouts
    ) -> Rollout:
        args, run = self.args, rollouts.run
        accelerator = run.accelerator
        unwrapped = accelerator.unwrap_model(model)
        group = args.num_generations
        prompts = _unpadded(batch["input_ids"], batch["attention_mask"])
        seeds = batch["row_seed"].tolist()
        repeated = [p for p in prompts for _ in range(group)]
        streams = [torch.Generator().manual_seed(int(s) + k) for s in seeds for k in range(group)]
        sampling = generation_lib.on_engine(
            GenerationConfig(
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                batch_size=max(run.generation.batch_size, group),
            ),
            run.generation,
        )
        started = time.perf_counter()
        completions = generation_lib.complete_ids(
            unwrapped,
            repeated,
            run.tokenizer,
            sampling,
            args.max_completion_length,
            streams=streams,
        )
        turns = None
        if self.tools:  # a completion's later turns go on drawing from its own stream
            turns = self._tool_turns(unwrapped, run, repeated, completions, sampling, streams)
            completions = turns.completion_ids
        seconds = time.perf_counter() - started
        device = accelerator.device
        pad = rollouts.pad_id
        prompt_ids, prompt_mask = _pad(repeated, pad, left=True, device=device)
        completion_ids, completion_mask = _pad(completions, pad, left=False, device=device)
        if turns is not None:  # tool results carry no loss (TRL's completion_mask * tool_mask)
            completion_mask = completion_mask * _pad(turns.tool_mask, 0, False, device)[0]
        truncated = torch.tensor(
            [not ids or ids[-1] not in rollouts.stops for ids in completions], device=device
        )
        if args.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
        indices = batch["index"].tolist()
        row_list = [rollouts.rows[i] for i in indices for _ in range(group)]
        messages = turns.messages if turns is not None else None
        per_func = self._rewards(run.tokenizer, row_list, completions, "train", messages)
        advantages, reward_stats = self.advantages(per_func.to(device), accelerator)
        sampled = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        flat = _flat_sequences(repeated, completions, device) if rollouts.flat else None
        old = self._logps(model, *sampled, flat=flat) if args.num_iterations > 1 else None
        ref = None
        if rollouts.reference is not None:
            ref = rollouts.reference.run(
                model, lambda weights: self._logps(weights, *sampled, flat=flat)
            )
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        if turns is not None:  # the model's tokens only, as TRL counts them
            lengths = torch.tensor([sum(m) for m in turns.tool_mask], dtype=torch.float32)
            reward_stats |= turns.stats()
        stats = reward_stats | {
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "generation/tokens_per_second": float(lengths.sum()) / max(seconds, 1e-9),
            "generation/seconds": seconds,
        }
        unscored = int(torch.isnan(per_func).all(dim=1).sum())
        return Rollout(*sampled, advantages, old, ref, stats, flat=flat, unscored=unscored)

    def _tool_turns(
        self,
        model: torch.nn.Module,
        run: RunContext,
        prompts: list[list[int]],
        completions: list[list[int]],
        generation: GenerationConfig,
        streams: Sequence[torch.Generator] | None = None,
        accelerator: Accelerator | None = None,
    ) -> tool_calling.Conversations:
        """The completions (first turns of ``prompts``) after their tool calls and the model's
        later turns (:func:`recipes.tool_calling.tool_call_loop`): sampled from each
        completion's own stream in ``streams``, or greedy."""
        args = self.args
        unwrapped = run.accelerator.unwrap_model(model)

        def generate(rows: list[int], ids: list[list[int]], limits: list[int]) -> list:
            own = [streams[r] for r in rows] if streams is not None else None
            return generation_lib.complete_ids(
                model, ids, run.tokenizer, generation, limits, streams=own, accelerator=accelerator
            )

        return tool_calling.tool_call_loop(
            generate,
            run.tokenizer,
            run.tokenizer.chat_template,
            self.tools,
            prompts,
            completions,
            max_completion_length=args.max_completion_length,
            max_iterations=args.max_tool_calling_iterations,
            timeout=args.tool_timeout,
            max_length=getattr(unwrapped.config, "max_position_embeddings", None),
            ends=generation_lib.stop_ids(unwrapped),
        )

    def _rewards(
        self,
        tokenizer: PreTrainedTokenizerBase,
        rows: Sequence[Mapping[str, Any]],
        completions: list[list[int]],
        split: str = "train",
        messages: list[list[dict[str, Any]]] | None = None,
    ) -> torch.Tensor:
        """(completions, reward functions): each function's rewards of the completions of
        ``rows`` (one row per completion, of ``split``), NaN where it gave None; ``messages``:
        the completions as conversations (tool calling), which the functions get instead."""
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return reward_table(
            self.reward_fns, self.reward_names, rows, texts, completions, split, messages
        )

    def advantages(
        self, per_func: torch.Tensor, accelerator: Accelerator | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Advantages from the (completions, functions) rewards, as TRL's sum_then_normalize,
        and the reward statistics TRL logs; ``scale_rewards=batch`` takes the standard
        deviation over every process of ``accelerator``."""
        gather = None  # scale_rewards=batch: the std over every process
        if accelerator is not None and accelerator.num_processes > 1:
            gather = accelerator.gather
        advantages, values = group_advantages(
            per_func,
            self.reward_weights.to(per_func.device),
            self.args.num_generations,
            self.args.scale_rewards,
            gather,
        )
        names = advantage_stat_names(self.reward_names)
        # One read of the device for every statistic (each float() would be a host sync).
        stats = dict(zip(names, values.tolist(), strict=True))
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
        flat: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """Per-token log-probabilities of the completions at the sampling temperature (TRL's),
        (rows, completion length); their entropies appended to ``entropies`` when given. With
        ``flat`` (:func:`_flat_sequences`) from one padding-free row, 0 past each completion's
        end (where the padded rows' values carry no loss either)."""
        if flat is not None:
            return self._flat_logps(model, completion_ids, flat, entropies)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, completion_mask.new_ones(completion_mask.shape)], dim=1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        width = completion_ids.shape[1]
        logits = chat.lazy_forward(
            model,
            lambda: model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            ),
            ids.shape,
        ).logits[:, -width - 1 : -1]
        if isinstance(logits, linear_ce.HeadInput):  # trainer.fused_linear_loss
            token, entropy = linear_ce.per_chunk(
                _chunk_logps(self.args.temperature, entropies is not None),
                logits,
                logits.rows(),
                completion_ids.reshape(-1),
            )
            if entropies is not None:
                entropies.append(entropy.view(completion_ids.shape))
            return token.view(completion_ids.shape)
        logits = logits.float() / self.args.temperature
        logps = torch.log_softmax(logits, dim=-1)
        if entropies is not None:
            with torch.no_grad():
                entropies.append(-(logps.exp() * logps).sum(-1))
        return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)

    def _flat_logps(
        self,
        model: torch.nn.Module,
        completion_ids: torch.Tensor,
        flat: tuple[torch.Tensor, ...],
        entropies: list | None,
    ) -> torch.Tensor:
        """:meth:`_logps` from the padding-free row: the logits of the positions that predict
        a completion token only, scattered back to (rows, completion length)."""
        ids, positions, predicting, slots = flat
        inputs = {"input_ids": ids, "position_ids": positions}
        logits = chat.forward(model, inputs, lazy_head=True).logits[0, predicting]
        targets = completion_ids.reshape(-1)[slots]

        def placed(values: torch.Tensor) -> torch.Tensor:
            grid = values.new_zeros(completion_ids.numel())
            return grid.index_put((slots,), values).view(completion_ids.shape)

        if isinstance(logits, linear_ce.HeadInput):  # trainer.fused_linear_loss
            token, entropy = linear_ce.per_chunk(
                _chunk_logps(self.args.temperature, entropies is not None),
                logits,
                logits.hidden,
                targets,
            )
            if entropies is not None:
                entropies.append(placed(entropy))
            return placed(token)
        logps = torch.log_softmax(logits.float() / self.args.temperature, dim=-1)
        token = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if entropies is not None:
            with torch.no_grad():
                entropies.append(placed(-(logps.exp() * logps).sum(-1)))
        return placed(token)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        rollout = self._rollout(model, batch)
        assert self.rollouts is not None  # set by _rollout's own check
        self.rollouts.tally.count(rollout)  # stops the run at a step no function scored
        entropies: list[torch.Tensor] = []
        with moe.router_loss(model) as router:
            logps = self._logps(
                model,
                rollout.prompt_ids,
                rollout.prompt_mask,
                rollout.completion_ids,
                rollout.completion_mask,
                entropies,
                flat=rollout.flat,
            )
        total, count, stats = self.policy_loss(
            logps, rollout.old_logps, rollout.ref_logps, rollout.advantages, rollout.completion_mask
        )
        mask = rollout.completion_mask.float()
        stats["entropy"] = (entropies[0] * mask).sum() / mask.sum().clamp(min=1.0)
        stats |= {name: torch.tensor(value) for name, value in rollout.stats.items()}
        weighted = {
            name: stats[name].to(count.device).float() * count for name in self._stat_names()
        }
        return router.added(SummedLoss(total, count, weighted))

    def policy_loss(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
        advantages: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`recipes.losses.grpo.policy_loss` under this task's settings: the
        micro-batch's loss as a sum and its terms (:class:`SummedLoss`: the loop divides the
        step's gradient by the terms of the whole step on every process), and TRL's clip and
        KL statistics."""
        return policy_loss(
            logps, old_logps, ref_logps, advantages, completion_mask, self.loss_settings
        )

    # -------------------------------------------------------------------------- evaluation

    def evaluate(
        self, model: nn.Module, loader: Batches, data: GrpoData, run: RunContext
    ) -> Metrics:
        """The rewards of one greedy completion per held-out prompt (every process answers its
        share): ``reward`` (the weighted sum's mean over the completions some function
        scored; none scored stops the run) and each function's mean (left out where it scored
        none), and the completions' length."""
        prompts = [row["input_ids"] for row in data.eval]
        greedy = generation_lib.on_engine(
            GenerationConfig(batch_size=run.generation.batch_size), run.generation
        )
        completions = generation_lib.complete_ids(
            model,
            prompts,
            run.tokenizer,
            greedy,
            self.args.max_completion_length,
            accelerator=run.accelerator,
        )
        messages = None
        if self.tools:  # every process runs the tools of every completion: they stay in step
            turns = self._tool_turns(
                model, run, prompts, completions, greedy, accelerator=run.accelerator
            )
            completions, messages = turns.completion_ids, turns.messages
        per_func = self._rewards(run.tokenizer, data.rows["eval"], completions, "eval", messages)
        totals = (per_func * self.reward_weights).nansum(dim=1)
        scored = ~torch.isnan(per_func).all(dim=1)  # as in training: the others are no score
        if not bool(scored.any()):
            raise TrainingError(
                f"task.rewards: no function scored any of the {len(completions)} held-out "
                f"completions ({', '.join(self.reward_names)} returned None or NaN for every "
                "one), so eval/reward, which ranks checkpoints, would be no number; the run "
                "stopped. A function returns None (or NaN) only where it does not apply: check "
                "that the functions apply to the evaluation rows."
            )
        means = {n: float(torch.nanmean(per_func[:, i])) for i, n in enumerate(self.reward_names)}
        return {
            "reward": float(totals[scored].mean()),
            # Left out where the function scored none: never a made-up 0 (nor a NaN that
            # results.json could not hold).
            **{f"rewards/{n}/mean": v for n, v in means.items() if v == v},
            "completions/mean_length": float(np.mean([len(c) for c in completions])),
            "prompts": float(len(prompts)),
        }

    def after_training(
        self, model: torch.nn.Module, data: GrpoData, run: RunContext
    ) -> dict[str, Any]:
        """Greedy answers to held-out prompts (:func:`chat.answer_held_out`)."""
        return self.chat.answer_held_out(model, data, run)


def reward_table(
    fns: Sequence[reward_lib.RewardFn],
    names: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    texts: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    split: str = "train",
    messages: Sequence[list[dict[str, Any]]] | None = None,
) -> torch.Tensor:
    """(completions, functions) rewards, NaN where a function returned None; the function is
    called as TRL calls it: prompts, completions (a list holding the assistant message for a
    conversational prompt; with tools, ``messages``: the assistant and tool turns),
    completion_ids and every other column of the row. A function that
    raises or returns no number is refused naming the completion's row of ``split``
    (:func:`recipes.rewards.scores`)."""
    prompts = [row["prompt"] for row in rows]
    conversational = bool(prompts) and isinstance(prompts[0], list)
    completions = (
        [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)
    )
    if messages is not None:
        completions = list(messages)
    columns = [k for k in rows[0] if k not in ("prompt", "completion", "place")] if rows else []
    kwargs = {k: [row.get(k) for row in rows] for k in columns}
    places = [f"{split} {row.get('place', f'completion {i}')}" for i, row in enumerate(rows)]
    table = torch.full((len(texts), len(fns)), torch.nan)
    for j, (fn, name) in enumerate(zip(fns, names, strict=True)):
        values = reward_lib.scores(fn, name, places, prompts, completions, completion_ids, kwargs)
        table[:, j] = torch.tensor(values, dtype=torch.float32)
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
            messages = [chat.parse_message(m, "messages") for m in row.pop("messages")]
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
    batch nor the process changes them). The loop gives it the seed and epoch
    (:meth:`start_epoch`; :class:`recipes.tasks.base.SeedsRows`)."""

    def __init__(self, pad_token_id: int | None) -> None:
        self.pad_token_id = 0 if pad_token_id is None else pad_token_id
        self.pad_to_multiple_of: int | None = None
        self._seed = 0
        self._epoch = 0

    def start_epoch(self, seed: int, epoch: int) -> None:
        self._seed, self._epoch = seed, epoch

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, mask = _pad([r["input_ids"] for r in rows], self.pad_token_id, left=True)
        index = torch.tensor([r["index"] for r in rows])
        seeds = [
            int(np.random.SeedSequence([self._seed, self._epoch, int(i)]).generate_state(1)[0])
            for i in index
        ]
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "index": index,
            "epoch": torch.full((len(rows),), self._epoch),
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


def _flat_sequences(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Each prompt and its completion as one row without padding (the padding-free layout,
    ``position_ids`` restarting at each sequence), and where the completions' tokens are:
    ``(input_ids, position_ids)`` (1, tokens), the positions whose logits predict a completion
    token, and that token's slot in the (rows, completion length) padded completions."""
    width = max(1, max(len(c) for c in completions))
    ids: list[int] = []
    positions: list[int] = []
    predicting: list[int] = []
    slots: list[int] = []
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start = len(ids) + len(prompt)
        ids += [*prompt, *completion]
        positions += range(len(prompt) + len(completion))
        predicting += range(start - 1, start - 1 + len(completion))
        slots += range(row * width, row * width + len(completion))
    return tuple(
        torch.tensor(values, dtype=torch.long, device=device)
        for values in ([ids], [positions], predicting, slots)
    )


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]


def _chunk_logps(
    temperature: float, entropy: bool
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One chunk's log-probabilities of its targets at ``temperature`` and (``entropy``) its
    entropies without gradient (zeros otherwise), by the unfused path's own ops, for
    :func:`recipes.losses.linear_ce.per_chunk`."""

    def chunk(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps = torch.log_softmax(logits.float() / temperature, dim=-1)
        token = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            spread = -(logps.exp() * logps).sum(-1) if entropy else torch.zeros_like(token)
        return token, spread

    return chunk
