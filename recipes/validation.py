"""The evaluation policy of a training run, and the scoring ``mode=eval`` shares with it.

A :class:`Validator` decides when to evaluate, scores the model and logs the scores, ranks each
evaluation against the best so far, says when to stop early, keeps the best checkpoint from
rotation and restores its weights at the end. The loop (:class:`recipes.loop.Trainer`) calls it
at its points and does the fitting, as fairseq2 keeps its validator beside its trainer. What it
keeps lives in the run's :class:`recipes.checkpoint.TrainerState` (``last_eval_step``,
``last_scores``, ``best``, ``evals_since_best``), so a resumed run goes on where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from recipes import checkpoint, evaluation
from recipes.checkpoint import TrainerState
from recipes.log import get_logger
from recipes.session import Session, format_metrics
from recipes.tasks.base import RunContext, TaskData
from recipes.tracking import MetricsLogger

log = get_logger(__name__)


class Validator:
    """The evaluations of one run over ``state`` (the training run's, or in ``mode=eval`` the
    checkpoint's): :meth:`score` and :meth:`log` are what ``mode=eval`` runs; training also
    asks when (:meth:`due`), keeps the best (:meth:`record`) and restores it at the end
    (:meth:`restore_best`)."""

    def __init__(
        self,
        session: Session,
        data: TaskData,
        run: RunContext,
        state: TrainerState,
        metrics: MetricsLogger,
    ) -> None:
        self.task, self.data, self.run = session.task, data, run
        self.accelerator, self.output_dir = session.accelerator, session.output_dir
        self.trainer_cfg = session.trainer_cfg
        self.main_metric = session.main_metric  # the logged key that ranks checkpoints
        self.state, self.metrics = state, metrics
        # The last evaluation (not the untrained one); a run resumed at a step it had evaluated
        # is not evaluated again, and reports that evaluation.
        evaluated = state.step and state.last_eval_step == state.step
        self.scores: dict[str, float] = dict(state.last_scores) if evaluated else {}
        self.best_scores: dict[str, float] = {}  # the best evaluation of this process's run
        self.final_step: int | None = None  # the step whose weights final/ holds

    # ------------------------------------------------------------------------------- when

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of ``trainer.eval_every_n_steps`` not evaluated yet."""
        every = self.trainer_cfg.eval_every_n_steps
        return bool(every) and step > 0 and step % every == 0 and self.state.last_eval_step != step

    def due_untrained(self, step: int) -> bool:
        """Whether to score the untrained model first (``trainer.eval_at_start``)."""
        return self.trainer_cfg.eval_at_start and step == 0

    def due_at_end(self, step: int) -> bool:
        """Whether the last step needs an evaluation of its own (``trainer.eval_at_end``)."""
        return self.trainer_cfg.eval_at_end and self.state.last_eval_step != step

    def stops_early(self) -> bool:
        """Whether ``trainer.early_stopping_patience`` evaluations passed without a new best."""
        patience = self.trainer_cfg.early_stopping_patience
        return patience is not None and self.state.evals_since_best >= patience

    # ------------------------------------------------------------------------------- scores

    def score(self, model: torch.nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """The task's scores of ``model`` on ``batches`` (the eval split's loader, as
        :meth:`recipes.session.Session.eval_loader` builds it), the same on every process."""
        return evaluation.evaluate(self.task, model, batches, self.data, self.run)

    def log(self, scores: dict[str, float], step: int) -> None:
        """``scores`` in metrics.jsonl and the trackers at ``step``, and in the log."""
        # samples seen: the charts' other x axis
        self.metrics.log({**scores, "train/samples_seen": round(self.state.train_samples)}, step)
        log.info("eval at step %d: %s", step, format_metrics(scores))

    def record(self, scores: dict[str, float], step: int, untrained: bool = False) -> bool:
        """Log the evaluation of ``step`` and keep it in the run's state; returns whether it is
        the best so far. ``untrained``: the model before training, shown and never the run's
        result."""
        self.log(scores, step)
        self.state.last_eval_step = step
        if step > 0:  # what results.json reports if the run stops after it (and resumes)
            self.state.last_scores = scores
        new_best = self._record_if_best(scores, step)
        if new_best:
            self.best_scores = scores
        if not untrained:
            self.scores = scores
        return new_best

    def _record_if_best(self, scores: Mapping[str, float], step: int) -> bool:
        """Whether the evaluation ``scores`` of ``step`` are the best so far (then recorded as
        the new best): a better main metric; on a tie, a better ``task.tie_metric``; on a tie of
        both, the later evaluation. Only a better score (not a tie) counts as an improvement for
        early stopping."""
        best, task = self.state.best, self.task
        if step == 0:
            return False
        self.state.evals_since_best += 1
        value = scores.get(self.main_metric)
        if value is None or not math.isfinite(value):
            return False
        tie_value = _finite_or_none(scores.get(f"eval/{task.tie_metric}"))
        if best is not None:
            order = rank_against_best(value, tie_value, best, task)
            if order < 0:
                return False
            if order == 0:  # a full tie: the latest evaluation, no improvement
                best.update(step=step, tie_metric=task.tie_metric, tie_value=tie_value)
                return True
        self.state.best = {
            "metric": task.main_metric,
            "value": value,
            "step": step,
            "tie_metric": task.tie_metric,
            "tie_value": tie_value,
        }
        self.state.evals_since_best = 0
        return True

    # ------------------------------------------------------------------------------- the best

    def keep_best(self, keep_last_n: int | None) -> None:
        """After a checkpoint of this step (main process): mark it the best when it is, and
        rotate old ones out (``keep_last_n``), never the best."""
        state = self.state
        if state.best is not None and state.best["step"] == state.step:
            checkpoint.mark_best(self.output_dir, state)
        best_step = state.best["step"] if state.best else None
        checkpoint.rotate(self.output_dir, keep_last_n, best_step)

    def restore_best(self) -> None:
        """With ``trainer.load_best_model_at_end`` (early stopping's default), the best
        checkpoint's weights replace the last step's, for the task's last words and ``final/``
        (as ``transformers.Trainer`` does); the scores reported become that checkpoint's.
        ``final_step`` says which step final/ holds."""
        trainer_cfg, best, last = self.trainer_cfg, self.state.best, self.state.step
        self.final_step = last
        patience = trainer_cfg.early_stopping_patience
        if patience is not None and self.stops_early():
            log.info(
                "early stopping at step %d: %s has not improved for %d evaluations",
                last,
                self.main_metric,
                patience,
            )
        if not trainer_cfg.best_model_at_end:
            return
        if best is None:
            log.warning(
                "trainer.load_best_model_at_end: no evaluation scored %s; final/ holds the "
                "last step, %d",
                self.main_metric,
                last,
            )
            return
        step = best["step"]
        if step == last:
            return
        path = checkpoint.checkpoints_dir(self.output_dir) / checkpoint.name_of(step)
        if not (path / checkpoint.STATE_FILE).is_file():  # resumed from another run's folder
            log.warning(
                "trainer.load_best_model_at_end: the best checkpoint (step %d) is not in %s; "
                "final/ holds the last step, %d",
                step,
                path.parent,
                last,
            )
            return
        saved = checkpoint.load(self.accelerator, path)  # the weights; the run's state stays
        self.scores = saved.last_scores or self.best_scores or self.scores
        self.final_step = step
        log.info(
            "final model from the best checkpoint, %s (%s=%.4g at step %d)",
            path,
            self.main_metric,
            best["value"],
            step,
        )

    def final_said(self) -> str:
        """Which step's weights final/ holds, for the run's done line."""
        if not self.trainer_cfg.save_final_model or self.final_step is None:
            return ""
        best = self.state.best
        if best is not None and best["step"] == self.final_step:
            why = "the best" if self.trainer_cfg.best_model_at_end else "the last, also the best"
        else:
            why = "the last"
        return f"; final/ holds step {self.final_step} ({why})"


def rank_against_best(
    value: float, tie_value: float | None, best: Mapping[str, Any], task: Any
) -> int:
    """1 when an evaluation's main metric ``value`` (and ``tie_value``, its
    ``task.tie_metric``) beats ``best`` (``TrainerState.best``), -1 when it is worse, 0 on a
    tie of both (a missing tie value ties)."""
    order = _compare(value, best["value"], task.greater_is_better)
    if order == 0:
        order = _compare(tie_value, best.get("tie_value"), task.tie_greater_is_better)
    return order


def _compare(value: float | None, other: float | None, greater_is_better: bool) -> int:
    """1 when ``value`` is better than ``other``, -1 when worse, 0 when equal (or either is
    missing: nothing to decide by)."""
    if value is None or other is None or value == other:
        return 0
    return 1 if (value > other) == greater_is_better else -1


def _finite_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
