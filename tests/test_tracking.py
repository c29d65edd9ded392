"""What a run leaves for people to look at: wandb (offline) and TensorBoard records, the curves
PNG, results.json, and the summary of a Hydra sweep. Every check reads the files a real run
wrote and compares them with metrics.jsonl, the run's own record."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import wandb_records
import yaml
from conftest import ROOT, read_metrics, run_train

pytestmark = pytest.mark.slow

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
SMOKE_CLM = (
    "recipe=gpt2_clm",
    "debug=smoke",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=4",
    "trainer.save_every_n_steps=4",
)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory, cache_dir):
    """A smoke run logged to wandb offline for 4 steps, then continued from its step-4
    checkpoint to step 8 (``resume=auto``), as a requeued job would."""
    run = tmp_path_factory.mktemp("wandb") / "run"
    common = (*SMOKE_CLM, "logger=wandb", f"output_dir={run}", f"data.cache_dir={cache_dir}")
    run_train(*common, "trainer.max_steps=4", env=OFFLINE)
    shutil.rmtree(run / "final")  # as if stopped before the end
    run_train(*common, "trainer.max_steps=8", "resume=auto", env=OFFLINE)
    return run


def test_wandb_offline_run_has_every_logged_step_config_and_tags(wandb_run):
    first, resumed = _offline_runs(wandb_run)
    record = wandb_records.run_record(first)
    # one wandb run for the run folder: the resumed process continued the same id
    assert wandb_records.run_record(resumed).run_id == record.run_id
    assert (wandb_run / "wandb" / "run-id").read_text().strip() == record.run_id
    assert record.project == "musa-recipes"
    assert record.run_group == record.display_name == "-".join(wandb_run.parts[-2:])
    assert {"recipe:gpt2_clm", "model:tiny-gpt2", "device:cpu", "world_size:1"} <= set(record.tags)

    # the composed config, as in the run folder's config.yaml
    logged = wandb_records.config(first)
    composed = yaml.safe_load((wandb_run / "config.yaml").read_text())
    for group in ("model", "trainer", "optimizer", "data", "task"):
        assert logged[group] == composed[group], group

    # loss and lr at every logged step, equal to metrics.jsonl; samples seen alongside
    history = wandb_records.history(first) + wandb_records.history(resumed)
    train_rows = {row["_step"]: row for row in history if "train/loss" in row}
    expected = {r["step"]: r for r in read_metrics(wandb_run) if "train/loss" in r}
    assert sorted(train_rows) == sorted(expected) == [2, 4, 6, 8]
    for step, row in train_rows.items():
        assert row["train/loss"] == pytest.approx(expected[step]["train/loss"], rel=1e-6)
        assert row["train/lr"] == pytest.approx(expected[step]["train/lr"], rel=1e-6)
        assert row["train/samples_seen"] == expected[step]["train/samples_seen"] > 0
    eval_steps = sorted(row["_step"] for row in history if "eval/perplexity" in row)
    assert eval_steps == [0, 4, 8]

    # the final model's metrics in the summary, as in results.json
    results = json.loads((wandb_run / "results.json").read_text())
    summary = wandb_records.summary(resumed)
    assert results["main_metric"] == "eval/perplexity"
    assert summary["final/perplexity"] == pytest.approx(results["main_value"])
    assert results["metrics"]["eval/perplexity"] == results["main_value"]


def test_tensorboard_event_files_hold_the_logged_numbers(tmp_path, cache_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run_train(
        *SMOKE_CLM,
        "logger=tensorboard",
        "trainer.max_steps=6",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
    )
    folders = {p.parent for p in (run / "tensorboard").rglob("events.out.tfevents.*")}
    scalars = {}
    for folder in folders:
        events = EventAccumulator(str(folder))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars[tag] = {e.step: e.value for e in events.Scalars(tag)}
    expected = {r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r}
    assert sorted(scalars["train/loss"]) == sorted(expected) == [2, 4, 6]
    for step, loss in expected.items():
        assert scalars["train/loss"][step] == pytest.approx(loss, rel=1e-6)
    assert "train/lr" in scalars and "eval/perplexity" in scalars
    assert list((run / "tensorboard").rglob("hparams.yml"))  # the config, as hyperparameters

    # curves.png of the run, and a comparison drawn by the script
    assert _png_size(run / "curves.png")[0] >= 800
    other = tmp_path / "other"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("final", "checkpoints"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_run.py"), str(run), str(other)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(done.stdout.strip()) == run / "compare.png"
    assert _png_size(run / "compare.png")[0] >= 800
    refused = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_run.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "no metrics.jsonl" in refused.stderr


def test_sweep_writes_a_folder_per_job_and_one_summary(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    run_train(
        "-m",
        "recipe=gpt2_clm",
        "debug=smoke",
        "logger=none",
        "optimizer.lr=1e-3,3e-3,1e-2",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=2",
        "trainer.eval_every_n_steps=3",
        f"data.cache_dir={cache_dir}",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2"]
    for job in jobs:
        assert (job / "final" / "model.safetensors").exists()
        assert (job / "metrics.jsonl").exists() and (job / "curves.png").exists()
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["job"] for row in rows] == ["0", "1", "2"]
    assert [float(row["optimizer.lr"]) for row in rows] == [1e-3, 3e-3, 1e-2]
    for job, row in zip(jobs, rows, strict=True):
        results = json.loads((job / "results.json").read_text())
        assert row["status"] == "done"
        assert float(row["eval/perplexity"]) == pytest.approx(results["main_value"], rel=1e-6)
        last_eval = [r for r in read_metrics(job) if "eval/perplexity" in r][-1]
        assert results["main_value"] == last_eval["eval/perplexity"]
    # a higher learning rate trains the tiny model faster in 6 steps: the table shows it
    perplexities = [float(row["eval/perplexity"]) for row in rows]
    assert perplexities == sorted(perplexities, reverse=True)
    table = (sweep / "summary.md").read_text().splitlines()
    assert len(table) == 2 + 3 and "optimizer.lr" in table[0]
    assert _png_size(sweep / "curves.png")[0] >= 800


def test_sweep_goes_on_after_a_failed_job_and_each_job_gets_its_precision(tmp_path, cache_dir):
    """A job with a bad setting is a 'failed' row (the others still run, the sweep exits 1);
    jobs in one process build their own Accelerator (bf16, then fp32)."""
    sweep = tmp_path / "sweep"
    done = run_train(
        "-m",
        "recipe=gpt2_clm",
        "debug=smoke",
        "logger=none",
        "trainer.per_device_train_batch_size=0,4",
        "trainer.mixed_precision=bf16,no",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.save_final_model=false",
        f"data.cache_dir={cache_dir}",
        f"hydra.sweep.dir={sweep}",
        check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    for row in rows[:2]:
        assert row["status"].startswith("failed") and "per_device_train_batch_size" in row["status"]
    assert [row["status"] for row in rows[2:]] == ["done", "done"]
    assert [row["trainer.mixed_precision"] for row in rows] == ["bf16", "no", "bf16", "no"]
    for job, precision in (("2", "bf16"), ("3", "no")):
        assert f"mixed precision {precision}" in (sweep / job / "train.log").read_text()
