"""One metrics path: every number goes to ``metrics.jsonl`` and to the configured trackers."""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recipes.config import LoggerConfig
from recipes.log import get_logger

if TYPE_CHECKING:  # annotations only: train.py reports a failed sweep job without torch
    from accelerate import Accelerator

log = get_logger(__name__)


def wandb_mode(requested: str) -> str:
    """Resolve ``logger.wandb.mode=auto``: online when the machine is logged in, else offline.

    An explicit ``WANDB_MODE`` in the environment wins, as it does for every wandb user.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


def hydra_context() -> dict[str, Any]:
    """What Hydra knows about this job: the recipe chosen, the command-line overrides, and
    whether (and where) it is one job of a sweep. Empty when the loop runs outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return {}
        hydra = HydraConfig.get()
    except (ImportError, ValueError):
        return {}
    multirun = hydra.mode == RunMode.MULTIRUN
    return {
        "recipe": hydra.runtime.choices.get("recipe"),
        "overrides": list(hydra.overrides.task),
        "sweep_dir": str(hydra.sweep.dir) if multirun else None,
        "job_num": hydra.job.num if multirun else None,
    }


def given_on_command_line(prefix: str) -> set[str]:
    """The keys under ``prefix`` (``task.``, ``generation.``) that this job's command-line
    overrides set, without the prefix (``task.scheme=IOBES`` gives ``scheme``)."""
    keys = set()
    for override in hydra_context().get("overrides", []):
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith(prefix):
            keys.add(key[len(prefix) :])
    return keys


def run_tags(recipe: str | None, model: str, device_type: str, world_size: int) -> list[str]:
    """Tags that let a dashboard filter and group runs: recipe, model, device type, world size."""
    tags = [f"recipe:{recipe}"] if recipe else []
    tags += [f"model:{Path(model).name}", f"device:{device_type}", f"world_size:{world_size}"]
    return [tag[:64] for tag in tags]  # wandb's limit


def wandb_run_id(output_dir: Path) -> str:
    """The wandb run id of this run folder: made at its first start and kept in
    ``wandb/run-id``, so a resumed run (``resume=auto``, a requeued job) continues the same
    wandb run instead of starting another."""
    path = output_dir / "wandb" / "run-id"
    if path.exists():
        return path.read_text().strip()
    alphabet = string.ascii_lowercase + string.digits  # wandb's own id style: 8 of these
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def tracker_init_kwargs(
    cfg: LoggerConfig, run_name: str, output_dir: Path, tags: list[str], group: str
) -> dict[str, Any]:
    """Keyword arguments for ``Accelerator.init_trackers`` per tracker (main process)."""
    kwargs: dict[str, Any] = {}
    if "wandb" in cfg.trackers:
        kwargs["wandb"] = {
            "name": run_name,
            "dir": str(output_dir),
            "mode": wandb_mode(cfg.wandb.mode),
            "tags": [*cfg.wandb.tags, *tags],
            "group": cfg.wandb.group or group,
            "entity": cfg.wandb.entity,
            "id": wandb_run_id(output_dir),
            "resume": "allow",
        }
    return kwargs


def start_trackers(
    accelerator: Accelerator,
    cfg: LoggerConfig,
    output_dir: Path,
    config: dict[str, Any],
    tags: list[str],
    main_metric: str,
    greater_is_better: bool,
) -> None:
    """Start the configured trackers: wandb gets the composed config, a name, tags and a group
    (the sweep for a sweep's jobs, else the run); TensorBoard writes under
    ``<output_dir>/tensorboard``."""
    if not cfg.trackers:
        return
    context = hydra_context()
    run_name = "-".join(output_dir.parts[-2:])
    group = Path(context["sweep_dir"]).name if context.get("sweep_dir") else run_name
    # accelerate puts TensorBoard event files under the project's logging folder.
    accelerator.project_configuration.logging_dir = str(output_dir / "tensorboard")
    init_kwargs = {}
    if accelerator.is_main_process:
        init_kwargs = tracker_init_kwargs(cfg, run_name, output_dir, tags, group)
    accelerator.init_trackers(cfg.wandb.project, init_kwargs=init_kwargs)
    if not accelerator.is_main_process:
        return
    if "wandb" in cfg.trackers:
        run = accelerator.get_tracker("wandb", unwrap=True)
        run.config.update(config, allow_val_change=True)  # nested, as composed
        # Charts can use samples seen as their x axis (every record carries it); the summary
        # keeps the best value of the main metric besides the last.
        run.define_metric("train/samples_seen")
        run.define_metric(main_metric, summary=("max" if greater_is_better else "min") + ",last")
        log.info(
            "wandb: its closing report (history, summary, sync command) goes to %s",
            output_dir / "wandb" / WANDB_REPORT,
        )
    if "tensorboard" in cfg.trackers:  # hparams take plain values only
        accelerator.get_tracker("tensorboard").store_init_configuration(_flat(config))


def finish_trackers(accelerator: Accelerator, cfg: LoggerConfig, final: dict[str, float]) -> None:
    """Put the final model's metrics in the wandb summary (``final/...``)."""
    if accelerator.is_main_process and "wandb" in cfg.trackers and final:
        run = accelerator.get_tracker("wandb", unwrap=True)
        run.summary.update({f"final/{k.split('/', 1)[-1]}": v for k, v in final.items()})


WANDB_REPORT = "summary.log"


def end_training(
    accelerator: Accelerator, output_dir: str | Path, keep_process_group: bool = False
) -> None:
    """``accelerator.end_training()`` (the trackers closed, the process group destroyed), with
    wandb's closing report (run history, summary, the ``wandb sync`` command of an offline run:
    about 30 lines) written to ``<output_dir>/wandb/summary.log`` instead of the terminal,
    whose last line stays the run's own ``done:`` (or ``error:``). Redirecting the report, not
    silencing it (wandb's ``quiet``), keeps it whole in every wandb release: wandb prints it to
    the ``sys.stderr`` / ``sys.stdout`` of the moment. ``keep_process_group``: only the trackers
    are closed (a job of a sweep under a multi-process launch: the next job joins the same
    group; a second rendezvous on the launcher's store would hang)."""

    def end() -> None:
        if not keep_process_group:
            accelerator.end_training()
            return
        for tracker in accelerator.trackers:  # end_training's first half
            tracker.finish()

    wandb_open = accelerator.is_main_process and any(
        getattr(tracker, "name", None) == "wandb" for tracker in accelerator.trackers
    )
    if not wandb_open:
        end()
        return
    path = Path(output_dir) / "wandb" / WANDB_REPORT
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        report = path.open("a", encoding="utf-8")
    except OSError:  # a full disk: the report on the terminal rather than lost
        end()
        return
    with report, redirect_stderr(report), redirect_stdout(report):
        end()


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> one level of ``a.b.c`` keys with plain values (TensorBoard's hparams
    take nothing else)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = ",".join(map(str, value))
        else:
            flat[name] = "null" if value is None else value
    return flat


def write_failure(output_dir: Path, error: BaseException) -> None:
    """``failed.json``: why a job of a sweep failed (the sweep goes on; its summary shows it)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {"error": str(error), "overrides": hydra_context().get("overrides", [])}
    _write_json(output_dir / "failed.json", record)


def write_results(output_dir: Path, results: dict[str, Any]) -> None:
    """``results.json``: the run's final metrics and main metric (what sweeps summarise)."""
    _write_json(output_dir / "results.json", results)


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Whole or not at all: sweep summaries and the GPU check read these while jobs run."""
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)
    except OSError:  # a full disk: no half-written file is left (the run says so: faults.py)
        tmp.unlink(missing_ok=True)
        raise


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl record; None for a line torn by a crash."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLogger:
    """Fans a dict of numbers out to ``metrics.jsonl`` and ``accelerator.log`` (main process)."""

    def __init__(
        self, accelerator: Accelerator, output_dir: Path, keep_until_step: int | None = None
    ) -> None:
        """``keep_until_step``: a resumed run drops the records its checkpoint's step had not
        reached (logged before the interruption, to be logged again), so the file reads as one
        uninterrupted run."""
        self.accelerator = accelerator
        self.path = path = output_dir / "metrics.jsonl"
        self._file = None
        if accelerator.is_main_process:
            if keep_until_step is not None and path.exists():
                kept = [
                    line
                    for line in path.read_text().splitlines(keepends=True)
                    if _step_of(line) is not None and _step_of(line) <= keep_until_step
                ]
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(kept))
                tmp.replace(path)
            self._file = path.open("a", buffering=1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step`` (a no-op on non-main processes)."""
        if not self.accelerator.is_main_process:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        assert self._file is not None
        record = json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n"
        with self._said_as_file():
            self._file.write(record)
        self.accelerator.log(metrics, step=step)

    def close(self) -> None:
        if self._file is not None:
            with self._said_as_file():
                self._file.close()
            self._file = None

    @contextmanager
    def _said_as_file(self) -> Iterator[None]:
        """A failed write (a full disk) raised with the file's path, which an open file's error
        lacks (the run's one-line message names it: recipes.faults.disk_full_stop); the file is
        closed, so that nothing retries the write as the process ends. A torn last line is
        dropped by a resumed run."""
        try:
            yield
        except OSError as err:
            file, self._file = self._file, None
            if file is not None and not file.closed:
                with suppress(OSError):
                    file.close()  # flushes, fails again, and closes
            raise OSError(err.errno, err.strerror, str(self.path)) from err
