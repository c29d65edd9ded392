"""The one training loop: ``mode=train`` (:func:`recipes.modes.train`) runs a :class:`Trainer`
over the run's :class:`recipes.session.Session` (run folder, device, task, model loading).

Read it in this order: :meth:`Trainer.setup` (data, model, loaders, optimizer, resume state),
:meth:`Trainer.fit` (the loop: a train step, a log step, the save policy; when to evaluate, the
best evaluation, early stopping and the best checkpoint are its
:class:`recipes.validation.Validator`'s), :meth:`Trainer.finish` (last words, final model,
results).

Everything that depends on the hardware (device placement, mixed precision, distributed data
parallelism, gradient accumulation, gathering for metrics) goes through ``accelerate``; the task
(:class:`recipes.tasks.base.Task`) only builds data, turns a batch into a loss and evaluates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from accelerate.utils import (
    DistributedType,
    gather_object,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from recipes import adapters, checkpoint, device, evaluation, memory, moe, runs, serving
from recipes import data as data_lib
from recipes.config import ConfigError, instantiate
from recipes.faults import (
    Interrupted,
    StopNow,
    TrainingError,
)
from recipes.flops import FlopCounter, precision_for_peak
from recipes.log import get_logger
from recipes.model import retie_gathered
from recipes.optim import build_optimizer
from recipes.seeding import SeededCollator, reseed
from recipes.session import RunResult, Session, final_model_settings, format_metrics
from recipes.stopping import StopPoll
from recipes.tasks.base import (
    Averaging,
    Seeding,
    SeedsRows,
    SummedLoss,
    TaskData,
)
from recipes.validation import Validator
from recipes.window import Stopwatch, Window

if TYPE_CHECKING:
    from recipes.benchmark import Benchmarks
    from recipes.config import Settings
    from recipes.tasks.base import Task

log = get_logger(__name__)


class Trainer:
    """The training run of one recipe (``mode=train``): :meth:`setup` builds what training
    needs over the run's :class:`recipes.session.Session`, :meth:`fit` trains and
    :meth:`finish` saves and reports; its :class:`recipes.validation.Validator` evaluates."""

    def __init__(self, session: Session) -> None:
        self.session, self.settings, self.task = session, session.settings, session.task
        self.trainer_cfg = session.settings.trainer
        self.loss_shape = self.task.loss_shape()  # how its loss averages (tasks/base.py)
        self.accelerator, self.stop = session.accelerator, session.stop
        self.output_dir, self.resume_from = session.output_dir, session.resume_from
        self.tokenizer = session.tokenizer
        self.last_saved_step = -1
        self.stop_poll = StopPoll(
            self.accelerator, self.stop, self.trainer_cfg.distributed_timeout_s
        )
        self.setup()

    # ------------------------------------------------------------------------------- setup

    def setup(self) -> None:
        """Build everything, in an order that keeps the random streams of earlier releases (the
        seed is set before the model's new head is initialised)."""
        if self.loss_shape.averaging == Averaging.sum and (
            self.accelerator.distributed_type == DistributedType.DEEPSPEED
        ):
            raise ConfigError(
                f"task={type(self.task).__name__} weighs tokens across the optimizer step, "
                "which needs the gradients in the parameters; launch with DDP or FSDP, not "
                "DeepSpeed."
            )
        # trainer.benchmarks, run on final/: their names checked now, a misspelt task fails
        # before training, not after it.
        self.benchmarks = _benchmarks(self.settings, self.task, self.output_dir)
        self.data: TaskData = self.session.build_data()
        self.model = self.session.load_model(self.data, trained_for=None)
        self.loss_shape = moe.with_router_stat(self.loss_shape, self.model)
        self.run_context = self.session.context(training=True)
        self._setup_data_loaders()
        self._setup_optimizer()
        self.task.before_training(
            self.model, self.data, self.run_context, self.trainer_cfg.per_device_eval_batch_size
        )
        self._setup_state()
        self.validator = Validator(
            self.session, self.data, self.run_context, self.state, self.metrics
        )

    def _setup_data_loaders(self) -> None:
        trainer_cfg, data = self.trainer_cfg, self.data
        fixed = self.session.fixed_length(data)  # the task's collators pad to it (build_data)
        self.collator = data.train_collator or self.session.padding(data)
        # Padded to max_length (or packed blocks of one length), lengths would save nothing.
        lengths = None if fixed else data_lib.feature_lengths(data.train)
        varied = lengths is not None and len(lengths) > 0 and lengths.min() < lengths.max()
        if varied and trainer_cfg.sub_batches > 1 and self.loss_shape.splits_exactly:
            self.collator = data_lib.SubBatchCollator(
                self.collator, trainer_cfg.sub_batches, trainer_cfg.pad_to_multiple_of
            )
            log.info(
                "each micro-batch runs as up to %d sub-batches of similar lengths "
                "(trainer.sub_batches; the same batches and gradient, less padding)",
                trainer_cfg.sub_batches,
            )
        if data.seeding == Seeding.batch:
            self.collator = SeededCollator(self.collator, trainer_cfg.seed)
        elif data.seeding == Seeding.row and not isinstance(self.collator, SeedsRows):
            raise TypeError(f"{type(self.task).__name__}: Seeding.row needs a SeedsRows collator")
        self.sampler = self._length_grouped_sampler(lengths) if varied else None
        if data.repeat_steps > 1:
            self.sampler = data_lib.RepeatedStepsSampler(
                len(data.train), self.global_batch, data.repeat_steps, trainer_cfg.seed
            )
        self.train_loader = DataLoader(
            data.train,
            batch_size=trainer_cfg.per_device_train_batch_size,
            shuffle=self.sampler is None,
            sampler=self.sampler,
            collate_fn=self.collator,
            **self.session.loader_kwargs(),
        )
        self.eval_loader = self.session.eval_loader(data)

    def _length_grouped_sampler(
        self, lengths: np.ndarray
    ) -> data_lib.EpochLengthGroupedSampler | None:
        """Batches of similar lengths (``trainer.group_by_length``), or None: a plain shuffle."""
        trainer_cfg = self.trainer_cfg
        if not trainer_cfg.group_by_length:
            return None
        # One sampler batch per optimizer step: the same examples in every layout of it.
        return data_lib.EpochLengthGroupedSampler(
            self.global_batch, lengths, trainer_cfg.seed, megabatch=trainer_cfg.length_group_size
        )

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step, over all processes and accumulated micro-batches."""
        trainer_cfg = self.trainer_cfg
        return (
            trainer_cfg.per_device_train_batch_size
            * self.accelerator.num_processes
            * trainer_cfg.gradient_accumulation_steps
        )

    def _setup_optimizer(self) -> None:
        accelerator, trainer_cfg = self.accelerator, self.trainer_cfg
        optimizer = optimizer_where_it_steps(
            optimizer_factory(self.settings.optimizer), self.model, accelerator
        )
        self.flops = FlopCounter(
            self.model,
            accelerator.device,
            precision_for_peak(accelerator.mixed_precision, self.session.tf32),
        )
        if trainer_cfg.compile:
            _compile(self.model)
        self.model, self.optimizer, self.train_loader, self.eval_loader = self.session.prepare(
            self.model, optimizer, self.train_loader, self.eval_loader
        )
        # Steps are optimizer updates of one global batch, whatever the number of processes: each
        # process takes len(train_loader) batches of its shard per epoch.
        accumulation = trainer_cfg.gradient_accumulation_steps
        self.steps_per_epoch = math.ceil(len(self.train_loader) / accumulation)
        self.total_steps = trainer_cfg.max_steps
        if self.total_steps <= 0:
            self.total_steps = math.ceil(trainer_cfg.num_epochs * self.steps_per_epoch)
        scheduler = instantiate(self.settings.scheduler, "scheduler")(
            optimizer=self.optimizer,
            num_training_steps=self.total_steps,
            num_processes=accelerator.num_processes,
        )
        self.scheduler = accelerator.prepare(scheduler)
        self._log_plan()

    def _log_plan(self) -> None:
        trainer_cfg = self.trainer_cfg
        log.info(
            "%d training features, global batch %d (%d per device x %d processes x %d "
            "accumulation), %d steps per epoch, %d optimizer steps",
            len(self.data.train),
            self.global_batch,
            trainer_cfg.per_device_train_batch_size,
            self.accelerator.num_processes,
            trainer_cfg.gradient_accumulation_steps,
            self.steps_per_epoch,
            self.total_steps,
        )

    def _setup_state(self) -> None:
        """The run's position (fresh, or read from the checkpoint to resume), its metrics file
        and its trackers."""
        resolved = self.settings.resolved
        invariants = runs.resume_invariants(
            self.settings, self.global_batch, len(self.data.train), self.sampler is not None
        )
        self.state = checkpoint.TrainerState(guarded=invariants, config=resolved)
        keep_until_step = None
        if self.resume_from is not None:
            self.state = runs.resume(self.accelerator, self.resume_from, self.state, self.scheduler)
            keep_until_step = self.state.step
            if self.resume_from.parent == checkpoint.checkpoints_dir(self.output_dir):
                self.last_saved_step = self.state.step  # a stop here needs no new checkpoint
        elif self.settings.resume == "auto":
            log.info("resume=auto: no checkpoint in %s yet; starting at step 0", self.output_dir)
            keep_until_step = -1  # what an earlier attempt logged is logged again
        self.metrics = self.session.start_trackers(keep_until_step)

    # ------------------------------------------------------------------------------- fit

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``: epochs of micro-batches, an optimizer step every
        ``gradient_accumulation_steps``, then logging, evaluation and checkpoints as due.
        Returns the last evaluation."""
        self._start_fit()
        with _out_of_memory_advice(self):
            with self.progress:  # closed on errors too: a stale bar would hide the message
                self._evaluate_before_training()
                self.model.train()
                while self.state.step < self.total_steps and not self.validator.stops_early():
                    self._train_epoch()
            self._evaluate_after_training()
        self.validator.restore_best()
        return self.validator.scores

    def _start_fit(self) -> None:
        accelerator, state = self.accelerator, self.state
        saved = state.window[accelerator.process_index] if state.window else None
        self.window = Window.fresh(accelerator.device, self.loss_shape.stats, saved)
        self.stopwatch = Stopwatch()
        self.step_loss = torch.zeros((), device=accelerator.device)
        # Summed losses (SummedLoss): their terms this step, and the constant each micro-batch's
        # sum is divided by before backward (about one token per row position, so the gradient
        # keeps the size of a mean's for the fp16 scaler); _optimizer_step corrects it exactly.
        self.step_terms = torch.zeros((), device=accelerator.device)
        self.sum_scale = float(
            self.trainer_cfg.per_device_train_batch_size * self.loss_shape.terms_per_example
        )
        self.grad_norm: torch.Tensor | None = None
        self.stop_agreed = False
        self.check_grad = accelerator.scaler is None  # fp16's scaler skips overflowing steps
        # With trainer.on_nonfinite=stop, the first step whose loss or gradient was not finite
        # (0: none), kept on the device and read when a window closes (_raise_if_nonfinite):
        # a step makes no host sync. skip must decide at every step, and reads it there.
        self.first_nonfinite = torch.zeros((), device=accelerator.device)
        self.checks_each_step = self.trainer_cfg.on_nonfinite == "skip"
        self.progress = tqdm(
            total=self.total_steps,
            initial=state.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (accelerator.is_local_main_process and self.trainer_cfg.progress_bar),
        )

    def _train_epoch(self) -> None:
        """The rest of the current epoch: all of it, unless the run resumed in its middle."""
        for batch in self._epoch_batches():
            if not self._train_micro_batch(batch):
                continue  # the optimizer step waits for more micro-batches
            self._finish_step()
            if self.state.step >= self.total_steps or self.validator.stops_early():
                return
        self._end_epoch()

    def _epoch_batches(self) -> Iterable[Mapping[str, torch.Tensor]]:
        """This epoch's batches from the run's position (the same order as an uninterrupted
        run, without what was done)."""
        state = self.state
        if state.steps_in_epoch >= self.steps_per_epoch:  # resumed at an epoch's last step
            state.epoch, state.steps_in_epoch = state.epoch + 1, 0
        self.train_loader.set_epoch(state.epoch)
        if isinstance(self.collator, SeedsRows):
            self.collator.start_epoch(self.trainer_cfg.seed, state.epoch)
        # The position in micro-batches of this process (also right when a resumed run reaches
        # the same global batch with other processes / accumulation settings).
        state.batches_in_epoch = state.steps_in_epoch * self.trainer_cfg.gradient_accumulation_steps
        self.accelerator.step = state.batches_in_epoch  # accelerate's accumulation counter
        if not state.batches_in_epoch:
            return self.train_loader
        batches = skip_first_batches(self.train_loader, state.batches_in_epoch)
        batches.set_epoch(state.epoch)  # older accelerate rebuilds it at epoch 0
        return batches

    def _train_micro_batch(self, batch: Mapping[str, torch.Tensor]) -> bool:
        """Forward and backward of one micro-batch, and the optimizer step after the last of an
        accumulation; returns whether a step was completed."""
        accelerator, state = self.accelerator, self.state
        reseed(
            self.trainer_cfg.seed, accelerator.process_index, state.epoch, state.batches_in_epoch
        )
        state.batches_in_epoch += 1
        pieces = batch if isinstance(batch, list) else [batch]  # trainer.sub_batches
        with accelerator.accumulate(self.model), self._cast_once(pieces):
            loss, terms = self._backward(pieces)
            if accelerator.sync_gradients:
                self._optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
        self.window.add(pieces, loss, terms)
        return accelerator.sync_gradients

    def _cast_once(self, pieces: list[Mapping[str, torch.Tensor]]) -> Any:
        """One autocast region around a micro-batch's sub-batches, so that the weights' low
        precision copies (autocast's cache, emptied when the outermost region ends) are made
        once per micro-batch, not once per sub-batch. Not under FSDP or DeepSpeed, which gather
        and free the weights around each forward."""
        accelerator = self.accelerator
        whole = places_model_first(accelerator.distributed_type, accelerator.device_placement)
        return accelerator.autocast() if len(pieces) > 1 and whole else nullcontext()

    def _backward(
        self, pieces: list[Mapping[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Forward and backward of a micro-batch's sub-batches; returns the micro-batch's loss
        and its terms, as logged: a mean and 1, or a sum and its count (:class:`SummedLoss`).

        A mean's sub-batches are weighted by their share of the rows (their gradients add up to
        the whole micro-batch's); sums add up as they are. Gradients are synchronised across
        processes after the last sub-batch only."""
        accelerator, rows = self.accelerator, sum(len(p["input_ids"]) for p in pieces)
        logged = torch.zeros((), device=accelerator.device)
        summed = self.loss_shape.averaging == Averaging.sum
        terms: torch.Tensor | float = logged.clone() if summed else 1.0
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            with nullcontext() if last else accelerator.no_sync(self.model):
                with memory.activation_offload(self.trainer_cfg.activation_offload, accelerator):
                    out = self.task.loss(self.model, piece)
                if isinstance(out, SummedLoss):
                    loss = out.total / self.sum_scale
                    logged += out.total.detach().float()
                    terms = terms + out.count.detach().float()
                    self.step_terms += out.count.detach().float()
                    self.window.add_stats(out.stats)
                else:
                    loss = out * (len(piece["input_ids"]) / rows) if len(pieces) > 1 else out
                    logged += loss.detach().float()
                accelerator.backward(loss)
            self.step_loss += loss.detach().float()
        return logged, terms

    def _normalise_summed_gradients(self) -> None:
        """Divide the step's gradient by its terms on all processes (see :class:`SummedLoss`):
        backward saw each sum divided by ``sum_scale``, accelerate divides by the accumulation
        steps and the data-parallel reduction averages over processes, so multiply by all
        three over the terms. Done in place before clipping, so the logged norm is the true
        one (DeepSpeed, which keeps gradients of its own, is refused at setup)."""
        accelerator = self.accelerator
        terms = self.step_terms
        if accelerator.num_processes > 1:
            terms = accelerator.reduce(terms.clone(), reduction="sum")
        # A tensor, not a float: reading the terms on the host would wait for the device.
        factor = (
            self.sum_scale * accelerator.gradient_accumulation_steps * accelerator.num_processes
        ) / terms.clamp(min=1.0)
        _scale_gradients(self.model, factor)
        self.step_terms.zero_()

    def _optimizer_step(self) -> None:
        """Clip, note whether the step is finite, learn from every process whether to stop
        (on the host), then update the weights.

        With ``trainer.on_nonfinite=stop`` (the default) nothing here waits for the device: the
        finite check is a flag on the device, read when the logging window closes and before
        any evaluation or checkpoint (:meth:`_raise_if_nonfinite`), so the updates of a
        non-finite step and the few after it are never saved. ``skip`` must know before the
        update, and reads the flag at every step."""
        if self.loss_shape.averaging == Averaging.sum:
            self._normalise_summed_gradients()
        self.grad_norm = self.accelerator.clip_grad_norm_(
            self.model.parameters(), self.trainer_cfg.max_grad_norm or math.inf
        )
        bad = ~torch.isfinite(self.step_loss)
        if self.check_grad:
            bad = bad | ~torch.isfinite(torch.as_tensor(self.grad_norm, device=bad.device))
        self.step_loss.zero_()
        skipped = self.checks_each_step and _on_any_rank(self.accelerator, bad)
        if skipped:
            self._count_skipped()
        elif not self.checks_each_step:  # noted on the device, read when the window closes
            unset = self.first_nonfinite == 0
            step = float(self.state.step + 1)
            self.first_nonfinite = torch.where(bad & unset, step, self.first_nonfinite)
        if not skipped or not self.check_grad:  # the fp16 scaler skips a bad update itself
            self.optimizer.step()
            self.scheduler.step()
        self.stop_agreed = self.stop_poll.asked()

    def _finish_step(self) -> None:
        """Count the step, log it, then stop, evaluate and save as due; the stopwatch leaves the
        time of those out of the throughput."""
        self.state.step += 1
        self.state.steps_in_epoch += 1
        self.progress.update(1)
        logged = self._should_log()
        if logged:
            self._log_step()
        with self.stopwatch.paused():
            if self.stop_agreed:  # before any evaluation: the launcher's grace period is short
                self._save_and_stop()
            new_best = self.validator.due(self.state.step) and self._evaluate(self.state.step)
            if self._should_save(new_best):
                every = self.trainer_cfg.save_every_n_steps
                self._save("best so far" if new_best else f"every {every} steps")
        if not logged and self.validator.stops_early():
            self._log_step()  # the run's last step

    def _end_epoch(self) -> None:
        state = self.state
        state.epoch += 1
        state.steps_in_epoch = state.batches_in_epoch = 0
        if (
            self.trainer_cfg.save_at_epoch_end
            and state.step < self.total_steps
            and self.last_saved_step != state.step
        ):
            with self.stopwatch.paused():
                self._save(f"end of epoch {state.epoch}")

    # ------------------------------------------------------------------------------- policy

    def _should_log(self) -> bool:
        step = self.state.step
        return step % self.trainer_cfg.log_every_n_steps == 0 or step == self.total_steps

    def _should_save(self, new_best: bool) -> bool:
        every = self.trainer_cfg.save_every_n_steps
        return bool(every and self.state.step % every == 0) or (new_best and self.saves_checkpoints)

    @property
    def saves_checkpoints(self) -> bool:
        """Whether this run saves checkpoints at all (a new best is saved only then)."""
        return self.trainer_cfg.save_every_n_steps > 0 or self.trainer_cfg.save_at_epoch_end

    def _evaluate_before_training(self) -> None:
        step = self.state.step
        with self.stopwatch.paused():
            if self.validator.due_untrained(step):
                self._evaluate(0, untrained=True)  # shown, never the run's result
            elif self.validator.due(step):  # stopped by a signal before its evaluation: do it now
                self._evaluate(step)

    def _evaluate_after_training(self) -> None:
        if self.validator.due_at_end(self.state.step):
            new_best = self._evaluate(self.state.step)
            if new_best and self.saves_checkpoints:
                self._save("best so far")

    # ------------------------------------------------------------------------------- steps

    def _log_step(self) -> None:
        """Log the window since the last log step (summed over processes) and the run's totals."""
        self._raise_if_nonfinite()
        state, step = self.state, self.state.step
        elapsed = self.stopwatch.elapsed()
        logged = self._window_metrics(elapsed)
        state.train_seconds += elapsed
        state.train_samples += logged["train/samples_per_second"] * elapsed
        logged["train/samples_seen"] = round(state.train_samples)
        if state.skipped_steps:
            logged["train/skipped_steps"] = state.skipped_steps
        if step == self.total_steps:
            logged["train/runtime_s"] = state.train_seconds
            logged["train/s_per_step"] = state.train_seconds / step
            logged["train/samples_per_second_run"] = state.train_samples / state.train_seconds
        self.metrics.log(logged, step)
        self.progress.set_postfix(
            loss=f"{logged['train/loss']:.4f}", lr=f"{logged['train/lr']:.3e}"
        )
        self.window = Window.fresh(self.accelerator.device, self.loss_shape.stats)
        self.stopwatch.restart()

    def _window_metrics(self, elapsed: float) -> dict[str, float]:
        """Loss, lr and throughput over the ``elapsed`` seconds since the last log step, summed
        over all processes."""
        accelerator = self.accelerator
        means, tokens, samples = self.window.totals(accelerator)
        metrics = {
            **means,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/epoch": self.state.step / self.steps_per_epoch,
            "train/samples_per_second": samples / elapsed,
            "train/tokens_per_second": tokens / elapsed,
            **self.flops.metrics(tokens, samples, elapsed, accelerator.num_processes),
        }
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = float(self.grad_norm)
        peak = device.max_memory_allocated(accelerator.device)  # None on CPU
        if peak is not None:
            metrics["train/peak_memory_gib"] = peak / 1024**3
        return metrics

    def _evaluate(self, step: int, untrained: bool = False) -> bool:
        """The validator's evaluation of the model at ``step``, which a stop request ends in
        its middle (:meth:`_stoppable`); returns whether it is the best so far."""
        self._raise_if_nonfinite()
        with self._stoppable():
            scores = self.validator.score(self.model, self.stop_poll.polled(self.eval_loader))
        return self.validator.record(scores, step, untrained)

    def _save(self, reason: str) -> Path:
        """A checkpoint of this step (every process takes part), marked best when it is, and
        old ones rotated out."""
        self._raise_if_nonfinite()
        accelerator, state = self.accelerator, self.state
        self.last_saved_step = state.step
        state.window = gather_object([self.window.as_list()])
        path = checkpoint.save(
            accelerator, self.output_dir, state, self.model, self.tokenizer, self.optimizer
        )
        if accelerator.is_main_process:
            self.validator.keep_best(self.trainer_cfg.keep_last_n_checkpoints)
        log.info("checkpoint (%s): %s", reason, path)
        return path

    @contextmanager
    def _stoppable(self) -> Iterator[None]:
        """An evaluation or the task's last words, which a stop request (SIGTERM, Ctrl-C) ends
        in their middle: they can take longer than a launcher's grace period. One process stops
        at once; several agree on entry and before each evaluation batch (``StopPoll.polled``).
        Then a checkpoint of the last trained step is saved (unless there is one) and the run
        stops, resumable."""
        if not self.stop.installed:  # not yet: a signal ends the run, there is nothing to save
            yield
            return
        try:
            self.stop_poll.raise_if_asked()
            with self.stop.at_once(self.accelerator.num_processes == 1):
                yield
        except StopNow:
            self._save_and_stop()

    def _save_and_stop(self) -> None:
        state = self.state
        if self.last_saved_step == state.step:  # saved at this step already
            path = checkpoint.checkpoints_dir(self.output_dir) / checkpoint.name_of(state.step)
        else:
            path = self._save("stop requested")
        raise Interrupted(
            self.stop.signum or 15, self.state.step, str(path), self.accelerator.is_main_process
        )

    def _raise_if_nonfinite(self) -> None:
        """With ``trainer.on_nonfinite=stop``: stop if a step since the last check had a NaN /
        Inf loss or gradient on any process (one read of the device's flag; every process calls
        this at the same points: a window's end, before an evaluation or a checkpoint)."""
        if self.checks_each_step:
            return
        flags = self.first_nonfinite.reshape(1)
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.gather(flags)
        steps = [int(value) for value in flags.tolist() if value > 0]
        if steps:
            raise _nonfinite_error(min(steps), self.state.step, self.output_dir)

    def _count_skipped(self) -> None:
        """A NaN / Inf loss or gradient at the coming step, ``trainer.on_nonfinite=skip``: its
        update is dropped; count it and say so."""
        step = self.state.step + 1
        self.state.skipped_steps += 1
        log.warning(
            "step %d: non-finite loss or gradient; update skipped (%d so far, "
            "trainer.on_nonfinite=skip)",
            step,
            self.state.skipped_steps,
        )

    # ------------------------------------------------------------------------------- finish

    def finish(self, final: dict[str, float]) -> RunResult:
        """The task's last words, the final model, the results file and the curves."""
        accelerator, state = self.accelerator, self.state
        with self._stoppable(), evaluation.eval_mode(self.model):
            extra = self.task.after_training(self.model, self.data, self.run_context)
            # Several processes do not poll in the last words: a stop asked for there is acted
            # on here, before final/.
            self.stop_poll.raise_if_asked()
        found = memory.run_plan(self.settings, accelerator, self.model)
        extra = {**(extra or {}), **memory.plan_and_peak(found, accelerator)}
        self.metrics.log(extra, state.step)
        if self.trainer_cfg.save_final_model:
            base = adapters.base_reference(self.settings.model, resized=bool(self.data.new_tokens))
            final_dir = _save_final(
                accelerator, self.model, self.tokenizer, self.output_dir, *base, self._recipe()
            )
            if accelerator.is_main_process and self.data.template:
                serving.log_check(final_dir)  # a chat model: what vLLM would load
        benchmarked = self._benchmark_final()
        if benchmarked:
            self.metrics.log(benchmarked["benchmarks"], state.step)
        result = self.session.finish(
            self.session.result(final),
            best=state.best,
            steps=state.step,
            final_step=self.validator.final_step,
            train_seconds=state.train_seconds,
            **benchmarked,
        )
        if accelerator.is_main_process:
            _plot(self.output_dir)
        log.info(
            "done: %d steps in %.1f s of training (%.3f s/step); %s%s",
            state.step,
            state.train_seconds,
            state.train_seconds / max(state.step, 1),
            format_metrics(final) if final else "no evaluation",
            self.validator.final_said(),
        )
        return result

    def _recipe(self) -> dict[str, Any]:
        """What ``final/recipe.json`` records: the task settings (read back by mode=predict,
        :func:`recipes.checkpoint.final_recipe`), the decoding, and which step final/ holds."""
        resolved, final_step = self.settings.resolved, self.validator.final_step
        return {
            "task": resolved.get("task"),
            "generation": resolved.get("generation"),
            "step": final_step if final_step is not None else self.state.step,
            "steps": self.state.step,
            "load_best_model_at_end": self.trainer_cfg.best_model_at_end,
            "best": self.state.best,
        }

    def _benchmark_final(self) -> dict[str, Any]:
        """``trainer.benchmarks`` on ``final/`` as saved (a LoRA run's merged model), once the
        training copy and its optimizer state are let go: the benchmark loads its own."""
        if self.benchmarks is None:
            return {}
        self.model = self.optimizer = self.scheduler = None
        self.accelerator.free_memory()
        self.accelerator.wait_for_everyone()  # final/ is whole on every process's file system
        report = self.benchmarks.run(
            final_model_settings(self.settings, self.output_dir), self.accelerator
        )
        log.info("benchmarked final/: %s", format_metrics(report.scores))
        return {"benchmarks": report.scores, "lm_eval": report.results}


@contextmanager
def _out_of_memory_advice(trainer: Trainer) -> Iterator[None]:
    """An out-of-memory ends ``trainer``'s run in one line: the plan, the cheapest fix and the
    last checkpoint, left as it was (nothing is written after the failure)."""
    try:
        yield
    except Exception as err:
        if not memory.out_of_memory(err):
            raise
        saved = checkpoint.finished_checkpoints(checkpoint.checkpoints_dir(trainer.output_dir))
        found = memory.run_plan(trainer.settings, trainer.accelerator, trainer.model)
        last = str(saved[-1]) if saved else None
        raise memory.out_of_memory_error(err, trainer.state.step, found, last) from err


def _on_any_rank(accelerator: Accelerator, flag: torch.Tensor) -> bool:
    """Whether a device flag is set on any process (a host read: all processes call it)."""
    flag = flag.float().reshape(1)
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, reduction="sum")
    return bool(flag.item() > 0)


def _nonfinite_error(step: int, read_at: int, output_dir: Path) -> TrainingError:
    """What stops a run whose ``step`` had a NaN / Inf loss or gradient, found at ``read_at``."""
    found = checkpoint.finished_checkpoints(checkpoint.checkpoints_dir(output_dir))
    last = f"the last checkpoint is {found[-1]}" if found else "no checkpoint was saved yet"
    return TrainingError(
        f"step {step}: the loss or gradient norm is not finite (the run stopped at step "
        f"{read_at}, when it was read; no checkpoint holds those weights and {last}). Lower "
        "optimizer.lr, keep trainer.max_grad_norm set, prefer bf16 to fp16, or set "
        "trainer.on_nonfinite=skip to drop such updates."
    )


def _benchmarks(settings: Settings, task: Task, output_dir: Path) -> Benchmarks | None:
    """The Benchmarks of ``trainer.benchmarks`` (None: none), refused for a task that does not
    train a language model."""
    names = settings.trainer.benchmarks
    if not names:
        return None
    from recipes.benchmark import FOLDER, Benchmarks  # lm-eval, only where it is used

    if not task.language_model:
        kind = task.auto_model_class.__name__
        raise ConfigError(
            f"trainer.benchmarks={list(names)}: lm-eval scores language models, and this task "
            f"trains a {kind.removeprefix('AutoModelFor')} model; leave trainer.benchmarks "
            "empty for it (it is for task=clm, sft, dpo or seq2seq)."
        )
    return Benchmarks(names, settings.benchmark, output_dir / FOLDER, "trainer.benchmarks")


def _scale_gradients(model: torch.nn.Module, factor: torch.Tensor) -> None:
    """Multiply every gradient of ``model`` by ``factor`` (a tensor: reading it on the host
    would wait for the device), in place, one foreach call per kind of gradient tensor."""
    groups: dict[tuple, list[torch.Tensor]] = {}  # foreach takes one kind of tensor a call
    for p in model.parameters():
        if p.grad is not None:
            key = (type(p.grad), p.grad.device, p.grad.dtype)
            groups.setdefault(key, []).append(p.grad)
    for (_, where, dtype), grads in groups.items():  # a tensor factor: torch >= 2.1
        torch._foreach_mul_(grads, factor.to(device=where, dtype=dtype))


def optimizer_factory(optimizer: Mapping[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    """The ``optimizer`` settings' partial, with plain Python settings (``betas`` a list, not an
    OmegaConf ListConfig): torch.distributed's optimizer state dict, which accelerate saves FSDP
    checkpoints with, refuses any other container in ``param_groups`` (found on the emulated
    MUSA device, where FSDP runs)."""
    return instantiate(dict(optimizer), "optimizer", _convert_="all")


def optimizer_where_it_steps(
    make_optimizer: Callable[..., torch.optim.Optimizer],
    model: torch.nn.Module,
    accelerator: Accelerator,
) -> torch.optim.Optimizer:
    """The optimizer, built over the parameters where they will step: the model goes to its
    device first wherever accelerate would place it whole (:func:`places_model_first`), as
    transformers.Trainer does, since torch_musa's FusedAdamW up to v2.7.0 (and torch's fused
    AdamW before 2.4) refuses CPU parameters; prepare() would move the model there anyway."""
    if places_model_first(accelerator.distributed_type, accelerator.device_placement):
        model.to(accelerator.device)
    return build_optimizer(make_optimizer, model, accelerator.device)


def places_model_first(distributed_type: DistributedType, device_placement: bool) -> bool:
    """Whether the loop moves the model to its device before building the optimizer: wherever
    accelerate would place it whole (one device, DDP). FSDP shards it from where it is, and
    DeepSpeed and Megatron-LM place it themselves."""
    launcher_places = (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
    )
    return device_placement and distributed_type not in launcher_places


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


def _save_final(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: Path,
    base: str | None,
    revision: str | None,
    recipe: dict[str, Any],
) -> Path:
    """Save ``final/``, a Hugging Face folder (model + tokenizer) that ``from_pretrained`` loads;
    with LoRA, the merged model and the adapter (``final/adapter``) on ``base``
    (:func:`recipes.adapters.base_reference`); and ``recipe.json``, the run's settings that
    predict needs (:func:`recipes.checkpoint.write_recipe`). Written whole or not at all
    (:func:`recipes.checkpoint.save_final`)."""
    accelerator.wait_for_everyone()

    def write(folder: Path) -> None:
        write_model(folder)
        if accelerator.is_main_process:
            checkpoint.write_recipe(folder, recipe)

    def write_model(folder: Path) -> None:
        unwrapped = accelerator.unwrap_model(model)
        if adapters.is_peft_model(unwrapped):
            if accelerator.distributed_type == DistributedType.FSDP:
                # Sharded: gathered whole to the main process (as a full fine-tuning's final/
                # is), which merges and saves an unsharded copy of it.
                state_dict = accelerator.get_state_dict(model)
                if accelerator.is_main_process:
                    unwrapped = adapters.gathered_copy(unwrapped, state_dict)
            if accelerator.is_main_process:
                published = output_dir / checkpoint.FINAL
                adapters.save_final(unwrapped, folder, tokenizer, base, revision, published)
            return
        state_dict = accelerator.get_state_dict(model)
        if accelerator.distributed_type == DistributedType.FSDP and accelerator.is_main_process:
            retie_gathered(unwrapped, state_dict)  # tied weights saved once, as on one process
        unwrapped.save_pretrained(
            folder,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=state_dict,
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(folder)

    # A LoRA run whose base cannot be named writes that base beside the merged model.
    copies = 2 if adapters.is_peft_model(accelerator.unwrap_model(model)) and base is None else 1
    need = copies * checkpoint.weights_bytes(accelerator, model)
    final = checkpoint.save_final(accelerator, output_dir, write, need)
    log.info("saved model and tokenizer to %s", final)
    return final
