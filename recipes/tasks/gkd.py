"""Generalized knowledge distillation of a chat model from a teacher (``task=gkd``).

GKD as TRL 1.16's ``GKDTrainer`` does it (trl/experimental/gkd/gkd_trainer.py, gkd_config.py;
Agarwal et al., "On-Policy Distillation of Language Models"): the student learns the teacher's
whole next-token distribution on the completion tokens, by the generalized Jensen-Shannon
divergence of TRL's ``generalized_jsd_loss`` (``beta`` 0: KL(teacher || student), 1:
KL(student || teacher), between: the JSD against the beta-mixture), at temperature 1 as TRL's
``compute_loss`` calls it, summed over every labelled token of the optimizer step and divided by
their count (TRL's ``batchmean`` over labelled tokens, with ``num_items_in_batch``).

The rows are SFT's conversations (:class:`recipes.tasks.sft.Conversations` builds them with the
chat template), labelled and fitted to ``max_seq_length`` as TRL's GKD collator does
(:func:`trl_labels`, :class:`GkdFeatures`): the last reply and what follows it trains, and a
longer row keeps its end. A training row's completion is, as TRL:

* with probability ``lmbda``, the student's own sample (on-policy) from the row's prompt (its
  tokens before the last labelled reply), at ``temperature``, at most ``max_new_tokens``;
* otherwise, with ``seq_kd``, the teacher's sample; else the dataset's own reply.

Which rows go on-policy, and every sample, are drawn per row from the run's seed, the epoch and
the row (:class:`GkdCollator`; never Python's global ``random``, as TRL): a resumed run, or one
on another number of processes, trains on the same completions.

Logged beside the loss: ``train/on_policy``, the share of the labelled tokens that were the
student's own samples.

The teacher (:class:`recipes.tasks.chat.reference.Reference`, built in ``before_training``): a frozen
model loaded from ``teacher_model`` (same vocabulary as the student, checked), kept in eval mode
and run without autograd under the run's autocast; with ``teacher_model`` unset, TRL's default,
the student's starting weights (under LoRA its adapter disabled, no copy); or with
``precompute_teacher`` (``lmbda=0``, no ``seq_kd``), its log-probabilities on the dataset's
completions, full vocabulary in fp32, computed once and cached, carried by each batch.
Evaluation is the same divergence on the held-out conversations' own replies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes import generation as generation_lib
from recipes import moe
from recipes.config import ConfigError, DataConfig, GenerationConfig, ModelConfig
from recipes.evaluation import eval_mode
from recipes.log import get_logger
from recipes.losses import linear_ce
from recipes.losses.gkd import chunked_distillation_loss, distillation_loss
from recipes.losses.linear_ce import HeadInput
from recipes.tasks import chat
from recipes.tasks.base import Averaging, LossShape, RunContext, Seeding, SummedLoss, Task
from recipes.tasks.chat import ChatData, ChatFeatures, PromptAnswers, Reference
from recipes.tasks.configs.gkd import GkdConfig
from recipes.tasks.configs.sft import SftConfig
from recipes.tasks.sft import FEATURES_VERSION, Conversations

log = get_logger(__name__)

IGNORE = chat.IGNORE_INDEX
TEACHER_LOGPS = "teacher_logps"  # a batch's precomputed teacher log-probs (labelled tokens, V)
FSDP_REFUSAL = (
    "task=gkd under FSDP samples only with task.lmbda=0 and task.seq_kd=false (each process "
    "would sample its own rows' completions from a sharded model) and needs a task.teacher_model "
    "(the starting weights cannot be copied once sharded) under FSDP2 "
    "(conf/accelerate/fsdp2.yaml); or use DDP (conf/accelerate/multi_musa.yaml)."
)


@dataclasses.dataclass
class GkdData(ChatData):
    """SFT's conversations with each row's ``index``; ``cache``: where a precomputed teacher
    is cached (the features' cache folder)."""

    cache: Path | None = None


class GkdFeatures(ChatFeatures):
    """SFT's chat features, fitted to ``max_seq_length`` as TRL 1.16's GKD collator fits a row
    with ``truncation=keep_end`` (``DataCollatorForChatML`` in trl/experimental/utils.py keeps
    ``message_input_ids_full[-self.max_length:]``): a longer conversation keeps its last tokens,
    so its last reply trains; one left with no token of its prompt is dropped (TRL stops the
    run there: "An example has no prompt tokens left after truncation"). ``truncate`` and
    ``drop`` are SFT's."""

    def fit(self, whole: dict[str, list[int]]) -> dict[str, list[int]] | None:
        cut = len(whole["input_ids"]) - self.max_seq_length
        if self.truncation != "keep_end" or cut <= 0:
            return super().fit(whole)
        labels = whole["labels"]
        if all(label == IGNORE for label in labels) or cut >= prompt_length(labels):
            return None
        kept = {name: values[cut:] for name, values in whole.items()}
        kept["labels"][0] = IGNORE  # nothing predicts the first token (SFT's rows alike)
        return kept

    def none_kept(self, role: str, source: str, rows: int) -> str:
        if self.truncation != "keep_end":
            return super().none_kept(role, source, rows)
        return (
            f"{role} data {source}: every {self.row_words[0]} ({rows}) was dropped: its last "
            f"task.max_seq_length={self.max_seq_length} tokens (task.truncation=keep_end) hold "
            "no token of its prompt; raise task.max_seq_length."
        )


def trl_labels(ids: list[int], labels: list[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """A conversation's labels as TRL 1.16's GKD collator labels them: every token after the
    prompt, ``label[len(current_prompt_ids):] = sample_ids[len(current_prompt_ids):]``
    (DataCollatorForChatML, trl/experimental/utils.py), its prompt every message but the last.
    So only the last reply trains (an earlier one is prompt, as in an on-policy row), with the
    whitespace the template writes after its end-of-turn token (chatml's and zephyr's newline;
    llama3 writes none). A conversation that does not end with a reply keeps the labels of its
    last one only."""
    labelled = [i for i, label in enumerate(labels) if label != IGNORE]
    if not labelled:
        return labels
    start, end = prompt_length(labels), labelled[-1] + 1
    if not tokenizer.decode(ids[end:]).strip():
        end = len(ids)
    return [IGNORE] * start + ids[start:end] + [IGNORE] * (len(ids) - end)


def _with_trl_labels(split: Any, tokenizer: PreTrainedTokenizerBase) -> Any:
    """``split`` (a features Dataset) with :func:`trl_labels`."""
    labels = [
        trl_labels(ids, row_labels, tokenizer)
        for ids, row_labels in zip(split["input_ids"], split["labels"], strict=True)
    ]
    return split.remove_columns("labels").add_column("labels", labels)


class GkdCollator(chat.ChatCollator):
    """SFT's padded rows, plus each row's ``index``, ``prompt_length`` (its tokens before the last
    labelled reply), and, drawn from (seed, epoch, row) (:class:`recipes.tasks.base.SeedsRows`),
    whether it goes ``on_policy`` (probability ``lmbda``) and the ``row_seed`` its sample is drawn
    from. ``teacher``: precomputed teacher log-probs per row (added as ``teacher_logps``)."""

    def __init__(self, pad_token_id: int, lmbda: float = 0.0) -> None:
        super().__init__(pad_token_id)
        self.lmbda = lmbda
        self.teacher: list[torch.Tensor] | None = None
        self._seed, self._epoch = 0, 0

    def start_epoch(self, seed: int, epoch: int) -> None:
        self._seed, self._epoch = seed, epoch

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().__call__(rows)
        index = [int(r["index"]) for r in rows]
        states = [
            np.random.SeedSequence([self._seed, self._epoch, i]).generate_state(2) for i in index
        ]
        batch["index"] = torch.tensor(index)
        batch["prompt_length"] = torch.tensor([prompt_length(r["labels"]) for r in rows])
        batch["on_policy"] = torch.tensor([s[0] / 2.0**32 < self.lmbda for s in states])
        batch["row_seed"] = torch.tensor([int(s[1]) for s in states], dtype=torch.long)
        if self.teacher is not None:
            batch[TEACHER_LOGPS] = torch.cat([self.teacher[i] for i in index])
        return batch


def prompt_length(labels: list[int]) -> int:
    """The tokens before the last labelled reply (its last run of labels): the prompt TRL's
    ChatML collator cuts (every message but the last)."""
    end = max(i for i, label in enumerate(labels) if label != IGNORE)
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return start


def first_difference(teacher: Mapping[str, int], student: Mapping[str, int]) -> str:
    """``; first differing id 17: 'ab' in the teacher's, 'cd' in the student's`` (token -> id
    maps), or empty where every id holds the same token (then only the sizes differ)."""
    ids = [{i: t for t, i in vocab.items()} for vocab in (teacher, student)]
    for i in sorted(ids[0].keys() | ids[1].keys()):
        theirs, ours = (side.get(i) for side in ids)
        if theirs != ours:
            return (
                f"; first differing id {i}: {theirs!r} in the teacher's, {ours!r} in the student's"
            )
    return ""


def _forward(inputs: Mapping[str, torch.Tensor]) -> Any:
    """A call of a model on ``inputs`` that returns its logits before the last position."""
    return lambda weights: weights(**inputs, use_cache=False).logits[:, :-1]


def _lazy_forward(inputs: Mapping[str, torch.Tensor]) -> Any:
    """:func:`_forward`, its logits a :class:`HeadInput` where the weights' losses are chunked
    (``trainer.fused_linear_loss``)."""

    def call(weights: torch.nn.Module) -> Any:
        run = lambda: weights(**inputs, use_cache=False)  # noqa: E731
        return chat.lazy_forward(weights, run, inputs["input_ids"].shape).logits[:, :-1]

    return call


class KnowledgeDistillation(Task[GkdData]):
    """GKD (``task=gkd``); see the module's docstring. Its settings:
    :class:`recipes.tasks.configs.gkd.GkdConfig`. Its parts, built in :meth:`before_training`
    (None before): ``teacher``, and ``run``, the run its loss samples with."""

    auto_model_class = AutoModelForCausalLM
    # Its losses read the logits a chunk at a time (trainer.fused_linear_loss).
    fused_linear_loss = True
    args: GkdConfig
    parts = ("teacher", "run")
    start_reference = ("its teacher", "every divergence", "task.teacher_model")

    def __init__(self, args: GkdConfig) -> None:
        super().__init__(args)
        shared = ("format", "chat_template", "text_rows", "max_seq_length", "truncation")
        shared += ("num_generations", "generation_max_new_tokens")
        sft = SftConfig(**{k: getattr(args, k) for k in shared})
        # SFT's rows and features (the same cache), built by SFT's builder, fitted to the
        # length as TRL's GKD collator fits them (GkdFeatures).
        self.chat = GkdFeatures.of(
            sft, "sft", FEATURES_VERSION, ("conversation", "its assistant turns")
        )
        self.conversations = Conversations(self.chat, sft)
        self.predictor = PromptAnswers(self.chat, args.format)
        self.teacher: Reference | None = None
        self.run: RunContext | None = None

    def loss_shape(self) -> LossShape:
        """Summed over labelled tokens (at most ``max_seq_length`` per row); ``on_policy``: the
        share of them in the student's own samples."""
        return LossShape(Averaging.sum, self.args.max_seq_length, ("on_policy",))

    # ------------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> GkdData:
        """SFT's features with TRL's labels (:func:`trl_labels`) and each row's ``index``,
        batched by :class:`GkdCollator`."""
        data = self.conversations.build(cfg, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
        train, held_out = (_with_trl_labels(split, tokenizer) for split in (data.train, data.eval))
        return GkdData(
            **fields
            | {
                "train": train.add_column("index", list(range(len(train)))),
                "eval": held_out.add_column("index", list(range(len(held_out)))),
                "train_collator": GkdCollator(pad, self.args.lmbda),
                "eval_collator": GkdCollator(pad),
                "seeding": Seeding.row,
                "cache": data_lib.cache_root(cfg),
            }
        )

    # ------------------------------------------------------------------------------ model

    def check_model(self, model: torch.nn.Module) -> None:
        self.chat.check_model(model, packing=False)

    @property
    def evaluates_against_start(self) -> bool:
        """Its divergence is from the starting weights where ``teacher_model`` is unset."""
        return self.args.teacher_model is None

    def before_training(
        self, model: torch.nn.Module, data: GkdData, run: RunContext, batch_size: int
    ) -> None:
        """The teacher (see the module's docstring), its vocabulary checked against the
        student's; with ``precompute_teacher`` its log-probs on both splits, handed to the
        collators."""
        accelerator = run.accelerator
        sharded = accelerator.distributed_type == DistributedType.FSDP
        if sharded and (self.args.lmbda > 0 or self.args.seq_kd or self.args.teacher_model is None):
            raise ConfigError(FSDP_REFUSAL)
        self.run = run
        student = accelerator.unwrap_model(model)
        if self.args.disable_dropout:
            chat.reference.disable_dropout(student)
        if self.args.teacher_model is None:
            self.teacher = Reference.build(model, accelerator, FSDP_REFUSAL)
        else:
            frozen = self._load_teacher(student, run.tokenizer)
            if sharded:  # an 8B student from a 32B teacher: each card holds its share of both
                frozen = chat.reference.shard_frozen(frozen, accelerator, FSDP_REFUSAL)
            else:
                frozen = frozen.to(accelerator.device)
            # Its logits a chunk at a time too where the student's are and it allows it.
            fused = linear_ce.enabled(student) and not linear_ce.unsupported_reason(frozen)
            linear_ce.mark(frozen, fused)
            self.teacher = Reference(False, frozen, accelerator.autocast)
        if self.args.precompute_teacher:
            tables = self._precompute(model, data, accelerator, batch_size)
            data.train_collator.teacher, data.eval_collator.teacher = tables
            self.teacher = Reference.from_batches()

    def _load_teacher(
        self, student: torch.nn.Module, tokenizer: PreTrainedTokenizerBase
    ) -> torch.nn.Module:
        """``teacher_model``, frozen in eval mode, refused unless its vocabulary is the
        student's (TRL's GKD compares the two distributions token by token)."""
        from recipes.model import load_model

        name = self.args.teacher_model
        cfg = ModelConfig(
            name_or_path=name, dtype=self.args.teacher_dtype, gguf_file=self.args.teacher_gguf_file
        )
        try:
            teacher = load_model(cfg, AutoModelForCausalLM)
        except ConfigError as err:
            raise ConfigError(
                str(err).replace("model.name_or_path", "task.teacher_model")
            ) from None
        sizes = [m.config.get_text_config().vocab_size for m in (student, teacher)]
        same = sizes[0] == sizes[1]
        try:
            vocab = AutoTokenizer.from_pretrained(
                name, gguf_file=self.args.teacher_gguf_file
            ).get_vocab()
            same = same and vocab == tokenizer.get_vocab()
        except (OSError, ValueError):  # no tokenizer files beside it: the sizes decide
            vocab = None
        if not same:
            differs = first_difference(vocab, tokenizer.get_vocab()) if vocab else ""
            raise ConfigError(
                f"task.teacher_model={name}: its vocabulary (vocab_size {sizes[1]}"
                f"{f', {len(vocab)} tokens' if vocab else ''}) is not the student's "
                f"({student.config.name_or_path}: vocab_size {sizes[0]}, "
                f"{len(tokenizer.get_vocab())} tokens{differs}); GKD compares the two "
                "next-token distributions token by token, so name a teacher with the student's "
                "tokenizer."
            )
        log.info("teacher: %s (%s), frozen", name, self.args.teacher_dtype)
        return teacher.eval().requires_grad_(False)

    # ---------------------------------------------------------------------------- sampling

    def _sequences(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """The batch with each on-policy row's completion the student's sample, and with
        ``seq_kd`` each other row's the teacher's (re-padded); the batch itself if none is."""
        args = self.args
        if not (args.lmbda > 0 or args.seq_kd):
            return batch
        on_policy = batch["on_policy"].tolist()
        if not args.seq_kd and not any(on_policy):
            return batch
        assert self.run is not None and self.teacher is not None
        masks = batch["attention_mask"].cpu().bool()
        ids = [row[m].tolist() for row, m in zip(batch["input_ids"].cpu(), masks, strict=True)]
        labels = [row[: len(i)] for row, i in zip(batch["labels"].tolist(), ids, strict=True)]
        prompts = [row[:n] for row, n in zip(ids, batch["prompt_length"].tolist(), strict=True)]
        seeds = batch["row_seed"].tolist()
        rows = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)]
        students = [i for i, on in enumerate(on_policy) if on]
        teachers = [i for i, on in enumerate(on_policy) if not on] if args.seq_kd else []
        for chosen, sampler in ((students, None), (teachers, self.teacher)):
            if not chosen:
                continue
            completions = self._sample(
                model, [prompts[i] for i in chosen], [seeds[i] for i in chosen], sampler
            )
            for i, completion in zip(chosen, completions, strict=True):
                rows[i] = {
                    "input_ids": prompts[i] + completion,
                    "labels": [IGNORE] * len(prompts[i]) + completion,
                }
        padded = chat.ChatCollator(self.run.tokenizer.pad_token_id or 0)(rows)
        device = batch["input_ids"].device
        return {**{k: v.to(device) for k, v in padded.items()}, "on_policy": batch["on_policy"]}

    @torch.no_grad()
    def _sample(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        seeds: list[int],
        teacher: Reference | None,
    ) -> list[list[int]]:
        """Each prompt's completion sampled as TRL samples (``temperature``, top-k off, top-p
        1) from its own seeded stream: by the student, or by ``teacher``, on the run's
        ``generation.engine`` (the teacher's on the batched engine where that is vLLM: the
        server holds the policy, not the teacher)."""
        run = self.run
        assert run is not None
        sampling = generation_lib.on_engine(
            GenerationConfig(
                do_sample=True,
                temperature=self.args.temperature,
                top_p=1.0,
                top_k=0,
                batch_size=run.generation.batch_size,
            ),
            run.generation,
        )
        if teacher is not None and sampling.engine == "vllm":
            sampling = dataclasses.replace(sampling, engine="batched")

        def complete(weights: torch.nn.Module) -> list[list[int]]:
            return generation_lib.complete_ids(
                run.accelerator.unwrap_model(weights),
                prompts,
                run.tokenizer,
                sampling,
                self.args.max_new_tokens,
                max_length=self.args.max_seq_length,
                streams=[torch.Generator().manual_seed(int(s)) for s in seeds],
            )

        return complete(model) if teacher is None else teacher.run(model, complete)

    # ------------------------------------------------------------------------------- loss

    def divergence(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's summed generalized JSD over its labelled tokens (the logits at position
        t against the label at t + 1, TRL's shift), and its count of them
        (:func:`recipes.losses.gkd.distillation_loss`): against the teacher's logits at every
        position, or its precomputed log-probs at the labelled ones."""
        assert self.teacher is not None, "task=gkd: the loss runs after before_training"
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        mask = batch["labels"][:, 1:] != IGNORE
        student = _lazy_forward(inputs)(model)
        beta = self.args.beta
        fused = isinstance(student, HeadInput)  # trainer.fused_linear_loss
        loss = chunked_distillation_loss if fused else distillation_loss
        if TEACHER_LOGPS in batch:
            return loss(student, batch[TEACHER_LOGPS], mask, beta, True)
        if not fused:
            return distillation_loss(student, self.teacher.run(model, _forward(inputs)), mask, beta)
        teacher = self.teacher.run(model, _lazy_forward(inputs))
        if isinstance(teacher, HeadInput):
            # Each chunk's teacher logits on the teacher's weights (its adapter disabled).
            project = teacher.project
            teacher = HeadInput(
                teacher.hidden,
                lambda h: self.teacher.run(model, lambda _: project(h)),
                teacher.vocab,
            )
        else:
            teacher = HeadInput(teacher, lambda logits: logits, teacher.shape[-1])
        return chunked_distillation_loss(student, teacher, mask, beta)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        """The step's labelled tokens' summed JSD and their count (the loop divides by the
        count of the whole optimizer step on every process)."""
        sequences = self._sequences(model, batch)  # sampled without autograd: no router loss
        with moe.router_loss(model) as router:
            total, count = self.divergence(model, sequences)
        sampled = (count * batch["on_policy"].to(count.device)).sum().float()
        return router.added(SummedLoss(total.sum(), count.sum(), {"on_policy": sampled}))

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        total, count = self.divergence(model, batch)
        return {"jsd": total, "count": count}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: GkdData, run: RunContext
    ) -> dict[str, float]:
        """The divergence per labelled token of the held-out conversations (sums, not a mean
        of per-batch means)."""
        total, count = rows["jsd"].double().sum().item(), rows["count"].double().sum().item()
        return {"loss": total / max(count, 1.0), "tokens": count}

    def after_training(
        self, model: torch.nn.Module, data: GkdData, run: RunContext
    ) -> dict[str, Any]:
        """Greedy answers to held-out prompts, as SFT."""
        return self.chat.answer_held_out(model, data, run)

    # ------------------------------------------------------------------------ precompute

    def _precompute(
        self, model: torch.nn.Module, data: GkdData, accelerator: Accelerator, batch_size: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The teacher's log-probs (full vocabulary, fp32) at every labelled token of both
        splits, one tensor per row: read from the cache, or computed once (main process) and
        cached; refused beyond ``precompute_max_gb``."""
        splits = {"train": data.train, "eval": data.eval}
        tokens = sum(len(r) - r.count(IGNORE) for s in splits.values() for r in s["labels"])
        vocab = accelerator.unwrap_model(model).config.get_text_config().vocab_size
        size_gb = tokens * vocab * 4 / 1e9
        if size_gb > self.args.precompute_max_gb:
            raise ConfigError(
                f"task.precompute_teacher=true: the teacher's full-vocabulary log-probs of "
                f"{tokens} labelled tokens x {vocab} tokens of vocabulary x 4 bytes are "
                f"{size_gb:.1f} GB, above task.precompute_max_gb={self.args.precompute_max_gb}; "
                "run the teacher on the device (task.precompute_teacher=false) or raise the cap."
            )
        features = hashlib.sha256(
            json.dumps(
                [[list(s["input_ids"]), list(s["labels"])] for s in splits.values()]
            ).encode()
        ).hexdigest()
        digest = data_lib.cache_key(
            features=features,
            teacher=self.args.teacher_model,
            dtype=self.args.teacher_dtype,
            weights=chat.reference.weights_fingerprint(model, accelerator),
            precision=accelerator.mixed_precision,
        )
        file = (data.cache or Path(".")) / f"gkd-teacher-{digest}.pt"
        if accelerator.is_main_process and not file.exists():
            tables = {
                role: self._table(model, split, accelerator, batch_size)
                for role, split in splits.items()
            }
            file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(tables, file.with_suffix(".tmp"))
            file.with_suffix(".tmp").replace(file)
            log.info(
                "teacher: log-probs of %d tokens (%.2f GB) cached in %s", tokens, size_gb, file
            )
        accelerator.wait_for_everyone()
        tables = torch.load(file)
        return tables["train"], tables["eval"]

    def _table(
        self, model: torch.nn.Module, split: Any, accelerator: Accelerator, batch_size: int
    ) -> list[torch.Tensor]:
        assert self.teacher is not None
        collator = GkdCollator(self.run.tokenizer.pad_token_id or 0)  # type: ignore[union-attr]
        out: list[torch.Tensor] = []
        with eval_mode(model):
            for start in range(0, len(split), batch_size):
                batch = collator(
                    [split[i] for i in range(start, min(start + batch_size, len(split)))]
                )
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                inputs = {
                    "input_ids": batch["input_ids"],
                    "attention_mask": batch["attention_mask"],
                }
                mask = batch["labels"][:, 1:] != IGNORE
                logits = self.teacher.run(model, _forward(inputs))
                logps = F.log_softmax(logits.float(), dim=-1).cpu()
                out += [row[m] for row, m in zip(logps, mask.cpu(), strict=True)]
        return out
