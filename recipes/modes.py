"""What a run does: one runner per ``mode`` (train, eval, predict, benchmark) over one
:class:`recipes.session.Session`, the setup they share (the run folder and its log, the device,
the task, the tokenizer, model loading, trackers and the results file).

Read it in this order: :func:`run` (build the task and the accelerator, pick the runner, and tidy
up whatever happens), then the runners. Training itself is :class:`recipes.loop.Trainer`; the
others are a few lines each: ``eval`` builds no optimizer and scores with the
:class:`recipes.validation.Validator` that evaluates during training, ``predict`` and
``benchmark`` read no training data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from accelerate.utils import parse_flag_from_env

from recipes import checkpoint, device, evaluation, memory, mesh, runs, tracking
from recipes import data as data_lib
from recipes.config import ConfigError, Settings
from recipes.faults import StopRequest, TrainingError, disk_full_stop, peer_failures_reported
from recipes.log import get_logger, note_in_log_file
from recipes.loop import Trainer
from recipes.session import (
    RunResult,
    Session,
    _check_launcher,
    _reset_accelerate,
    build_accelerator,
    format_metrics,
)
from recipes.tasks.base import Task
from recipes.validation import Validator

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
    if settings.mode == "train":
        memory.check_fits(settings, accelerator)  # before any folder, data or weights
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
        # Also on errors: with gloo / MCCL the process group must be destroyed or ranks hang;
        # a sweep's jobs under a multi-process launch share one, destroyed when the sweep ends
        # (recipes.sweep).
        in_sweep = bool(tracking.hydra_context().get("sweep_dir"))
        shared = in_sweep and accelerator.num_processes > 1
        tracking.end_training(accelerator, settings.output_dir, keep_process_group=shared)
        if in_sweep:
            _reset_accelerate()


def with_device_defaults(settings: Settings, task: Task) -> tuple[Settings, list[str]]:
    """``settings`` with the trainer's speed settings that the recipe left null decided for this
    device (:func:`recipes.device.training_defaults`), and one line per setting saying what was
    chosen and why (a value the recipe or the command line set is kept, and said to be), after
    the environment lines of :func:`recipes.device.prepare_environment`."""
    trainer_cfg = settings.trainer
    # Before the device is first asked: its runtime reads the visible devices and the allocator.
    settled = device.prepare_environment(training=str(settings.mode) == "train")
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
    decided, lines = {}, settled
    if note := mesh.single_process_note():
        lines.append(note)
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


# ------------------------------------------------------------------------------------ runners


def train(session: Session) -> RunResult:
    """``mode=train``: the recipe's training run (:class:`recipes.loop.Trainer`)."""
    trainer = Trainer(session)
    session.stop.install()
    return trainer.finish(trainer.fit())


def evaluate(session: Session) -> RunResult:
    """``mode=eval``: score the model as loaded (``model.name_or_path``, or the checkpoint of
    ``resume=...``) on the eval split, with the task's own evaluation, as training's
    :class:`Validator` scores and logs it (the same batches, padded alike); nothing trains, and
    no optimizer is built."""
    task = session.task
    # A final/ evaluated against a reference built from itself: refused before any work.
    _check_evaluated_model(task, session.settings.model.name_or_path, session.resume_from)
    data = session.build_data()
    # The weights of model.name_or_path as they are; with resume=..., the checkpoint's replace
    # them (a task's reference model is built from the starting weights first).
    as_is = "eval" if session.resume_from is None else None
    model = session.load_model(data, trained_for=as_is)
    model, loader = session.prepare(model, session.eval_loader(data))
    run = session.context()
    task.before_training(model, data, run, session.trainer_cfg.per_device_eval_batch_size)
    state = checkpoint.TrainerState()
    if session.resume_from is not None:
        state = checkpoint.load(session.accelerator, session.resume_from)
    validator = Validator(session, data, run, state, session.start_trackers())
    scores = validator.score(model, loader)
    validator.log(scores, state.step)  # the checkpoint's best and position stay as they are
    where = session.resume_from or session.settings.model.name_or_path
    log.info("evaluated %s: %s", where, format_metrics(scores))
    return session.finish(session.result(scores), best=state.best, steps=state.step)


def _check_evaluated_model(task: Task, model: str, resume: Path | None) -> None:
    """``mode=eval`` of a task evaluated against its starting weights (a reference or teacher
    built from the weights loaded): without ``resume`` it would score ``model`` against itself
    (every reward, margin, KL or divergence exactly 0), so it is refused, with the way to real
    numbers (:attr:`Task.start_reference`: GKD's teacher can be named instead)."""
    if resume is not None or not task.evaluates_against_start:
        return
    against, zeros, setting = task.start_reference
    checkpoint_fix = (
        "a checkpoint of its training run instead: resume=<run folder> with model.name_or_path "
        "set to the model that run started from (the recipe's)."
    )
    fix = f"Evaluate {checkpoint_fix}"
    if setting:
        role = against.removeprefix("its ")
        fix = f"Set {setting}=<the {role} it was trained with>, or evaluate {checkpoint_fix}"
    raise ConfigError(
        f"mode=eval with model.name_or_path={model}: task={task.args.NAME} scores a model against "
        f"{against}, which here would be the model itself ({zeros} exactly 0). {fix}"
    )


def predict(session: Session) -> RunResult:
    """``mode=predict``: the model of ``model.name_or_path`` answers the rows of
    ``data.predict_file`` with the task's own code (its evaluation's windows and answer search,
    its generation); the task writes its predictions file to the run folder."""
    settings = session.settings
    _settings_from_final(session.task, settings.model.name_or_path)
    data = session.build_data(predict=True)
    model = session.load_model(data, trained_for="predict")
    model, loader = session.prepare(model, session.eval_loader(data))
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
