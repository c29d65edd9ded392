"""The one training loop: every recipe runs through :func:`train`.

Everything that depends on the hardware (device placement, mixed precision, distributed data
parallelism, gradient accumulation, gathering for metrics) goes through ``accelerate``; the task
object only builds data, turns a batch into a loss and evaluates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from accelerate.utils import (
    DataLoaderConfiguration,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    broadcast_object_list,
    gather_object,
    parse_flag_from_env,
    set_seed,
)
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DataCollatorWithPadding, PreTrainedTokenizerBase

from recipes import checkpoint, device, tracking
from recipes import data as data_lib
from recipes.config import ConfigError, ModelConfig, Settings, TrainerConfig, instantiate, validate
from recipes.faults import Interrupted, StopRequest, TrainingError
from recipes.flops import FlopCounter, precision_for_peak
from recipes.log import get_logger, setup_logging
from recipes.optim import build_optimizer
from recipes.tasks.base import Task
from recipes.tracking import MetricsLogger

log = get_logger(__name__)


def _agree_on_output_dir(proposed: str) -> Path:
    """All ranks take rank 0's run folder (each rank's Hydra resolved its own timestamp)."""
    chosen = broadcast_object_list([proposed])[0]
    own = Path(proposed)
    if chosen != proposed and own.is_dir() and not any(own.iterdir()):
        own.rmdir()  # the empty folder Hydra made for this rank's own timestamp
    return Path(chosen)


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


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a missing or unreachable model fails with the key to fix.

    A tokenizer without a padding token (GPT-2, Llama) pads with its end-of-text token, as is
    usual for these models; the attention mask keeps padding out of the loss.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.name_or_path,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            **({"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}),
        )
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load a tokenizer ({_first_line(err)}). "
            "Give a local save_pretrained folder, or a hub name while online."
        ) from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg: ModelConfig, auto_class: Any, **task_kwargs: Any) -> torch.nn.Module:
    """The pretrained model with the task's head (new heads are initialised by transformers).

    ``task_kwargs`` are what the task learnt from its data (``num_labels``, say). A GGUF file
    (``model.gguf_file``) is dequantised on load and rebuilt as a plain model, so training and
    the saved folder are those of an ordinary Hugging Face model.
    """
    attn = cfg.attn_implementation
    if attn == "auto":
        attn = device.default_attn_implementation()
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code, **task_kwargs}
    if cfg.ignore_mismatched_sizes:
        kwargs["ignore_mismatched_sizes"] = True
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        try:
            model = auto_class.from_pretrained(cfg.name_or_path, attn_implementation=attn, **kwargs)
        except ValueError as err:
            if cfg.attn_implementation != "auto" or "attention" not in str(err).lower():
                raise
            log.warning("%s does not support %s attention; using eager", cfg.name_or_path, attn)
            model = auto_class.from_pretrained(
                cfg.name_or_path, attn_implementation="eager", **kwargs
            )
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load the model ({_first_line(err)})."
        ) from None
    if cfg.gguf_file:
        model = _plain_copy(model, auto_class)
    if model.config.pad_token_id is None and model.config.eos_token_id is not None:
        eos = model.config.eos_token_id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


def _plain_copy(model: torch.nn.Module, auto_class: Any) -> torch.nn.Module:
    """The same weights in a model built from its config without the GGUF quantisation record
    (transformers refuses to ``save_pretrained`` a model loaded from GGUF)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = auto_class.from_config(config, attn_implementation=config._attn_implementation)
    plain.load_state_dict(model.state_dict())
    return plain.to(next(model.parameters()).dtype)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass
class _Window:
    """Running sums between two log steps.

    Loss and token count stay on the device (no host sync per step); micro-batch and sample
    counts are known on the host.
    """

    loss_and_tokens: torch.Tensor
    micro_batches: int
    samples: int
    start: float

    @classmethod
    def fresh(cls, where: torch.device, saved: list[float] | None = None) -> _Window:
        loss, tokens, micro, samples = saved or [0.0, 0.0, 0, 0]
        sums = torch.tensor([loss, tokens], dtype=torch.float, device=where)
        return cls(sums, int(micro), int(samples), time.perf_counter())

    def as_list(self) -> list[float]:
        return [*self.loss_and_tokens.tolist(), self.micro_batches, self.samples]


def train(cfg: DictConfig) -> RunResult:
    """Run the recipe described by the composed config ``cfg``; returns its final evaluation.

    Raises:
        ConfigError / DataError: bad settings or data, before any expensive work.
        TrainingError: a non-finite loss with ``trainer.on_nonfinite=stop``.
        Interrupted: SIGTERM / SIGINT; a checkpoint was saved first.
    """
    settings: Settings = validate(cfg)
    task = instantiate(cfg, "task")  # checks its own settings before any heavy work
    t: TrainerConfig = settings.trainer

    accelerator = Accelerator(
        mixed_precision=resolve_mixed_precision(t.mixed_precision),
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=settings.logger.trackers or None,
        # non_blocking lets pinned batches copy to the device while it computes.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, non_blocking=t.pin_memory
        ),
        # TensorBoard's folder; set again once all ranks agree on the run folder
        project_config=ProjectConfiguration(logging_dir=str(Path(cfg.output_dir) / "tensorboard")),
        # A collective that waits this long (a rank died) raises instead of hanging forever.
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=t.distributed_timeout_s))
        ],
    )
    stop = StopRequest()  # installed when training starts (until then a signal ends the run)
    try:
        return _run(cfg, settings, task, accelerator, stop)
    finally:
        stop.restore()
        # Also on errors: with gloo / MCCL the process group must be destroyed or ranks hang.
        accelerator.end_training()
        if tracking.hydra_context().get("sweep_dir"):
            _reset_accelerate()


def _reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so that the next job of a sweep (run in this
    process by Hydra's launcher) builds its own Accelerator, with its own precision, say.
    accelerate keeps this state in singletons and offers only these (private) resets."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _open_run_folder(cfg: DictConfig, accelerator: Accelerator) -> tuple[Path, Path | None]:
    """The run folder all ranks share and the checkpoint to continue from (if any).

    Rank 0 looks and every rank learns the verdict, so that all of them stop together.
    """
    output_dir = _agree_on_output_dir(str(cfg.output_dir))
    verdict: tuple[str, str | None] | None = None
    if accelerator.is_main_process:
        try:
            found = _check_run_folder(output_dir, cfg.get("resume"))
            verdict = ("ok", str(found) if found else None)
        except ConfigError as err:
            verdict = ("error", str(err))
    kind, value = broadcast_object_list([verdict])[0]
    if kind == "error":
        raise ConfigError(value)
    resume_from = Path(value) if value else None
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        config_file = output_dir / "config.yaml"
        if resume_from is None or not config_file.exists():
            config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    return output_dir, resume_from


def _check_run_folder(output_dir: Path, resume: str | None) -> Path | None:
    """Refuse a folder whose results would be overwritten; find the checkpoint to resume."""
    found = checkpoint.resolve(resume, output_dir)
    if (output_dir / "final").exists():
        raise ConfigError(
            f"output_dir={output_dir} already holds a finished run (final/); nothing was changed. "
            "Pick a new folder with output_dir=... (or remove that one)."
        )
    marker = next((m for m in ("metrics.jsonl", "checkpoints") if (output_dir / m).exists()), None)
    if marker is None or resume == "auto":
        return found
    if resume is None:
        raise ConfigError(
            f"output_dir={output_dir} already holds a run ({marker}); nothing was changed. "
            "Continue it with resume=auto, or pick a new folder with output_dir=..."
        )
    assert found is not None
    latest = checkpoint.complete(checkpoint.root(output_dir))
    if (
        latest
        and found.resolve() != latest[-1].resolve()
        and output_dir.resolve() in found.resolve().parents
    ):
        raise ConfigError(
            f"resume={resume}: output_dir={output_dir} has newer checkpoints ({latest[-1].name}); "
            "continuing an older one there would mix two runs. Continue it in a new folder "
            "(output_dir=...), or resume the latest with resume=auto."
        )
    if output_dir.resolve() not in found.resolve().parents:
        raise ConfigError(
            f"output_dir={output_dir} holds another run ({marker}); resuming {found} there would "
            "mix the two. Pick a new folder with output_dir=..., or continue that run with "
            f"output_dir={found.parent.parent} resume=auto."
        )
    return found


@dataclass
class _Loop:
    """What the training loop works with, built once by :func:`_run`."""

    accelerator: Accelerator
    settings: Settings
    task: Task
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    collator: Any
    output_dir: Path
    metrics: MetricsLogger
    state: checkpoint.TrainerState
    steps_per_epoch: int
    total_steps: int
    flops: FlopCounter


def _run(
    cfg: DictConfig, settings: Settings, task: Task, accelerator: Accelerator, stop: StopRequest
) -> RunResult:
    t = settings.trainer
    output_dir, resume_from = _open_run_folder(cfg, accelerator)
    setup_logging(accelerator.is_main_process, output_dir / "train.log")
    log.info("run folder: %s", output_dir)
    log.info(
        "device %s, %d process(es), mixed precision %s, distributed %s",
        accelerator.device,
        accelerator.num_processes,
        accelerator.mixed_precision,
        accelerator.distributed_type,
    )
    _check_grad_scaler(accelerator)
    if t.compile and (reason := device.compile_unsupported_reason(accelerator.device.type)):
        raise ConfigError(f"trainer.compile=true: {reason}. Set trainer.compile=false.")
    tf32 = device.set_tf32(t.tf32)  # both ways: torch_musa 2.7 turns TF32 on by default
    device.reset_peak_memory_stats(accelerator.device)  # train/peak_memory_gib is this run's
    set_seed(t.seed)

    tokenizer = load_tokenizer(settings.model)
    with accelerator.main_process_first():
        data = task.build_data(settings.data, tokenizer)
    model = load_model(settings.model, task.auto_model_class, **task.model_kwargs())
    task.check_model(model)

    fixed = getattr(task, "max_seq_length", None) if t.padding == "max_length" else None
    padding = DataCollatorWithPadding(
        tokenizer,
        padding="max_length" if fixed else "longest",
        max_length=fixed,
        pad_to_multiple_of=t.pad_to_multiple_of,
    )
    collator = data.train_collator or padding
    if data.random_collator:
        collator = checkpoint.SeededCollator(collator, t.seed)
    global_batch = (
        t.per_device_train_batch_size * accelerator.num_processes * t.gradient_accumulation_steps
    )
    sampler = None
    if t.group_by_length and not fixed:  # padded to max_length, grouping would save nothing
        lengths = data_lib.feature_lengths(data.train)
        if len(lengths) and lengths.min() < lengths.max():  # packed blocks: plain shuffle
            # One sampler batch per optimizer step: the same examples in every layout of it.
            sampler = data_lib.EpochLengthGroupedSampler(
                global_batch, lengths, t.seed, megabatch=t.length_group_size
            )
    train_loader = DataLoader(
        data.train,
        batch_size=t.per_device_train_batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        collate_fn=collator,
        num_workers=t.dataloader_num_workers,
        **device.pin_memory_kwargs(t.pin_memory, accelerator.device),
    )
    eval_loader = DataLoader(
        data.eval,
        batch_size=t.per_device_eval_batch_size,
        collate_fn=data.eval_collator or padding,
        num_workers=t.dataloader_num_workers,
        **device.pin_memory_kwargs(t.pin_memory, accelerator.device),
    )
    optimizer = build_optimizer(instantiate(cfg, "optimizer"), model, accelerator.device)
    flops = FlopCounter(
        model, accelerator.device, precision_for_peak(accelerator.mixed_precision, tf32)
    )
    if t.compile:
        _compile(model)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    # Steps are optimizer updates of one global batch, whatever the number of processes: each
    # process takes len(train_loader) batches of its shard per epoch.
    steps_per_epoch = math.ceil(len(train_loader) / t.gradient_accumulation_steps)
    total_steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_epochs * steps_per_epoch)
    scheduler = instantiate(cfg, "scheduler")(
        optimizer=optimizer,
        num_training_steps=total_steps,
        num_processes=accelerator.num_processes,
    )
    scheduler = accelerator.prepare(scheduler)

    log.info(
        "%d training features, global batch %d (%d per device x %d processes x %d "
        "accumulation), %d steps per epoch, %d optimizer steps",
        len(data.train),
        global_batch,
        t.per_device_train_batch_size,
        accelerator.num_processes,
        t.gradient_accumulation_steps,
        steps_per_epoch,
        total_steps,
    )

    resolved = OmegaConf.to_container(cfg, resolve=True)
    state = checkpoint.TrainerState(
        guarded=_guarded(settings, global_batch, len(data.train), sampler is not None),
        config=resolved,
    )
    keep_until_step = None
    if resume_from is not None:
        state = _resume(accelerator, resume_from, state, scheduler)
        keep_until_step = state.step
    elif cfg.get("resume") == "auto":
        log.info("resume=auto: no checkpoint in %s yet; starting at step 0", output_dir)
        keep_until_step = -1  # what an earlier attempt logged is logged again

    metrics_logger = MetricsLogger(accelerator, output_dir, keep_until_step=keep_until_step)
    main_metric = f"eval/{task.main_metric}"
    tracking.start_trackers(
        accelerator,
        settings.logger,
        output_dir,
        resolved,
        tracking.run_tags(
            tracking.hydra_context().get("recipe"),
            settings.model.name_or_path,
            accelerator.device.type,
            accelerator.num_processes,
        ),
        main_metric,
        task.greater_is_better,
    )
    loop = _Loop(
        accelerator=accelerator,
        settings=settings,
        task=task,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        train_loader=train_loader,
        eval_loader=eval_loader,
        collator=collator,
        output_dir=output_dir,
        metrics=metrics_logger,
        state=state,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        flops=flops,
    )
    stop.install()
    final = _fit(loop, stop)

    extra = task.after_training(model, tokenizer, accelerator, output_dir)
    if extra:
        metrics_logger.log(extra, state.step)
    if t.save_final_model:
        _save_final(accelerator, model, tokenizer, output_dir / "final")
    metrics_logger.close()
    result = RunResult(
        output_dir=output_dir,
        metrics=final,
        main_metric=main_metric,
        greater_is_better=task.greater_is_better,
    )
    tracking.finish_trackers(accelerator, settings.logger, final)
    if accelerator.is_main_process:
        tracking.write_results(output_dir, result.as_dict(state))
        _plot(output_dir)
    log.info(
        "done: %d steps in %.1f s of training (%.3f s/step); %s",
        state.step,
        state.train_seconds,
        state.train_seconds / max(state.step, 1),
        _fmt(final) if final else "no evaluation",
    )
    return result


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


def _compile(model: torch.nn.Module) -> None:
    """``torch.compile`` the model in place (``nn.Module.compile``), so that its state dict,
    checkpoints and ``final/`` keep their usual keys (``torch.compile(model)`` would wrap it and
    prefix every key with ``_orig_mod.``). Shapes that vary with dynamic padding are compiled as
    dynamic after the first recompile."""
    if hasattr(model, "compile"):
        model.compile()
    else:  # torch < 2.2
        model.forward = torch.compile(model.forward)
    log.info("trainer.compile: the model is compiled on its first batches (slow first steps)")


def _plot(output_dir: Path) -> None:
    """``curves.png`` in the run folder; a missing plotting library only costs the picture."""
    try:
        from recipes.plots import plot_runs

        log.info("curves: %s", plot_runs([output_dir], output_dir / "curves.png"))
    except Exception as err:  # the model is saved; a picture must not fail the run
        log.warning("no curves.png: %s", err)


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

    def as_dict(self, state: checkpoint.TrainerState) -> dict[str, Any]:
        return {
            "main_metric": self.main_metric,
            "main_value": self.main_value,
            "greater_is_better": self.greater_is_better,
            "metrics": self.metrics,
            "best": state.best,
            "steps": state.step,
            "train_seconds": state.train_seconds,
            "overrides": tracking.hydra_context().get("overrides", []),
        }


def _guarded(
    settings: Settings, global_batch: int, train_features: int, grouped: bool
) -> dict[str, Any]:
    """Settings that decide which batches the steps see: a resumed run must share them.
    ``grouped``: whether batches are length-grouped (``trainer.group_by_length`` with dynamic
    padding on data whose lengths differ; packed blocks are shuffled either way)."""
    data = {
        k: v
        for k, v in vars(settings.data).items()
        if k not in ("cache_dir", "preprocessing_num_workers", "max_eval_examples")
        and not k.startswith("eval_")
    }
    return {
        "global_batch": global_batch,
        "train_features": train_features,
        "trainer.seed": settings.trainer.seed,
        # The batches' order; this sampler's order differs from the transformers one that
        # earlier releases used under the same setting, so a grouped checkpoint says which.
        "trainer.group_by_length": _batch_order(settings.trainer.length_group_size)
        if grouped
        else False,
        "model.name_or_path": settings.model.name_or_path,
        "data": data,
    }


def _batch_order(group_size: int) -> str:
    # Groups of 50 were the only size before trainer.length_group_size: their checkpoints say so.
    if group_size == 50:
        return "length-grouped, batches shuffled"
    return f"length-grouped by {group_size} batches, batches shuffled"


def _resume(
    accelerator: Accelerator, path: Path, fresh: checkpoint.TrainerState, scheduler: Any
) -> checkpoint.TrainerState:
    saved = checkpoint.read_state(path)
    changed = checkpoint.check_compatible(saved, fresh.guarded, fresh.config)
    if changed:
        log.warning("resuming with changed settings: %s", ", ".join(changed))
    state = checkpoint.load(accelerator, path)
    if len(state.window) != accelerator.num_processes:  # a new process count, same global batch
        # accelerate ticks the schedule once per process and step (see build_scheduler).
        ticks = getattr(scheduler, "scheduler", scheduler).last_epoch
        _set_schedule_position(
            scheduler, ticks // max(len(state.window), 1) * accelerator.num_processes
        )
        totals = (
            [sum(column) for column in zip(*state.window, strict=True)] if state.window else None
        )
        state.window = [totals or [0.0, 0.0, 0, 0]] + [[0.0, 0.0, 0, 0]] * (
            accelerator.num_processes - 1
        )
    state.guarded, state.config = fresh.guarded, fresh.config
    log.info(
        "resumed from %s: step %d, epoch %d, %d steps into the epoch",
        path,
        state.step,
        state.epoch,
        state.steps_in_epoch,
    )
    return state


def _set_schedule_position(scheduler: Any, ticks: int) -> None:
    """Move a ``LambdaLR`` schedule (every transformers schedule) to ``ticks`` and set the
    optimizer's learning rates accordingly."""
    inner = getattr(scheduler, "scheduler", scheduler)
    inner.last_epoch = ticks
    inner._last_lr = [
        base * factor(ticks) for base, factor in zip(inner.base_lrs, inner.lr_lambdas, strict=True)
    ]
    for group, lr in zip(inner.optimizer.param_groups, inner._last_lr, strict=True):
        group["lr"] = lr


def _fit(loop: _Loop, stop: StopRequest) -> dict[str, float]:
    """The training loop: epochs of micro-batches, an optimizer step every
    ``gradient_accumulation_steps``, logging, evaluation and checkpoints at step boundaries."""
    accelerator, t, state = loop.accelerator, loop.settings.trainer, loop.state
    model, optimizer, scheduler = loop.model, loop.optimizer, loop.scheduler
    rank = accelerator.process_index
    saving = t.save_every_n_steps > 0 or t.save_at_epoch_end
    final: dict[str, float] = {}
    window = _Window.fresh(accelerator.device, state.window[rank] if state.window else None)
    step_loss = torch.zeros((), device=accelerator.device)
    grad_norm: torch.Tensor | None = None
    check_grad = accelerator.scaler is None  # fp16's scaler skips overflowing steps itself
    progress = tqdm(
        total=loop.total_steps,
        initial=state.step,
        desc="train",
        dynamic_ncols=True,
        disable=not (accelerator.is_local_main_process and t.progress_bar),
    )

    saved = -1

    def save(reason: str) -> Path:
        nonlocal saved
        saved = state.step
        state.window = gather_object([window.as_list()])
        path = checkpoint.save(accelerator, loop.output_dir, state, model, loop.tokenizer)
        if accelerator.is_main_process:
            if state.best is not None and state.best["step"] == state.step:
                checkpoint.mark_best(loop.output_dir, state)
            best_step = state.best["step"] if state.best else None
            checkpoint.rotate(loop.output_dir, t.keep_last_n_checkpoints, best_step)
        log.info("checkpoint (%s): %s", reason, path)
        return path

    try:
        if t.eval_at_start and state.step == 0:
            _evaluate(loop, 0)
            window.start = time.perf_counter()
        elif _eval_due(t, state):  # stopped by a signal before its evaluation: do it now
            final, _ = _evaluate(loop, state.step)
            window.start = time.perf_counter()
        model.train()
        while state.step < loop.total_steps:
            if state.steps_in_epoch >= loop.steps_per_epoch:  # resumed at an epoch's last step
                state.epoch, state.steps_in_epoch = state.epoch + 1, 0
            loop.train_loader.set_epoch(state.epoch)
            if isinstance(loop.collator, checkpoint.SeededCollator):
                loop.collator.epoch = state.epoch
            # The position in micro-batches of this process (also right when a resumed run
            # reaches the same global batch with other processes / accumulation settings).
            state.batches_in_epoch = state.steps_in_epoch * t.gradient_accumulation_steps
            accelerator.step = state.batches_in_epoch  # accelerate's accumulation counter
            batches = loop.train_loader
            if state.batches_in_epoch:  # resumed mid-epoch: the same order, without what was done
                batches = skip_first_batches(loop.train_loader, state.batches_in_epoch)
                batches.set_epoch(state.epoch)  # older accelerate rebuilds it at epoch 0
            for batch in batches:
                checkpoint.reseed(t.seed, rank, state.epoch, state.batches_in_epoch)
                state.batches_in_epoch += 1
                with accelerator.accumulate(model):
                    loss = loop.task.loss(model, batch)
                    accelerator.backward(loss)
                    step_loss += loss.detach().float()
                    stopping = False
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(
                            model.parameters(), t.max_grad_norm or math.inf
                        )
                        bad, stopping = _agree(accelerator, step_loss, grad_norm, check_grad, stop)
                        step_loss.zero_()
                        if bad:
                            _nonfinite(loop, grad_norm)
                        if not bad or not check_grad:  # the fp16 scaler skips a bad update itself
                            optimizer.step()
                            scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                mask = batch.get("attention_mask")
                tokens = mask.sum() if mask is not None else batch["input_ids"].numel()
                window.loss_and_tokens += torch.stack(
                    [loss.detach().float(), torch.as_tensor(tokens, device=loss.device).float()]
                )
                window.micro_batches += 1
                window.samples += batch["input_ids"].shape[0]
                if not accelerator.sync_gradients:
                    continue
                state.step += 1
                state.steps_in_epoch += 1
                step = state.step
                progress.update(1)
                if step % t.log_every_n_steps == 0 or step == loop.total_steps:
                    elapsed = max(time.perf_counter() - window.start, 1e-9)
                    logged = _window_metrics(
                        accelerator,
                        window,
                        elapsed,
                        scheduler,
                        grad_norm,
                        step / loop.steps_per_epoch,
                        loop.flops,
                    )
                    state.train_seconds += elapsed
                    state.train_samples += logged["train/samples_per_second"] * elapsed
                    logged["train/samples_seen"] = round(state.train_samples)
                    if state.skipped_steps:
                        logged["train/skipped_steps"] = state.skipped_steps
                    if step == loop.total_steps:
                        logged["train/runtime_s"] = state.train_seconds
                        logged["train/s_per_step"] = state.train_seconds / step
                        logged["train/samples_per_second_run"] = (
                            state.train_samples / state.train_seconds
                        )
                    loop.metrics.log(logged, step)
                    progress.set_postfix(
                        loss=f"{logged['train/loss']:.4f}", lr=f"{logged['train/lr']:.3e}"
                    )
                    window = _Window.fresh(accelerator.device)
                paused = time.perf_counter()
                if stopping:  # before any evaluation: the launcher's grace period is short
                    path = save("stop requested")
                    raise Interrupted(
                        stop.signum or 15, step, str(path), accelerator.is_main_process
                    )
                new_best = False
                if _eval_due(t, state):
                    final, new_best = _evaluate(loop, step)
                if (t.save_every_n_steps and step % t.save_every_n_steps == 0) or (
                    new_best and saving
                ):
                    save("best so far" if new_best else f"every {t.save_every_n_steps} steps")
                window.start += time.perf_counter() - paused  # throughput excludes eval and saving
                if step >= loop.total_steps:
                    break
            else:  # the epoch is done
                state.epoch += 1
                state.steps_in_epoch = state.batches_in_epoch = 0
                if t.save_at_epoch_end and state.step < loop.total_steps and saved != state.step:
                    paused = time.perf_counter()
                    save(f"end of epoch {state.epoch}")
                    window.start += time.perf_counter() - paused
    finally:
        progress.close()  # also on errors: a stale bar would hide the message

    if t.eval_at_end and state.last_eval_step != state.step:
        final, new_best = _evaluate(loop, state.step)
        if new_best and saving:
            save("best so far")
    return final


def _eval_due(t: TrainerConfig, state: checkpoint.TrainerState) -> bool:
    every = t.eval_every_n_steps
    return (
        bool(every)
        and state.step > 0
        and state.step % every == 0
        and state.last_eval_step != state.step
    )


def _evaluate(loop: _Loop, step: int) -> tuple[dict[str, float], bool]:
    """Scores of the model at ``step`` (logged), and whether they are the best so far."""
    started = time.perf_counter()
    scores = loop.task.evaluate(loop.model, loop.eval_loader, loop.accelerator, loop.output_dir)
    scores = {f"eval/{k}": v for k, v in scores.items()}
    scores["eval/runtime_s"] = time.perf_counter() - started
    # samples seen: the charts' other x axis
    loop.metrics.log({**scores, "train/samples_seen": round(loop.state.train_samples)}, step)
    log.info("eval at step %d: %s", step, _fmt(scores))
    loop.model.train()
    loop.state.last_eval_step = step
    value = scores.get(f"eval/{loop.task.main_metric}")
    best = loop.state.best
    if step == 0 or value is None or not math.isfinite(value):
        return scores, False
    if best is not None and (
        value <= best["value"] if loop.task.greater_is_better else value >= best["value"]
    ):
        return scores, False
    loop.state.best = {"metric": loop.task.main_metric, "value": value, "step": step}
    return scores, True


def _agree(
    accelerator: Accelerator,
    step_loss: torch.Tensor,
    grad_norm: Any,
    check_grad: bool,
    stop: StopRequest,
) -> tuple[bool, bool]:
    """Whether this step's loss (or gradient) is non-finite on any process, and whether any
    process was asked to stop: one small all-reduce, so that every rank acts the same."""
    bad = ~torch.isfinite(step_loss)
    if check_grad:
        bad = bad | ~torch.isfinite(torch.as_tensor(grad_norm, device=step_loss.device))
    flags = torch.stack(
        [bad.float(), torch.tensor(float(stop.signum is not None), device=step_loss.device)]
    )
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    bad_count, stop_count = flags.tolist()
    return bad_count > 0, stop_count > 0


def _nonfinite(loop: _Loop, grad_norm: Any) -> None:
    """A NaN / Inf loss or gradient at the coming step: stop, or drop the update."""
    step = loop.state.step + 1
    t = loop.settings.trainer
    found = checkpoint.complete(checkpoint.root(loop.output_dir))
    last = f"the last checkpoint is {found[-1]}" if found else "no checkpoint was saved yet"
    if t.on_nonfinite == "stop":
        raise TrainingError(
            f"step {step}: the loss or gradient norm is not finite (grad norm {float(grad_norm)}); "
            f"the weights were not updated and {last}. Lower optimizer.lr, keep "
            "trainer.max_grad_norm set, prefer bf16 to fp16, or set trainer.on_nonfinite=skip to "
            "drop such updates."
        )
    loop.state.skipped_steps += 1
    log.warning(
        "step %d: non-finite loss or gradient; update skipped (%d so far, trainer.on_nonfinite=skip)",
        step,
        loop.state.skipped_steps,
    )


def _window_metrics(
    accelerator: Accelerator,
    window: _Window,
    elapsed: float,
    scheduler: Any,
    grad_norm: torch.Tensor | None,
    epoch: float,
    flops: FlopCounter,
) -> dict:
    """Loss, lr and throughput over the ``elapsed`` seconds since the last log step, summed over
    all processes."""
    counts = torch.tensor(
        [window.micro_batches, window.samples],
        dtype=torch.float,
        device=window.loss_and_tokens.device,
    )
    totals = accelerator.reduce(torch.cat([window.loss_and_tokens, counts]), reduction="sum")
    loss, tokens, micro, samples = totals.tolist()
    metrics = {
        "train/loss": loss / max(micro, 1.0),
        "train/lr": scheduler.get_last_lr()[0],
        "train/epoch": epoch,
        "train/samples_per_second": samples / elapsed,
        "train/tokens_per_second": tokens / elapsed,
        **flops.metrics(tokens, samples, elapsed, accelerator.num_processes),
    }
    if grad_norm is not None:
        metrics["train/grad_norm"] = float(grad_norm)
    peak = device.max_memory_allocated(accelerator.device)  # None on CPU
    if peak is not None:
        metrics["train/peak_memory_gib"] = peak / 1024**3
    return metrics


def _save_final(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
) -> None:
    """Save a Hugging Face folder (model + tokenizer) that ``from_pretrained`` loads."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        folder,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(folder)
        log.info("saved model and tokenizer to %s", folder)
    accelerator.wait_for_everyone()


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(
        f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))
    )
