"""The one training loop: every recipe runs through :func:`train`.

Everything that depends on the hardware (device placement, mixed precision, distributed data
parallelism, gradient accumulation, gathering for metrics) goes through ``accelerate``; the task
object only builds data, turns a batch into a loss and evaluates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    broadcast_object_list,
    parse_flag_from_env,
    set_seed,
)
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DataCollatorWithPadding, PreTrainedTokenizerBase

from recipes import device
from recipes.config import ConfigError, ModelConfig, Settings, TrainerConfig, instantiate, validate
from recipes.log import get_logger, setup_logging
from recipes.optim import build_optimizer
from recipes.tasks.base import Task
from recipes.tracking import MetricsLogger, tracker_init_kwargs

log = get_logger(__name__)


def _agree_on_output_dir(proposed: str) -> Path:
    """All ranks take rank 0's run folder (each rank's Hydra resolved its own timestamp)."""
    chosen = broadcast_object_list([proposed])[0]
    own = Path(proposed)
    if chosen != proposed and own.is_dir() and not any(own.iterdir()):
        own.rmdir()  # the empty folder Hydra made for this rank's own timestamp
    return Path(chosen)


def _existing_run(output_dir: Path) -> str | None:
    """Why ``output_dir`` must not be written to (it holds a run whose results must survive)."""
    # config.yaml alone is what a run that failed before training leaves: that folder is reusable.
    for marker in ("metrics.jsonl", "final"):
        if (output_dir / marker).exists():
            return (
                f"output_dir={output_dir} already holds a run ({marker}); nothing was changed. "
                "Pick a new folder with output_dir=... (or remove that one)."
            )
    return None


def _mixed_precision(requested: str) -> str:
    if requested != "auto":
        return requested
    # Decided before the Accelerator exists: creating accelerate's state here would fix the
    # distributed setup without the launcher's CPU flag (`accelerate launch --cpu`).
    if parse_flag_from_env("ACCELERATE_USE_CPU"):
        return "no"
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
    def fresh(cls, where: torch.device) -> _Window:
        return cls(torch.zeros(2, device=where), 0, 0, time.perf_counter())


def train(cfg: DictConfig) -> dict[str, float]:
    """Run the recipe described by the composed config ``cfg``; returns the final eval metrics."""
    settings: Settings = validate(cfg)
    task = instantiate(cfg, "task")  # checks its own settings before any heavy work
    t: TrainerConfig = settings.trainer

    accelerator = Accelerator(
        mixed_precision=_mixed_precision(t.mixed_precision),
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=settings.logger.trackers or None,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    try:
        return _run(cfg, settings, task, accelerator)
    finally:
        # Also on errors: with gloo / MCCL the process group must be destroyed or ranks hang.
        accelerator.end_training()


def _run(cfg: DictConfig, settings: Settings, task: Task, accelerator: Accelerator) -> dict:
    t = settings.trainer
    output_dir = _agree_on_output_dir(str(cfg.output_dir))
    # Rank 0 looks and every rank learns the verdict, so that all of them stop together.
    refusal = broadcast_object_list(
        [_existing_run(output_dir) if accelerator.is_main_process else None]
    )[0]
    if refusal:
        raise ConfigError(refusal)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    setup_logging(accelerator.is_main_process, output_dir / "train.log")
    log.info("run folder: %s", output_dir)
    log.info(
        "device %s, %d process(es), mixed precision %s, distributed %s",
        accelerator.device,
        accelerator.num_processes,
        accelerator.mixed_precision,
        accelerator.distributed_type,
    )
    if t.tf32:
        device.enable_tf32()
    set_seed(t.seed)

    tokenizer = load_tokenizer(settings.model)
    with accelerator.main_process_first():
        data = task.build_data(settings.data, tokenizer)
    model = load_model(settings.model, task.auto_model_class, **task.model_kwargs())
    task.check_model(model)

    padding = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=t.pad_to_multiple_of)
    train_loader = DataLoader(
        data.train,
        batch_size=t.per_device_train_batch_size,
        shuffle=True,
        collate_fn=data.train_collator or padding,
        num_workers=t.dataloader_num_workers,
    )
    eval_loader = DataLoader(
        data.eval,
        batch_size=t.per_device_eval_batch_size,
        collate_fn=data.eval_collator or padding,
        num_workers=t.dataloader_num_workers,
    )
    optimizer = build_optimizer(instantiate(cfg, "optimizer"), model, accelerator.device)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    steps_per_epoch = math.ceil(len(train_loader) / t.gradient_accumulation_steps)
    total_steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_epochs * steps_per_epoch)
    scheduler = instantiate(cfg, "scheduler")(
        optimizer=optimizer,
        num_training_steps=total_steps,
        num_processes=accelerator.num_processes,
    )
    scheduler = accelerator.prepare(scheduler)

    global_batch = (
        t.per_device_train_batch_size * accelerator.num_processes * t.gradient_accumulation_steps
    )
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

    metrics_logger = MetricsLogger(accelerator, output_dir)
    run_name = "-".join(output_dir.parts[-2:])
    accelerator.init_trackers(
        settings.logger.wandb.project,
        config=OmegaConf.to_container(cfg, resolve=True),
        init_kwargs=tracker_init_kwargs(settings.logger, run_name, output_dir),
    )

    def evaluate(step: int) -> dict[str, float]:
        started = time.perf_counter()
        scores = task.evaluate(model, eval_loader, accelerator, output_dir)
        scores = {f"eval/{k}": v for k, v in scores.items()}
        scores["eval/runtime_s"] = time.perf_counter() - started
        metrics_logger.log(scores, step)
        log.info("eval at step %d: %s", step, _fmt(scores))
        return scores

    step, epoch, last_eval_step = 0, 0, -1
    final: dict[str, float] = {}
    window = _Window.fresh(accelerator.device)
    grad_norm: torch.Tensor | None = None
    progress = tqdm(
        total=total_steps,
        desc="train",
        dynamic_ncols=True,
        disable=not (accelerator.is_local_main_process and t.progress_bar),
    )
    if t.eval_at_start:
        evaluate(0)
        window.start = time.perf_counter()
    train_seconds, train_samples = 0.0, 0.0
    model.train()
    while step < total_steps:
        train_loader.set_epoch(epoch)
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = task.loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.max_grad_norm is not None:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
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
            step += 1
            progress.update(1)
            if step % t.log_every_n_steps == 0 or step == total_steps:
                elapsed = max(time.perf_counter() - window.start, 1e-9)
                logged = _window_metrics(
                    accelerator, window, elapsed, scheduler, grad_norm, step / steps_per_epoch
                )
                train_seconds += elapsed
                train_samples += logged["train/samples_per_second"] * elapsed
                if step == total_steps:
                    logged["train/runtime_s"] = train_seconds
                    logged["train/s_per_step"] = train_seconds / step
                    logged["train/samples_per_second_run"] = train_samples / train_seconds
                metrics_logger.log(logged, step)
                progress.set_postfix(
                    loss=f"{logged['train/loss']:.4f}", lr=f"{logged['train/lr']:.3e}"
                )
                window = _Window.fresh(accelerator.device)
            if t.eval_every_n_steps and step % t.eval_every_n_steps == 0:
                eval_started = time.perf_counter()
                final, last_eval_step = evaluate(step), step
                window.start += time.perf_counter() - eval_started  # throughput excludes eval
            if step >= total_steps:
                break
        epoch += 1
    progress.close()

    if t.eval_at_end and last_eval_step != step:
        final = evaluate(step)
    extra = task.after_training(model, tokenizer, accelerator, output_dir)
    if extra:
        metrics_logger.log(extra, step)
    if t.save_final_model:
        _save_final(accelerator, model, tokenizer, output_dir / "final")
    metrics_logger.close()
    log.info(
        "done: %d steps in %.1f s of training (%.3f s/step); %s",
        step,
        train_seconds,
        train_seconds / max(step, 1),
        _fmt(final) if final else "no evaluation",
    )
    return final


def _window_metrics(
    accelerator: Accelerator,
    window: _Window,
    elapsed: float,
    scheduler: Any,
    grad_norm: torch.Tensor | None,
    epoch: float,
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
    }
    if grad_norm is not None:
        metrics["train/grad_norm"] = float(grad_norm)
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
