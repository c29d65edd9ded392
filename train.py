"""Fine-tune a Hugging Face model with a recipe composed by Hydra from ``conf/``.

    python train.py recipe=bert_squad                      # one device (MUSA, CUDA or CPU)
    python train.py recipe=bert_squad debug=smoke          # bundled tiny model and data, offline
    python train.py recipe=bert_squad_v2 model=bert_base_uncased trainer.num_epochs=3
    accelerate launch --config_file conf/accelerate/multi_musa.yaml train.py recipe=bert_squad

A run's folder is ``outputs/<recipe>/<date_time>``, or ``output_dir=X`` (Hydra's run folder too:
nothing else is made; a sweep's jobs go to ``X/<job number>``).
Any key can be overridden (``data.path=./squad model.name_or_path=./checkpoint``); ``--cfg job``
prints the composed config without running it. A bad setting, including a misspelt key or config
group option, stops the run with one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from recipes.config import ConfigError, DataError, compose_error, register_resolvers, validate

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the task's main metric of the final evaluation (F1 for QA,
    perplexity for language modelling, ...), the objective of a Hydra sweeper."""
    _sweep_job_folder(cfg)
    try:
        # Settings first, before torch and transformers load: a bad one is refused in about a
        # second instead of ten (train() then checks the task, the data and the model).
        settings = validate(cfg)
    except ConfigError as err:
        return _failed(cfg, err, exit_code=2)
    from recipes.faults import Interrupted, PeerFailed, TrainingError
    from recipes.modes import run  # imported late: `--help`, `--cfg` and refusals stay fast

    try:
        result = run(settings)
    except (ConfigError, DataError) as err:
        return _failed(cfg, err, exit_code=2)
    except TrainingError as err:
        return _failed(cfg, err, exit_code=1)
    except PeerFailed:
        sys.exit(1)  # this rank said why as it saw the failure (recipes.faults)
    except Interrupted as stopped:
        if stopped.main_process:
            sys.stderr.write(_resume_advice(cfg, stopped))
        sys.exit(stopped.exit_code)
    return result.main_value


def _sweep_job_folder(cfg: DictConfig) -> None:
    """In a sweep (-m) given ``output_dir=X``, each job's run folder is ``X/<job number>`` (the
    sweep folder, which Hydra made ``X``: conf/train.yaml), not ``X`` itself, where the jobs
    would refuse each other."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    job_folder = str(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and str(cfg.output_dir) != job_folder:
        cfg.output_dir = job_folder


def _swept_output_dir(args: list[str]) -> bool:
    """Whether a sweep's command line sweeps output_dir (``-m output_dir=a,b``): refused before
    Hydra makes any folder, since the sweep's summary reads its jobs from one folder."""
    if not {"-m", "--multirun"} & set(args):
        return False
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides(
            [a for a in args if not a.startswith("-")]
        )
    except Exception:  # Hydra reports what it cannot parse itself (cli, below)
        return False
    return any(o.key_or_group == "output_dir" and o.is_sweep_override() for o in overrides)


def _failed(cfg: DictConfig, err: Exception, exit_code: int) -> None:
    """Report a failed run and exit non-zero; in a sweep (-m), record the failure in the job's
    folder and let the other jobs run (the summary lists it, and the sweep exits 1)."""
    from pathlib import Path

    from recipes.hydra_run import remove_unused_run_folder
    from recipes.tracking import hydra_context, write_failure

    sys.stderr.write(f"error: {err}\n")
    if not hydra_context().get("sweep_dir"):
        remove_unused_run_folder(str(cfg.output_dir))  # a refused run leaves no empty folder
        sys.exit(exit_code)
    write_failure(Path(str(cfg.output_dir)), err)
    return None


def _resume_advice(cfg: DictConfig, stopped) -> str:
    """How to continue: the same command, pointed at this run folder with resume=auto."""
    from hydra.core.hydra_config import HydraConfig

    kept = [
        o
        for o in HydraConfig.get().overrides.task
        if not o.startswith(("output_dir=", "resume=", "+resume="))
    ]
    command = " ".join(["python train.py", *kept, f"output_dir={cfg.output_dir}", "resume=auto"])
    return (
        f"stopped by {stopped}: checkpoint saved to {stopped.checkpoint}.\n"
        "Resume with the same launch command (python, accelerate launch or torchrun) plus "
        f"output_dir={cfg.output_dir} resume=auto, here:\n    {command}\n"
    )


def cli() -> None:
    """:func:`main`, with what Hydra cannot compose (a misspelt key or config group option, a
    wrong type, an override it cannot parse) reported as one line and exit code 2, as the
    settings that :func:`validate` refuses. ``HYDRA_FULL_ERROR=1`` keeps Hydra's own report."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    if _swept_output_dir(sys.argv[1:]):
        sys.stderr.write(
            "error: output_dir cannot be swept (-m output_dir=a,b): give one output_dir=X, and "
            "the sweep's jobs run in X/<job number> with its summary in X.\n"
        )
        sys.exit(2)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    # Hydra's one public switch that makes it raise these errors instead of printing them over
    # several lines and exiting 1. Any other error then shows its whole traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as err:
        sys.stderr.write(f"error: {compose_error(err)}\n")
        sys.exit(2)


if __name__ == "__main__":
    cli()
