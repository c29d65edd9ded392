"""What a run does: one runner per ``mode`` (train, eval, predict, benchmark) over one
:class:`Session`, the setup they share (the run folder and its log, the device, the task, the
tokenizer, model loading, trackers and the results file).

Read it in this order: :func:`run` (build the task and the accelerator, pick the runner, and tidy
up whatever happens), :class:`Session`, then the runners. Training itself is
:class:`recipes.loop.Trainer`; the others are a few lines each: ``eval`` builds no optimizer,
``predict`` and ``benchmark`` read no training data.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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

from recipes import adapters, checkpoint, device, evaluation, runs, tracking
from recipes import data as data_lib
from recipes.config import ConfigError, Settings, TrainerConfig
from recipes.faults import StopRequest, TrainingError, disk_full_stop, peer_failures_reported
from recipes.log import get_logger, note_in_log_file, setup_logging
from recipes.model import (
    config_overrides,
    fit_to_tokenizer,
    load_model,
    load_tokenizer,
    share_tied_embeddings,
    weights_summary,
)
from recipes.tasks.base import PadsToLength, PadsToMultiple, RunContext, Task, TaskData
from recipes.tracking import MetricsLogger

log = get_logger(__name__)


def run(settings: Settings) -> RunResult:
    """Run what ``settings`` (the validated config, :func:`recipes.config.validate`) describe;
    returns the run's final scores.

    Raises:
        ConfigError / DataError: bad settings or data, before any expensive work.
        TrainingError: a non-finite loss with ``trainer.on_nonfinite=stop``.
        Interrupted: SIGTERM / SIGINT; a checkpoint was saved first.
        PeerFailed: another rank died or hung; already reported on stderr.
    """
    task = build_task(settings.task)
    _check_launcher()
    settings, chosen = with_device_defaults(settings, task)
    settings = benchmark_run_folder(settings)
    with peer_failures_reported(settings.output_dir):  # a rank that never joined
        accelerator = build_accelerator(settings)
    stop = StopRequest()  # installed when training starts (until then a signal ends the run)
    try:
        with peer_failures_reported(settings.output_dir):  # said before `stop` lets SIGTERM kill
            session = Session(settings, task, accelerator, stop, chosen)
            return RUNNERS[str(settings.mode)](session)
    except (ConfigError, data_lib.DataError, TrainingError) as err:
        note_in_log_file(f"error: {err}", settings.output_dir)  # train.py says it on the terminal
        raise
    except OSError as err:  # a full disk in a write of one process (recipes.faults)
        stop_line = disk_full_stop(err, settings.output_dir, str(settings.mode))
        if stop_line is None:
            raise
        note_in_log_file(f"error: {stop_line}", settings.output_dir)
        raise stop_line from err
    finally:
        stop.restore()
        runs.release_all()
        # Also on errors: with gloo / MCCL the process group must be destroyed or ranks hang.
        tracking.end_training(accelerator, settings.output_dir)  # wandb's report to a file
        if tracking.hydra_context().get("sweep_dir"):
            _reset_accelerate()


def with_device_defaults(settings: Settings, task: Task) -> tuple[Settings, list[str]]:
    """``settings`` with the trainer's speed settings that the recipe left null decided for this
    device (:func:`recipes.device.training_defaults`), and one line per setting saying what was
    chosen and why (a value the recipe or the command line set is kept, and said to be)."""
    trainer_cfg = settings.trainer
    kind = (
        device.CPU if parse_flag_from_env("ACCELERATE_USE_CPU") else device.backend()
    )  # as resolve_mixed_precision decides: `accelerate launch --cpu` runs on the CPU
    sharded = parse_flag_from_env("ACCELERATE_USE_FSDP") or parse_flag_from_env(
        "ACCELERATE_USE_DEEPSPEED"
    )
    defaults = device.training_defaults(
        kind,
        generates=task.language_model,
        whole_model=not sharded,
        musa_version=device.torch_musa_info()["version"] if kind == device.MUSA else None,
    )
    decided, lines = {}, []
    for default in defaults:
        value = getattr(trainer_cfg, default.name)
        if value is None:
            decided[default.name] = value = default.value
            lines.append(f"trainer.{default.name}={_shown(value)} ({kind}: {default.why})")
        else:
            lines.append(f"trainer.{default.name}={_shown(value)} (set by the run's config)")
    return replace(settings, trainer=replace(trainer_cfg, **decided)), lines


def benchmark_run_folder(settings: Settings) -> Settings:
    """``mode=benchmark`` with neither a model nor a recipe given is refused (it would score the
    default recipe's model). Without ``recipe=`` or ``output_dir=``: Hydra's folder is named for the
    default recipe (``outputs/bert_squad/<date_time>``), which has nothing to do with the model
    benchmarked, so the run goes to ``outputs/benchmark/<date_time>`` and Hydra's folder, empty,
    is removed. A folder given (``output_dir=``, or a ``hydra.run.dir`` of one's own), a recipe
    given, or a sweep's job folder is kept."""
    from hydra.core.hydra_config import HydraConfig

    context = tracking.hydra_context()
    given = {o.split("=", 1)[0].lstrip("+~") for o in context.get("overrides", [])}
    if settings.mode != "benchmark" or not context:
        return settings
    if not {"recipe", "model", "model.name_or_path"} & given:
        raise ConfigError(
            "mode=benchmark scores a model, and none was given (the default recipe's "
            f"{settings.model.name_or_path} would be): set model.name_or_path=<a run's final/ "
            "or a Hub id>, or recipe=<the recipe whose model to score>."
        )
    if context["sweep_dir"]:
        return settings
    hydra_folder = Path(settings.output_dir)
    if (
        {"recipe", "output_dir"} & given
        or str(HydraConfig.get().runtime.output_dir) != settings.output_dir
        or hydra_folder.parent.name != context["recipe"]
    ):
        return settings
    folder = str(hydra_folder.parent.parent / "benchmark" / hydra_folder.name)
    _remove_if_empty(hydra_folder)
    return replace(
        settings, output_dir=folder, resolved={**settings.resolved, "output_dir": folder}
    )


def _remove_if_empty(folder: Path) -> None:
    """``folder`` and its parent, where they hold nothing (an empty ``train.log``, Hydra's own
    job log, counts as nothing): the folders Hydra made for a run that went elsewhere."""
    log_file = folder / "train.log"
    try:
        if log_file.is_file() and log_file.stat().st_size == 0 and len(list(folder.iterdir())) == 1:
            log_file.unlink()
        folder.rmdir()  # only if empty
        folder.parent.rmdir()
    except OSError:  # not empty, or another rank removed it
        pass


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def build_task(config: Any) -> Task:
    """The task ``config`` (a typed task config, :mod:`recipes.tasks.configs`) describes."""
    from hydra.utils import get_class

    return get_class(config._target_)(config)


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

    def context(self) -> RunContext:
        return RunContext(
            self.accelerator,
            self.tokenizer,
            self.output_dir,
            self.settings.generation,
            self.settings.trainer.log_every_n_steps,
        )

    # ------------------------------------------------------------------------ data and model

    def build_data(self, predict: bool = False) -> TaskData:
        """The task's features (the rows of data.predict_file with ``predict``), built on the
        main process first (the others then read its cache)."""
        settings, task = self.settings, self.task
        config_overrides(settings.model)  # checked before the data is read
        with self.accelerator.main_process_first():
            if predict:
                return task.build_predict_data(settings.data, self.tokenizer)
            return task.build_data(settings.data, self.tokenizer)

    def load_model(self, data: TaskData, trained_for: str | None) -> torch.nn.Module:
        """The model of ``model.*`` with the task's head, checked by the task, fitted to the
        tokenizer, with LoRA adapters (``peft=lora``) and gradient checkpointing as configured.
        ``trained_for``: the mode that needs the head trained (eval, predict), or None."""
        model_cfg, task = self.settings.model, self.task
        model = load_model(
            model_cfg,
            task.auto_model_class,
            config_overrides(model_cfg),
            trained_for=trained_for,
            **({} if trained_for == "predict" else task.model_kwargs(data)),
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
        return model

    def padding(self, data: TaskData) -> DataCollatorWithPadding:
        """The collator of a task without its own: each batch padded to its longest row (to
        the data's max_length with trainer.padding=max_length), to trainer.pad_to_multiple_of."""
        fixed = data.max_length if self.trainer_cfg.padding == "max_length" else None
        return DataCollatorWithPadding(
            self.tokenizer,
            padding="max_length" if fixed else "longest",
            max_length=fixed,
            pad_to_multiple_of=self.trainer_cfg.pad_to_multiple_of,
        )

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


# ------------------------------------------------------------------------------------ runners


def train(session: Session) -> RunResult:
    """``mode=train``: the recipe's training run (:class:`recipes.loop.Trainer`)."""
    from recipes.loop import Trainer

    trainer = Trainer(session)
    session.stop.install()
    return trainer.finish(trainer.fit())


def evaluate(session: Session) -> RunResult:
    """``mode=eval``: score the model as loaded (``model.name_or_path``, or the checkpoint of
    ``resume=...``) on the eval split, with the task's own evaluation; nothing trains, and no
    optimizer is built."""
    accelerator, task = session.accelerator, session.task
    # A final/ evaluated against a reference built from itself: refused before any work.
    _check_evaluated_model(task, session.settings.model.name_or_path, session.resume_from)
    data = session.build_data()
    # The weights of model.name_or_path as they are; with resume=..., the checkpoint's replace
    # them (a task's reference model is built from the starting weights first).
    as_is = "eval" if session.resume_from is None else None
    model = session.load_model(data, trained_for=as_is)
    model, loader = accelerator.prepare(model, session.eval_loader(data))
    if adapters.is_peft_model(accelerator.unwrap_model(model)):
        adapters.register_checkpoint_hooks(accelerator)  # checkpoints hold what trains
    run = session.context()
    task.before_training(model, data, run, session.trainer_cfg.per_device_eval_batch_size)
    state = checkpoint.TrainerState()
    if session.resume_from is not None:
        state = checkpoint.load(accelerator, session.resume_from)
    metrics = session.start_trackers()
    scores = evaluation.evaluate(task, model, loader, data, run)
    step = state.step
    metrics.log({**scores, "train/samples_seen": round(state.train_samples)}, step)
    log.info("eval at step %d: %s", step, format_metrics(scores))
    where = session.resume_from or session.settings.model.name_or_path
    log.info("evaluated %s: %s", where, format_metrics(scores))
    return session.finish(session.result(scores), best=state.best, steps=state.step)


def _check_evaluated_model(task: Task, model: str, resume: Path | None) -> None:
    """``mode=eval`` of a task evaluated against its starting weights (a reference or teacher
    built from the weights loaded): without ``resume`` it would score ``model`` against itself
    (every reward, margin and KL exactly 0), so it is refused, with the way to real numbers."""
    if resume is not None or not task.evaluates_against_start:
        return
    raise ConfigError(
        f"mode=eval with model.name_or_path={model}: task={task.args.NAME} scores a model against "
        "its reference model, which here would be the model itself (every reward and KL exactly "
        "0). Evaluate a checkpoint of its training run instead: resume=<run folder> with "
        "model.name_or_path set to the model that run started from (the recipe's)."
    )


def predict(session: Session) -> RunResult:
    """``mode=predict``: the model of ``model.name_or_path`` answers the rows of
    ``data.predict_file`` with the task's own code (its evaluation's windows and answer search,
    its generation); the task writes its predictions file to the run folder."""
    settings, accelerator = session.settings, session.accelerator
    _settings_from_final(session.task, settings.model.name_or_path)
    data = session.build_data(predict=True)
    model = session.load_model(data, trained_for="predict")
    pad_task_batches(data, session.trainer_cfg.pad_to_multiple_of)
    model, loader = accelerator.prepare(model, session.eval_loader(data))
    with evaluation.eval_mode(model):
        report = session.task.predict(model, loader, data, session.context())
    log.info(
        "predicted %d row(s) of %s with %s: %s",
        report["rows"],
        settings.data.predict_file,
        settings.model.name_or_path,
        session.output_dir / report["file"],
    )
    return session.finish(session.result({}), predict_file=settings.data.predict_file, **report)


def _settings_from_final(task: Task, model_dir: str) -> None:
    """The task's ``final_settings`` as the training run that wrote ``model_dir`` had them
    (its ``final/recipe.json``), unless the command line names them (then it wins, and a
    difference is said)."""
    saved = (checkpoint.final_recipe(model_dir) or {}).get("task") or {}
    given = tracking.given_on_command_line("task.")
    for name in task.final_settings:
        if name not in saved:
            continue
        ours, theirs = getattr(task.args, name), saved[name]
        if name in given:
            if ours != theirs:
                log.warning(
                    "task.%s=%s (the command line); %s was trained with %s",
                    name,
                    ours,
                    model_dir,
                    theirs,
                )
            continue
        if ours != theirs:
            log.info("task.%s=%s, as %s was trained (final/recipe.json)", name, theirs, model_dir)
        setattr(task.args, name, theirs)


def benchmark(session: Session) -> RunResult:
    """``mode=benchmark``: lm-eval's ``benchmark.tasks`` on the model of ``model.name_or_path``
    (:mod:`recipes.benchmark`). No data is read and nothing trains."""
    from recipes.benchmark import FOLDER, Benchmarks  # lm-eval, only where it is used

    settings = session.settings
    folder = session.output_dir / FOLDER
    benchmarks = Benchmarks(settings.benchmark.tasks, settings.benchmark, folder, "benchmark.tasks")
    report = benchmarks.run(settings.model, session.accelerator)
    result = RunResult(
        session.output_dir, report.scores, report.main_metric or "", report.greater_is_better
    )
    metrics = session.start_trackers(main_metric=result.main_metric)
    metrics.log(report.scores, 0)
    log.info("benchmarked %s: %s", settings.model.name_or_path, format_metrics(report.scores))
    return session.finish(result, tasks=settings.benchmark.tasks, lm_eval=report.results)


RUNNERS: dict[str, Callable[[Session], RunResult]] = {
    "train": train,
    "eval": evaluate,
    "predict": predict,
    "benchmark": benchmark,
}


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
    (:func:`recipes.device.default_mixed_precision`; the CPU's under ``accelerate launch --cpu``)."""
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
