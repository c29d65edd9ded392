"""Benchmarks through lm-evaluation-harness (recipes/benchmark.py): the bundled offline tasks are
lm-eval's own prompts on the bundled rows, ``mode=benchmark`` scores what lm-eval's command line
scores on the same model, sample by sample, in one process and in two, and ``trainer.benchmarks``
scores ``final/`` at the end of a run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import wandb_records
from conftest import ROOT, on_musa, read_metrics, run_cpu_launch, run_train
from hydra import compose, initialize_config_dir

from recipes.config import BenchmarkConfig, ConfigError, register_resolvers, validate

TINY_LLAMA = ROOT / "recipes" / "assets" / "tiny-llama"
LIMIT, BATCH = 20, 4
METRICS = ("acc,none", "acc_norm,none", "exact_match,none")


def _compose(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("mode=benchmark",), "mode=benchmark needs benchmark.tasks=[...]"),
        (("mode=benchmark", "benchmark.tasks=[mmlu]", "benchmark.limit=0"), "benchmark.limit=0"),
        (
            ("trainer.benchmarks=[mmlu]", "trainer.save_final_model=false"),
            "trainer.benchmarks run on final/",
        ),
    ],
)
def test_benchmark_settings_are_refused_before_anything_loads(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(_compose(*overrides))


def test_benchmarks_after_training_a_model_that_is_no_language_model_are_refused(tmp_path):
    """A QA model has no words to score: refused before training, in one line, nothing
    written."""
    run = tmp_path / "run"
    proc = run_train(
        "recipe=bert_squad",
        "debug=smoke",
        "logger=none",
        "trainer.benchmarks=[recipes_local]",
        f"output_dir={run}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.benchmarks=['recipes_local']: lm-eval scores language models" in proc.stderr
    assert not (run / "checkpoints").exists() and not (run / "final").exists()


@pytest.mark.slow  # lm-eval indexes every task file it ships (about 7 s)
def test_an_unknown_task_is_refused_with_the_setting_and_how_to_list_tasks(tmp_path):
    from recipes.benchmark import Benchmarks

    with pytest.raises(ConfigError) as err:
        Benchmarks(["recipes_local", "hellaswagg"], BenchmarkConfig(), tmp_path, "benchmark.tasks")
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("benchmark.tasks: lm-eval has no task, group or tag named hellaswagg ")
    assert "did you mean hellaswag?" in line and "`lm-eval ls tasks`" in line


def test_bundled_tasks_are_lm_evals_own_prompts_on_the_bundled_rows(tmp_path):
    """recipes_hellaswag asks what lm-eval's hellaswag asks (its own process_docs on the same
    rows, in HellaSwag's layout), recipes_squad what its squadv2 asks; every data file is read
    from its absolute path, whatever the working directory."""
    from lm_eval.tasks import TaskManager, get_task_dict
    from lm_eval.tasks.hellaswag.utils import process_docs
    from lm_eval.tasks.squadv2.task import SQuAD2

    from recipes.benchmark import LOCAL_TASKS, write_local_tasks

    folder = write_local_tasks(tmp_path / "tasks")
    manager = TaskManager(include_path=[str(folder)], include_defaults=False)
    tasks = get_task_dict(["recipes_local"], manager)  # the tag: both tasks
    hellaswag, squad = tasks["recipes_hellaswag"], tasks["recipes_squad"]

    rows = list(hellaswag.validation_docs())
    assert len(rows) == 400 and len(list(hellaswag.training_docs())) == 2000
    import datasets

    theirs = process_docs(
        datasets.Dataset.from_list(
            [
                {
                    "activity_label": r["activity_label"],
                    "ctx_a": r["sent1"],
                    "ctx_b": r["sent2"],
                    "endings": [r[f"ending{i}"] for i in range(4)],
                    "label": str(r["label"]),
                }
                for r in rows
            ]
        )
    )
    for ours, their in zip(rows, theirs, strict=True):
        assert hellaswag.doc_to_text(ours) == their["query"]
        assert hellaswag.doc_to_choice(ours) == their["choices"]
        assert hellaswag.doc_to_target(ours) == their["gold"]

    questions = list(squad.validation_docs())
    assert len(questions) == 409 and len(list(squad.training_docs())) == 89
    for doc in questions:
        assert squad.doc_to_text(doc) == SQuAD2.doc_to_text(None, doc)
        assert squad.doc_to_target(doc) == doc["answers"] and doc["answers"]
    # SQuAD's normalisation: case, punctuation and articles do not count.
    scored = squad.process_results(questions[0], ["  The Melt"])  # gold: melt (magma and/or lava)
    assert scored == {"exact_match": 1.0}
    assert squad.process_results(questions[0], ["magma"]) == {"exact_match": 0.0}

    written = sorted(folder.glob("*.yaml"))
    assert [p.name for p in written] == sorted(p.name for p in LOCAL_TASKS.glob("*.yaml"))
    for path in written:
        for file in _data_files(path):
            assert Path(file).is_absolute() and Path(file).is_file(), (path.name, file)


def test_scores_are_flattened_with_their_filter_and_standard_error():
    from recipes.benchmark import Report, flat_scores

    results = {
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "exact_match,strict-match": 0.25,
                "exact_match_stderr,strict-match": 0.01,
                "exact_match,flexible-extract": 0.5,
                "exact_match_stderr,flexible-extract": "N/A",
            },
            "wikitext": {"alias": "wikitext", "word_perplexity,none": 30.5, "sample_len": 62},
        },
        "higher_is_better": {"wikitext": {"word_perplexity": False}},
    }
    scores = flat_scores(results)
    assert scores == {
        "benchmark/gsm8k/exact_match,strict-match": 0.25,
        "benchmark/gsm8k/exact_match_stderr,strict-match": 0.01,
        "benchmark/gsm8k/exact_match,flexible-extract": 0.5,
        "benchmark/wikitext/word_perplexity": 30.5,
    }
    report = Report(scores, results)
    assert report.main_metric == "benchmark/gsm8k/exact_match,strict-match"
    assert report.greater_is_better
    wiki = Report({"benchmark/wikitext/word_perplexity": 30.5}, results)
    assert not wiki.greater_is_better


def _benchmark_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.benchmark", *args, "--limit", "4"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_benchmark_command_prints_the_scores_and_files_them_with_the_run(tmp_path):
    """``python -m recipes.benchmark <run>/final`` prints lm-eval's score table (each metric's
    value and standard error, as results.json has them) and writes to ``<run>/benchmark``; a
    model folder of no run gets ``outputs/benchmark/<date_time>`` in the working directory, and
    nothing is written beside that model."""
    run = tmp_path / "run"
    shutil.copytree(TINY_LLAMA, run / "final")
    (run / "config.yaml").write_text("mode: train\n")  # what makes it a run's final/
    proc = _benchmark_cli(str(run / "final"), "--tasks", "recipes_hellaswag", cwd=tmp_path)
    *table, last = proc.stdout.strip().splitlines()
    assert last == f"results: {run / 'benchmark' / 'results.json'}"
    scores = json.loads((run / "benchmark" / "results.json").read_text())["results"]
    scored = scores["recipes_hellaswag"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table if line]
    (cells,) = [row for row in rows if row[4] == "acc"]  # task, version, filter, shots, metric
    assert cells[0] == "recipes_hellaswag"
    assert float(cells[6]) == pytest.approx(scored["acc,none"], abs=5e-5)
    assert float(cells[8]) == pytest.approx(scored["acc_stderr,none"], abs=5e-5)
    assert scored["acc_stderr,none"] > 0  # a number the table could misprint

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = sorted(p.name for p in TINY_LLAMA.parent.iterdir())
    proc = _benchmark_cli(str(TINY_LLAMA), "--tasks", "recipes_hellaswag", cwd=elsewhere)
    (written,) = (elsewhere / "outputs" / "benchmark").glob("*/results.json")
    assert proc.stdout.strip().splitlines()[-1] == f"results: {written.relative_to(elsewhere)}"
    assert "recipes_hellaswag" in proc.stdout
    assert sorted(p.name for p in TINY_LLAMA.parent.iterdir()) == before


@pytest.mark.slow
def test_mode_benchmark_without_a_recipe_is_filed_under_benchmark(tmp_path):
    """``mode=benchmark`` without ``recipe=`` or ``output_dir=``: the run folder is
    ``outputs/benchmark/<date_time>``, not the default recipe's ``outputs/bert_squad/...``, and
    no folder is left under the recipe's name. Without a model either, it is refused in one line
    (it would score the default recipe's model), leaving no folder."""
    refused = run_train(
        "mode=benchmark", "benchmark.tasks=[recipes_hellaswag]", cwd=tmp_path, check=False
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "set model.name_or_path=" in refused.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("outputs/*/*")), list(tmp_path.rglob("*"))
    done = run_train(
        "mode=benchmark",
        f"model.name_or_path={TINY_LLAMA}",
        "benchmark.tasks=[recipes_hellaswag]",
        "benchmark.limit=4",
        "logger=none",
        "trainer.progress_bar=false",
        cwd=tmp_path,
    )
    assert done.returncode == 0
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert run.parent.name == "benchmark", run
    results = json.loads((run / "results.json").read_text())
    assert results["mode"] == "benchmark" and results["main_value"] > 0
    assert (run / "benchmark" / "samples_recipes_hellaswag.jsonl").is_file()
    assert f"output_dir: {run}" in (run / "config.yaml").read_text()


# --- end to end: our mode=benchmark against lm-eval's command line --------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """mode=benchmark on the bundled tiny Llama, in one process, logged to wandb offline."""
    run = tmp_path_factory.mktemp("benchmark") / "one"
    run_train(*_benchmark_overrides(run), "logger=wandb")
    return run


def _benchmark_overrides(run: Path) -> tuple[str, ...]:
    return (
        "mode=benchmark",
        f"model.name_or_path={TINY_LLAMA}",
        "benchmark.tasks=[recipes_local]",
        f"benchmark.limit={LIMIT}",
        f"benchmark.batch_size={BATCH}",
        "trainer.progress_bar=false",
        f"output_dir={run}",
    )


@pytest.mark.slow
def test_mode_benchmark_scores_what_lm_evals_command_line_scores(one_process, tmp_path):
    """The same numbers from lm-eval's own command line (its HFLM loading the folder itself) on
    the same model, tasks and batch size: every request's log-likelihood and every generated
    answer, hence acc, acc_norm and exact_match."""
    out = tmp_path / "cli"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model=hf",
            f"--model_args=pretrained={TINY_LLAMA}",
            "--device=cpu",
            f"--batch_size={BATCH}",
            "--tasks=recipes_local",
            f"--include_path={one_process / 'benchmark' / 'tasks'}",
            f"--limit={LIMIT}",
            f"--output_path={out}",
            "--log_samples",
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    theirs = json.loads(next(out.rglob("results_*.json")).read_text())
    ours = json.loads((one_process / "results.json").read_text())
    for task in ("recipes_hellaswag", "recipes_squad"):
        for key in METRICS:
            if key in theirs["results"][task]:
                assert ours["lm_eval"]["results"][task][key] == theirs["results"][task][key]
        their_samples = _samples(next(out.rglob(f"samples_{task}_*.jsonl")))
        our_samples = _samples(one_process / "benchmark" / f"samples_{task}.jsonl")
        assert len(our_samples) == LIMIT
        assert our_samples == their_samples
    assert theirs["results"]["recipes_hellaswag"]["acc,none"] > 0  # scores that could differ

    # The same scores in metrics.jsonl, results.json's metrics and the wandb run.
    (record,) = read_metrics(one_process)
    expected = {
        "benchmark/recipes_hellaswag/acc": theirs["results"]["recipes_hellaswag"]["acc,none"],
        "benchmark/recipes_hellaswag/acc_norm": theirs["results"]["recipes_hellaswag"][
            "acc_norm,none"
        ],
        "benchmark/recipes_squad/exact_match": theirs["results"]["recipes_squad"][
            "exact_match,none"
        ],
    }
    assert {k: record[k] for k in expected} == expected
    assert {k: ours["metrics"][k] for k in expected} == expected
    assert ours["main_metric"] == "benchmark/recipes_hellaswag/acc"
    (wandb_file,) = (one_process / "wandb").glob("offline-run-*/run-*.wandb")
    (row,) = [r for r in wandb_records.history(wandb_file) if expected.keys() <= r.keys()]
    assert {k: row[k] for k in expected} == expected


@pytest.mark.slow
def test_two_processes_score_as_one(one_process, tmp_path):
    """Under ``accelerate launch`` (2 gloo processes) each scores half the requests (lm-eval's
    data parallelism); gathered, every sample and score is the one process's."""
    run = tmp_path / "two"
    done = run_cpu_launch(
        ROOT / "train.py", *_benchmark_overrides(run), "logger=none", "trainer.mixed_precision=no"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in (run / "train.log").read_text()
    one = json.loads((one_process / "results.json").read_text())
    two = json.loads((run / "results.json").read_text())
    assert two["metrics"] == one["metrics"]
    for task in ("recipes_hellaswag", "recipes_squad"):
        name = f"samples_{task}.jsonl"
        split, whole = (
            _samples(run / "benchmark" / name),
            _samples(one_process / "benchmark" / name),
        )
        assert [doc for doc, _ in split] == [doc for doc, _ in whole]
        for (_, halves), (_, ours) in zip(split, whole, strict=True):
            if task == "recipes_squad":  # greedy answers
                assert halves == ours
                continue
            # The same requests batched with others (other padded shapes): float rounding only.
            assert [greedy for _, greedy in halves] == [greedy for _, greedy in ours]
            assert [ll for ll, _ in halves] == pytest.approx([ll for ll, _ in ours], rel=1e-5)


@pytest.mark.slow
def test_trainer_benchmarks_score_final_after_training_on_the_musa_device(tmp_path):
    """``trainer.benchmarks`` run on final/ once it is saved, on the (emulated) MUSA card the run
    trained on: logged at the last step, in results.json, and what lm-eval scores on that final/
    loading it itself on the CPU (the same kernels, up to float rounding)."""
    run = tmp_path / "run"
    run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "trainer.max_steps=3",
        "trainer.eval_at_end=false",
        "trainer.benchmarks=[recipes_hellaswag]",
        "benchmark.limit=10",
        "logger=none",
        "trainer.progress_bar=false",
        f"output_dir={run}",
        script=on_musa(),
    )
    assert "device musa" in (run / "train.log").read_text()
    last = read_metrics(run)[-1]
    assert last["step"] == 3 and "benchmark/recipes_hellaswag/acc" in last
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 3
    assert (
        results["benchmarks"]["benchmark/recipes_hellaswag/acc"]
        == last["benchmark/recipes_hellaswag/acc"]
    )

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    theirs = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(run / "final"), "device": "cpu"},
        tasks=["recipes_hellaswag"],
        limit=10,
        batch_size=BenchmarkConfig().batch_size,
        task_manager=TaskManager(
            include_path=[str(run / "benchmark" / "tasks")], include_defaults=False
        ),
    )
    for key in ("acc,none", "acc_norm,none"):
        their = theirs["results"]["recipes_hellaswag"][key]
        assert results["lm_eval"]["results"]["recipes_hellaswag"][key] == their
    ours = _samples(run / "benchmark" / "samples_recipes_hellaswag.jsonl")
    their_samples = sorted(theirs["samples"]["recipes_hellaswag"], key=lambda s: s["doc_id"])
    assert [doc for doc, _ in ours] == [s["doc_id"] for s in their_samples]
    for (_, mine), sample in zip(ours, their_samples, strict=True):
        their_lls = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert [ll for ll, _ in mine] == pytest.approx(their_lls, rel=1e-5)


def _samples(path: Path) -> list[tuple[int, list]]:
    """Each sample's doc id and its filtered responses (log-likelihoods as floats: lm-eval's
    command line writes them as strings), in doc order."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((row["doc_id"], _responses(row["filtered_resps"])) for row in rows)


def _responses(responses: list) -> list:
    return [
        [float(r[0]), str(r[1]) == "True"] if isinstance(r, (list, tuple)) else r for r in responses
    ]


def _data_files(path: Path) -> list[str]:
    import yaml

    return list(yaml.safe_load(path.read_text())["dataset_kwargs"]["data_files"].values())
