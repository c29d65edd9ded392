"""What a run's modes and its training loop both need: the :class:`Session` (the run folder and
its log, the device and its checks, the task's data and tokenizer, model loading, trackers and the
one results file), the Accelerator, the task's collators padded as ``trainer.*`` say, and the
metrics' log format.

:mod:`recipes.modes` picks the runner of a ``mode`` and runs it over a Session; ``mode=train``
runs :class:`recipes.loop.Trainer`, whose collaborator the Session is. Neither the loop nor this
module imports the modes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    parse_flag_from_env,
)
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding

from recipes import adapters, checkpoint, device, memory, mesh, runs, tracking
from recipes import data as data_lib
from recipes.config import ConfigError, ModelConfig, Settings, TrainerConfig
from recipes.faults import StopRequest
from recipes.log import get_logger, setup_logging
from recipes.model import (
    config_overrides,
    fit_to_tokenizer,
    head_mismatch,
    load_model,
    load_tokenizer,
    saved_config,
    share_tied_embeddings,
    weights_summary,
)
from recipes.tasks import chat
from recipes.tasks.base import PadsToLength, PadsToMultiple, RunContext, Task, TaskData
from recipes.tasks.configs import config_classes
from recipes.tracking import MetricsLogger

log = get_logger(__name__)


@dataclass
class RunResult:
    """What a run ends with: its folder and the final evaluation."""

    output_dir: Path
    metrics: dict[str, float]  # the final evaluation (empty when there was none)
    main_metric: str  # e.g. "eval/f1": what sweeps and `train.py` report
    greater_is_better: bool

    @property
    def main_value(self) -> float | None:
        return self.metrics.get(self.main_metric)


class Session:
    """The setup every mode shares: the run folder (locked, with its log and config.yaml), the
    device and its checks, the task and its tokenizer, model loading, trackers and the one
    results file."""

    def __init__(
        self,
        settings: Settings,
        task: Task,
        accelerator: Accelerator,
        stop: StopRequest,
        device_choices: list[str] = (),
    ) -> None:
        self.settings, self.task, self.accelerator, self.stop = settings, task, accelerator, stop
        self.device_choices = list(device_choices)  # with_device_defaults' lines
        self.trainer_cfg = settings.trainer
        self.output_dir, self.resume_from = runs.open_run_folder(settings, accelerator)
        setup_logging(accelerator.is_main_process, self.output_dir / "train.log")
        data_lib.show_progress(self.trainer_cfg.progress_bar)  # preprocessing, answer search
        log.info("run folder: %s", self.output_dir)
        self._setup_device()
        self.tokenizer = load_tokenizer(settings.model)
        self.metrics: MetricsLogger | None = None

    def _setup_device(self) -> None:
        from accelerate.utils import set_seed

        accelerator, trainer_cfg = self.accelerator, self.trainer_cfg
        log.info(
            "device %s, %d process(es), mixed precision %s, distributed %s",
            accelerator.device,
            accelerator.num_processes,
            accelerator.mixed_precision,
            accelerator.distributed_type,
        )
        for line in self.device_choices:
            log.info("%s", line)
        parallel = getattr(accelerator, "parallelism_config", None)  # accelerate >= ND parallelism
        if parallel is not None and parallel.dp_replicate_size > 1 and parallel.dp_shard_size > 1:
            log.info(
                "HSDP: the model sharded over %d processes (a node), replicated %d times",
                parallel.dp_shard_size,
                parallel.dp_replicate_size,
            )
        _check_grad_scaler(accelerator)
        _check_device_support(trainer_cfg, accelerator)
        # Set both ways: torch_musa 2.7 turns TF32 on by default.
        self.tf32 = device.set_tf32(trainer_cfg.tf32)
        device.reset_peak_memory_stats(accelerator.device)  # train/peak_memory_gib is this run's
        set_seed(trainer_cfg.seed)

    @property
    def main_metric(self) -> str:
        """The logged key that ranks checkpoints (``eval/f1``, say)."""
        return f"eval/{self.task.main_metric}"

    def context(self, training: bool = False) -> RunContext:
        return RunContext(
            self.accelerator,
            self.tokenizer,
            self.output_dir,
            self.settings.generation,
            self.settings.trainer.log_every_n_steps,
            self.trainer_cfg.per_device_train_batch_size if training else None,
        )

    # ------------------------------------------------------------------------ data and model

    def build_data(self, predict: bool = False) -> TaskData:
        """The task's features (the rows of data.predict_file with ``predict``), built on the
        main process first (the others then read its cache), and its own collators set to pad
        as the default one does (:meth:`padding`): training, every evaluation and ``mode=eval``
        read batches padded alike."""
        settings, task = self.settings, self.task
        config_overrides(settings.model)  # checked before the data is read
        with self.accelerator.main_process_first():
            if predict:
                data = task.build_predict_data(settings.data, self.tokenizer)
            else:
                data = task.build_data(settings.data, self.tokenizer)
        # mode=predict's own collators round to the multiple only, as they always have.
        fixed = None if predict else self.fixed_length(data)
        pad_task_batches(data, self.trainer_cfg.pad_to_multiple_of, fixed)
        return data

    def load_model(self, data: TaskData, trained_for: str | None) -> torch.nn.Module:
        """The model of ``model.*`` with the task's head, checked by the task, fitted to the
        tokenizer, with LoRA adapters (``peft=lora``) and gradient checkpointing as configured.
        ``trained_for``: the mode that needs the head trained (eval, predict), or None."""
        model_cfg, task = self.settings.model, self.task
        kwargs = {} if trained_for == "predict" else task.model_kwargs(data)
        if trained_for:
            _check_saved_head(model_cfg, task, kwargs.get("num_labels"), trained_for)
        model = load_model(
            model_cfg,
            task.auto_model_class,
            config_overrides(model_cfg),
            trained_for=trained_for,
            precision=self.accelerator.mixed_precision,
            **kwargs,
        )
        task.check_model(model)
        data.layout.decide(task.flat_batches(model))  # once: the collators hold it
        fit_to_tokenizer(model, self.tokenizer, data.new_tokens, data.stop_tokens)
        if self.accelerator.distributed_type == DistributedType.FSDP:
            share_tied_embeddings(model)  # FSDP2 shards one weight in one group (T5's embedding)
        if trained_for == "predict":
            return model
        if self.settings.peft.method == "lora":
            _check_fsdp_for_lora(self.accelerator)
            model = adapters.apply_lora(
                model, self.settings.peft, adapters.task_heads(model), data.new_tokens
            )
        else:
            log.info(adapters.trainable_summary(model))
        log.info(weights_summary(model, model_cfg, self.accelerator.mixed_precision))
        if self.trainer_cfg.gradient_checkpointing:
            adapters.enable_gradient_checkpointing(model)
        if getattr(task, "fused_linear_loss", False):  # the chat tasks' chunked losses
            log.info(chat.choose_fused_loss(model, self.trainer_cfg.fused_linear_loss))
        return model

    def fixed_length(self, data: TaskData) -> int | None:
        """The one length every batch is padded to (the data's max_length with
        ``trainer.padding=max_length``), or None: each batch to its longest row."""
        return data.max_length if self.trainer_cfg.padding == "max_length" else None

    def padding(self, data: TaskData) -> DataCollatorWithPadding:
        """The collator of a task without its own: each batch padded to its longest row (to
        the data's max_length with trainer.padding=max_length), to trainer.pad_to_multiple_of."""
        fixed = self.fixed_length(data)
        return DataCollatorWithPadding(
            self.tokenizer,
            padding="max_length" if fixed else "longest",
            max_length=fixed,
            pad_to_multiple_of=self.trainer_cfg.pad_to_multiple_of,
        )

    def prepare(self, model: torch.nn.Module, *others: Any) -> tuple[Any, ...]:
        """``accelerator.prepare`` of the model and what goes with it (optimizer, loaders), in
        that order; a LoRA model's checkpoints then hold what trains."""
        with adapters.tie_seen_by_fsdp2(model):
            prepared = self.accelerator.prepare(model, *others)
        if adapters.is_peft_model(self.accelerator.unwrap_model(prepared[0])):
            adapters.register_checkpoint_hooks(self.accelerator)
        return prepared

    def loader_kwargs(self) -> dict[str, Any]:
        return {
            "num_workers": self.trainer_cfg.dataloader_num_workers,
            **device.pin_memory_kwargs(self.trainer_cfg.pin_memory, self.accelerator.device),
        }

    def eval_loader(self, data: TaskData) -> DataLoader:
        """Batches of ``data.eval``, as every evaluation (and mode=predict) reads them."""
        return DataLoader(
            data.eval,
            batch_size=self.trainer_cfg.per_device_eval_batch_size,
            collate_fn=data.eval_collator or self.padding(data),
            **self.loader_kwargs(),
        )

    # ------------------------------------------------------------------------------ reporting

    def start_trackers(
        self, keep_until_step: int | None = None, main_metric: str | None = None
    ) -> MetricsLogger:
        """metrics.jsonl (``keep_until_step``: a resumed run's records up to there are kept)
        and the trackers of ``logger.*``, told which metric ranks the run."""
        accelerator = self.accelerator
        self.metrics = MetricsLogger(accelerator, self.output_dir, keep_until_step=keep_until_step)
        tags = tracking.run_tags(
            tracking.hydra_context().get("recipe"),
            self.settings.model.name_or_path,
            accelerator.device.type,
            accelerator.num_processes,
        )
        greater = self.task.greater_is_better if main_metric is None else True
        tracking.start_trackers(
            accelerator,
            self.settings.logger,
            self.output_dir,
            self.settings.resolved,
            tags,
            main_metric or self.main_metric,
            greater,
        )
        return self.metrics

    def finish(self, result: RunResult, **extra: Any) -> RunResult:
        """Close metrics.jsonl and the trackers, and write ``results.json``, one shape for every
        mode: the mode, the model, the main metric and its value, every final metric, the
        overrides, and what the mode adds (``extra``: steps and the best checkpoint of a
        training run, the predictions file of a predict run, lm-eval's report)."""
        if self.metrics is not None:
            self.metrics.close()
        if self.settings.mode != "predict":
            tracking.finish_trackers(self.accelerator, self.settings.logger, result.metrics)
        if self.accelerator.is_main_process:
            tracking.write_results(
                self.output_dir,
                {
                    "mode": str(self.settings.mode),
                    "model": self.settings.model.name_or_path,
                    "main_metric": result.main_metric,
                    "main_value": result.main_value,
                    "greater_is_better": result.greater_is_better,
                    "metrics": result.metrics,
                    **extra,
                    "overrides": tracking.hydra_context().get("overrides", []),
                },
            )
        return result

    def result(self, metrics: dict[str, float]) -> RunResult:
        return RunResult(self.output_dir, metrics, self.main_metric, self.task.greater_is_better)


# ------------------------------------------------------------------------------------ helpers


def pad_task_batches(data: TaskData, multiple: int | None, fixed: int | None = None) -> None:
    """``trainer.pad_to_multiple_of``, and ``trainer.padding=max_length``'s length ``fixed``, for
    a task's own collators that pad (:class:`PadsToMultiple`, :class:`PadsToLength`), as for
    the default one."""
    for collator in (data.train_collator, data.eval_collator):
        if isinstance(collator, PadsToMultiple):
            collator.pad_to_multiple_of = multiple
        if fixed is not None and isinstance(collator, PadsToLength):
            collator.max_length = fixed
            collator.padding = "max_length"


def format_metrics(metrics: dict[str, float]) -> str:
    """``loss=1.234, f1=56.78``: the numbers of ``metrics`` for a log line."""
    return ", ".join(
        f"{k.split('/', 1)[-1]}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))
    )


def build_accelerator(settings: Settings) -> Accelerator:
    trainer_cfg = settings.trainer
    mesh.check()  # a parallelism_config mesh that does not fit the processes: one line
    memory.set_fsdp_offload(trainer_cfg.fsdp_offload)
    return Accelerator(
        mixed_precision=resolve_mixed_precision(trainer_cfg.mixed_precision),
        gradient_accumulation_steps=trainer_cfg.gradient_accumulation_steps,
        log_with=settings.logger.trackers or None,
        # non_blocking lets pinned batches copy to the device while it computes.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, non_blocking=trainer_cfg.pin_memory
        ),
        # TensorBoard's folder; set again once all ranks agree on the run folder
        project_config=ProjectConfiguration(
            logging_dir=str(Path(settings.output_dir) / "tensorboard")
        ),
        # A collective that waits this long (a rank died) raises instead of hanging forever.
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=trainer_cfg.distributed_timeout_s))
        ],
    )


def resolve_mixed_precision(requested: str) -> str:
    """``trainer.mixed_precision`` as accelerate takes it: ``auto`` becomes this machine's choice
    (:func:`recipes.device.default_mixed_precision`; the CPU's under
    ``accelerate launch --cpu``)."""
    if requested != "auto":
        return requested
    # Decided before the Accelerator exists: creating accelerate's state here would fix the
    # distributed setup without the launcher's CPU flag (`accelerate launch --cpu`).
    if parse_flag_from_env("ACCELERATE_USE_CPU"):
        return device.default_mixed_precision(device.CPU)
    return device.default_mixed_precision()


def _reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so that the next job of a sweep (run in this
    process by Hydra's launcher) builds its own Accelerator, with its own precision, say.
    accelerate keeps this state in singletons and offers only these (private) resets."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _check_launcher() -> None:
    """Refuse a DeepSpeed launch on MUSA before accelerate builds its engine (which would fail
    there deep inside DeepSpeed, or run on whatever accelerator DeepSpeed guessed)."""
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") and not parse_flag_from_env(
        "ACCELERATE_USE_CPU"
    ):
        reason = device.deepspeed_unsupported_reason()
        if reason is not None:
            raise ConfigError(
                f"distributed_type: DEEPSPEED in the accelerate config: {reason}. Launch with "
                "conf/accelerate/fsdp2.yaml on one node (ZeRO-3's sharding) or "
                "conf/accelerate/hsdp_musa.yaml across nodes."
            )


def _check_grad_scaler(accelerator: Accelerator) -> None:
    """Refuse fp16 on a GPU without a loss scaler: small gradients underflow to zero unseen.

    accelerate 0.33-0.34 assign the MUSA scaler to ``self.scalar`` (a typo, fixed in 1.0 by
    PR #3116), so ``accelerator.scaler`` stays None there."""
    if accelerator.native_amp and accelerator.mixed_precision == "fp16" and not accelerator.scaler:
        raise ConfigError(
            "trainer.mixed_precision=fp16: this accelerate creates no grad scaler on "
            f"{accelerator.device.type} (accelerate 0.33-0.34 on MUSA). Install accelerate>=1.0, "
            "or set trainer.mixed_precision=no (or bf16 where the device has it)."
        )


def _check_device_support(trainer_cfg: TrainerConfig, accelerator: Accelerator) -> None:
    """Refuse, before any model loads, what this device's torch_musa release cannot run."""
    where, precision = accelerator.device.type, accelerator.mixed_precision
    if trainer_cfg.compile and (reason := device.compile_unsupported_reason(where)):
        raise ConfigError(f"trainer.compile=true: {reason}. Set trainer.compile=false.")
    if reason := device.tf32_unsupported_reason(trainer_cfg.tf32, where):
        raise ConfigError(
            f"trainer.tf32=false: {reason}. Unset {device.MUBLAS_TF32_OVERRIDE}, or set "
            "trainer.tf32=true."
        )
    if reason := device.fsdp2_overlap_unsupported_reason(where):
        raise ConfigError(
            f"{device.FSDP2_OVERLAP_ENV}={os.environ[device.FSDP2_OVERLAP_ENV]}: {reason}."
        )
    if trainer_cfg.gradient_checkpointing and (
        reason := device.checkpointing_autocast_unsupported_reason(precision, where)
    ):
        raise ConfigError(
            f"trainer.gradient_checkpointing=true with trainer.mixed_precision={precision}: "
            f"{reason}. Use a MUSA image with torch_musa v1.3.2 or later, or set "
            "trainer.mixed_precision=no, or trainer.gradient_checkpointing=false."
        )


def _check_saved_head(cfg: ModelConfig, task: Task, num_labels: int | None, mode: str) -> None:
    """Refuse ``mode`` (eval, predict) of a model whose config.json says it has another task's
    head (a reward model's final/ under task=sft: scored as a causal LM, its numbers meaningless)
    or a head of another size (``num_labels``), naming the run that trained it, where known."""
    config = saved_config(cfg)
    mismatch = head_mismatch(config, task.auto_model_class, num_labels) if config else None
    if mismatch is None:
        return
    saved, scored = mismatch
    trained_by = _trained_by(Path(cfg.name_or_path).expanduser())
    fix = (
        f"Use the recipe that trained it ({trained_by})"
        if trained_by
        else "Use a recipe whose task trains that head"
    )
    raise ConfigError(
        f"mode={mode}: model.name_or_path={cfg.name_or_path} is {saved} by its config.json, and "
        f"task={task.args.NAME} scores {scored}: its numbers would be meaningless. {fix}, or "
        "give a final/ of this recipe."
    )


def _trained_by(folder: Path) -> str | None:
    """``recipe=<name>, task=<name>`` of the run that wrote ``folder`` (a run's final/: its
    recipe.json, and the run folder's results.json), as far as they say; None for others."""
    said = []
    recipe = checkpoint.final_recipe(folder) if folder.is_dir() else None
    try:
        overrides = json.loads((folder.parent / "results.json").read_text())["overrides"]
    except (OSError, ValueError, KeyError, TypeError):
        overrides = []
    said += [o for o in overrides if isinstance(o, str) and o.startswith("recipe=")][:1]
    target = ((recipe or {}).get("task") or {}).get("_target_")
    said += [f"task={n}" for n, c in config_classes().items() if c._target_ == target][:1]
    return ", ".join(said) or None


def _check_fsdp_for_lora(accelerator: Accelerator) -> None:
    """LoRA under FSDP trains some parameters of each wrapped layer and freezes the others:
    FSDP1 needs ``fsdp_use_orig_params: true`` for that (peft's and accelerate's advice); FSDP2
    shards parameters one by one and needs nothing."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        return
    if getattr(plugin, "fsdp_version", 1) == 1 and not plugin.use_orig_params:
        raise ConfigError(
            "peft=lora with FSDP (fsdp_version 1) needs fsdp_use_orig_params: true in the "
            "accelerate config (conf/accelerate/fsdp.yaml has it), as frozen and trained "
            "parameters share each wrapped layer; or use conf/accelerate/fsdp2.yaml."
        )


def final_model_settings(settings: Settings, output_dir: Path) -> Any:
    """``model.*`` pointing at a run's ``final/`` as saved (what ``trainer.benchmarks`` load)."""
    return replace(
        settings.model,
        name_or_path=str(output_dir / checkpoint.FINAL),
        revision=None,
        gguf_file=None,
        attention_dropout=None,
        config_overrides={},
    )
