"""Standard benchmarks through lm-evaluation-harness (lm-eval): its tasks, scored by its own model
class (``HFLM``) on the device accelerate chose, in one process or data-parallel in several.

    python train.py mode=benchmark model.name_or_path=<run>/final benchmark.tasks=[recipes_local]
    python train.py recipe=llama_sft trainer.benchmarks=[recipes_local]    # on final/, once saved
    accelerate launch --config_file conf/accelerate/multi_musa.yaml train.py mode=benchmark ...
    python -m recipes.benchmark <run>/final --tasks recipes_local --limit 50

``python -m recipes.benchmark`` prints the score table (task, metric, value, standard error) and
writes results.json, the samples and the task files to ``--output-dir``: by default the
``benchmark/`` folder of the training run whose ``final/`` it scores (``<run>/benchmark``), else
a new ``outputs/benchmark/<date_time>/``.

In ``mode=benchmark``, scores go to metrics.jsonl and the trackers as ``benchmark/<task>/<metric>``, lm-eval's results
dict to results.json (``lm_eval``), and every example with its answer to
``benchmark/samples_<task>.jsonl``. The bundled offline tasks are in ``recipes/assets/lm_eval``;
docs/benchmarks.md has the hub's (mmlu, gsm8k, ceval-valid, cmmlu).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

from recipes.config import ASSETS, BenchmarkConfig, ConfigError, ModelConfig, WeightDtype
from recipes.log import get_logger, setup_logging
from recipes.model import _source, load_model, load_tokenizer

log = get_logger("recipes.benchmark")  # also under `python -m`, where __name__ is __main__

LOCAL_TASKS = ASSETS / "lm_eval"  # the bundled task YAMLs (their data_files relative to it)
FOLDER = "benchmark"  # in the run folder: tasks/ (the bundled YAMLs as lm-eval reads them), samples
_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}  # accelerate's -> HFLM's autocast dtype


@dataclass
class Report:
    """What a benchmark run gives the main process (other processes get empty ones)."""

    scores: dict[str, float]  # benchmark/<task>/<metric>, in lm-eval's order
    results: dict[str, Any] | None  # lm-eval's results dict, JSON-ready, without the samples

    @property
    def main_metric(self) -> str | None:
        """The first metric lm-eval reports (what a sweep over benchmark runs optimises)."""
        return next((k for k in self.scores if "_stderr" not in k), None)

    @property
    def greater_is_better(self) -> bool:
        """lm-eval's word on the main metric (true for all but a few, such as perplexity)."""
        if self.results is None or self.main_metric is None:
            return True
        _, task, name = self.main_metric.split("/", 2)
        metric = name.partition(",")[0]
        return bool(self.results.get("higher_is_better", {}).get(task, {}).get(metric, True))


class Benchmarks:
    """lm-eval tasks to run on a model: the names are checked against lm-eval's index when this is
    built (before a model loads, or before training for ``trainer.benchmarks``)."""

    def __init__(self, tasks: Sequence[str], cfg: BenchmarkConfig, folder: Path, key: str):
        """``folder``: where the bundled task YAMLs and the samples are written (``benchmark/``
        of a run); ``key``: the setting that names the tasks, for a refusal."""
        self.tasks, self.cfg, self.folder = list(tasks), cfg, folder
        own = [Path(p).expanduser() for p in cfg.include_path]
        for path in own:
            if not path.is_dir():
                raise ConfigError(
                    f"benchmark.include_path: {path} is not a folder. Give folders of lm-eval "
                    "task YAMLs (searched with their subfolders)."
                )
        self.task_manager = find_tasks(
            self.tasks, [write_local_tasks(self.folder / "tasks")], own, key
        )

    def run(
        self, model_cfg: ModelConfig, accelerator: Accelerator, log_table: bool = True
    ) -> Report:
        """The tasks on ``model_cfg``'s model, placed by ``accelerator``; with several processes
        each scores its share of the requests and the main process gets the scores (and logs
        their table, unless ``log_table`` is false: the command line prints it itself)."""
        cfg = self.cfg
        lm = language_model(model_cfg, cfg, accelerator)
        log.info(
            "benchmark: %s on %s (%s, %d process(es))",
            ", ".join(self.tasks),
            model_cfg.name_or_path,
            accelerator.device,
            accelerator.num_processes,
        )
        results = simple_evaluate(
            model=lm,
            tasks=self.tasks,
            num_fewshot=cfg.num_fewshot,
            limit=int(cfg.limit) if cfg.limit is not None and cfg.limit >= 1 else cfg.limit,
            log_samples=cfg.log_samples,
            task_manager=self.task_manager,
            apply_chat_template=cfg.apply_chat_template,
            fewshot_as_multiturn=cfg.apply_chat_template,  # as lm-eval's command line decides
        )
        accelerator.wait_for_everyone()
        if results is None:  # not the main process
            return Report({}, None)
        samples = results.pop("samples", None) or {}
        results = json.loads(json.dumps(results, default=handle_non_serializable))
        for task, rows in samples.items():
            self._write_samples(task, rows)
        if log_table:
            log.info("benchmark results:\n%s", score_table(results))
        return Report(flat_scores(results), results)

    def _write_samples(self, task: str, rows: list[dict]) -> None:
        path = self.folder / f"samples_{task}.jsonl"
        lines = (
            json.dumps(row, default=handle_non_serializable, ensure_ascii=False) for row in rows
        )
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def write_local_tasks(folder: Path) -> Path:
    """The bundled task YAMLs in ``folder``, their ``data_files`` made absolute: lm-eval hands them
    to ``datasets``, which reads them from the working directory. (lm-eval's own command line
    takes this folder as ``--include_path``.)"""
    folder.mkdir(parents=True, exist_ok=True)
    for source in sorted(LOCAL_TASKS.glob("*.yaml")):
        config = yaml.safe_load(source.read_text(encoding="utf-8"))
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {
            split: str((LOCAL_TASKS / path).resolve()) for split, path in files.items()
        }
        header = f"# recipes/assets/lm_eval/{source.name}, with absolute data_files\n"
        text = header + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
        # Every process writes the same text, each through its own temporary file: readers
        # only ever see whole files, and no rename loses a race to another process's.
        tmp = folder / f".{source.name}.{os.getpid()}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(folder / source.name)
    return folder


def find_tasks(names: list[str], bundled: list[Path], own: list[Path], key: str) -> TaskManager:
    """lm-eval's index of the tasks ``names`` can mean (globs too, as its command line takes
    them). The bundled tasks alone when they are all that is asked for: lm-eval's own index
    (thousands of YAML files) takes several seconds to build."""
    if not own:
        local = TaskManager(include_path=[str(p) for p in bundled], include_defaults=False)
        if all(local.match_tasks([name]) for name in names):
            return local
    manager = TaskManager(include_path=[str(p) for p in [*bundled, *own]])
    missing = [name for name in names if not manager.match_tasks([name])]
    if missing:
        near = [
            m for name in missing for m in difflib.get_close_matches(name, manager.all_tasks, 1)
        ]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ConfigError(
            f"{key}: lm-eval has no task, group or tag named {', '.join(missing)}{hint}. List "
            "them with `lm-eval ls tasks` (add --include_path DIR for a folder of your own, "
            "which benchmark.include_path=[DIR] adds here); the bundled offline tasks are "
            "recipes_hellaswag and recipes_squad (both: recipes_local)."
        )
    return manager


def language_model(model_cfg: ModelConfig, cfg: BenchmarkConfig, accelerator: Accelerator) -> HFLM:
    """lm-eval's ``HFLM`` on our loading of the model (``model.*``: dtype, GGUF, revision; not the
    dropout settings, which evaluation does not use and a final/ has saved), on accelerate's
    device, with autocast as ``trainer.mixed_precision`` resolved."""
    tokenizer = load_tokenizer(model_cfg)
    model = load_model(model_cfg, _auto_class(model_cfg), trained_for="benchmark")
    model.to(accelerator.device).eval()
    with _quiet(logging.getLogger("lm_eval.models.huggingface")):
        return _AcceleratedHFLM(
            accelerator,
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            mixed_precision_dtype=_PRECISION.get(str(accelerator.mixed_precision)),
            trust_remote_code=model_cfg.trust_remote_code,
        )


class _AcceleratedHFLM(HFLM):
    """``HFLM`` on a model already placed by accelerate. Several processes split the requests as
    under ``accelerate launch -m lm_eval``, whatever the device type (lm-eval's own set-up counts
    only CUDA-like devices, and would pick ``cuda`` or the CPU itself)."""

    def __init__(self, accelerator: Accelerator, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if accelerator.num_processes > 1:
            self.accelerator = accelerator  # lm-eval gathers and waits through it
        self._rank = accelerator.process_index
        self._world_size = accelerator.num_processes


def _auto_class(model_cfg: ModelConfig) -> Any:
    """Encoder-decoder models (T5) as lm-eval's seq2seq backend takes them, else causal LMs."""
    config = AutoConfig.from_pretrained(model_cfg.name_or_path, **_source(model_cfg))
    seq2seq = config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    return AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM


@contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Leave out HFLM's warnings about a model given as an object ("assuming single-process"):
    the processes are set up here."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def flat_scores(results: dict[str, Any]) -> dict[str, float]:
    """``benchmark/<task>/<metric>`` for every number of lm-eval's results (``acc,none`` is
    ``acc``; another filter stays in the name: ``exact_match,strict-match``), standard errors
    as ``<metric>_stderr``."""
    scores = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, sep, kept = key.partition(",")
            if not sep or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # the alias, the sample count, an "N/A" standard error
            name = metric if kept == "none" else key
            scores[f"benchmark/{task}/{name}"] = float(value)
    return scores


def default_folder(model: str) -> Path:
    """Where ``python -m recipes.benchmark`` writes without ``--output-dir``: the ``benchmark/``
    folder of the run whose ``final/`` is scored (its parent holds the run's config.yaml), else a
    new ``outputs/benchmark/<date_time>/`` (a hub name, or a model folder of no run, which is
    left as it is)."""
    path = Path(model).expanduser()
    if path.is_dir() and (path.resolve().parent / "config.yaml").is_file():
        return path.resolve().parent / FOLDER
    return Path("outputs") / FOLDER / time.strftime("%Y-%m-%d_%H-%M-%S")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m recipes.benchmark <model> --tasks ...``: mode=benchmark without Hydra; prints
    the score table and where results.json is."""
    parser = argparse.ArgumentParser(
        prog="python -m recipes.benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="a run's final/ (or any model folder or hub name)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="results.json, samples and task YAMLs (replaced if there); default: <run>/benchmark "
        "for a run's final/, else outputs/benchmark/<date_time>",
    )
    defaults = BenchmarkConfig()
    parser.add_argument("--num-fewshot", type=int, default=defaults.num_fewshot)
    parser.add_argument("--limit", type=float, default=defaults.limit)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--include-path", action="append", default=[])
    parser.add_argument("--apply-chat-template", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=[d.value for d in WeightDtype])
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    cfg = dataclasses.replace(
        defaults,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        include_path=args.include_path,
        apply_chat_template=args.apply_chat_template,
    )
    accelerator = Accelerator()
    setup_logging(accelerator.is_main_process)
    # One folder for every process (each would read its own clock).
    folder = Path(broadcast_object_list([str(args.output_dir or default_folder(args.model))])[0])
    try:
        report = Benchmarks(tasks, cfg, folder, "--tasks").run(
            ModelConfig(name_or_path=args.model, dtype=WeightDtype(args.dtype)),
            accelerator,
            log_table=False,
        )
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    finally:
        accelerator.end_training()
    if report.results is not None:
        (folder / "results.json").write_text(json.dumps(report.results, indent=2) + "\n")
        print(score_table(report.results))  # the command's answer, on stdout
        print(f"results: {folder / 'results.json'}")


def score_table(results: dict[str, Any]) -> str:
    """lm-eval's own table of ``results`` (task, filter, shots, metric, value, standard error),
    and its groups' table where tasks were grouped, as its command line prints them."""
    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


if __name__ == "__main__":
    main()
