"""Progress bars for long data preparation: a ``datasets`` map over many rows draws its bar
(named by its ``desc``) on the local main process's stderr, and nowhere when bars are off
(``recipes.data.show_progress``) or on another process; a map over few rows draws none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pytest
from conftest import ROOT, make_task

from recipes import data as data_lib
from recipes.config import DataConfig, ModelConfig
from recipes.model import load_tokenizer

TRAIN_ROWS = data_lib.MAP_PROGRESS_ROWS + 200  # a bar
EVAL_ROWS = 20  # no bar
TRAIN_BAR = "train: render and tokenize (sft)"


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("conversations")
    for name, rows in (("train.jsonl", TRAIN_ROWS), ("dev.jsonl", EVAL_ROWS)):
        lines = (
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Where is city {i}?"},
                        {"role": "assistant", "content": f"In country {i}."},
                    ]
                }
            )
            for i in range(rows)
        )
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def bars_off_after():
    yield
    data_lib.show_progress(True)


def _build(folder: Path, cache: Path) -> None:
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(ROOT / "recipes/assets/tiny-llama")))
    task = make_task("sft", chat_template="zephyr", max_seq_length=64, num_generations=0)
    task.build_data(DataConfig(path=str(folder), cache_dir=str(cache)), tokenizer)


def test_tokenizing_many_rows_draws_a_bar_on_stderr(conversations, tmp_path, capfd):
    datasets.disable_progress_bars()  # as recipes.log.setup_logging leaves them
    _build(conversations, tmp_path / "cache")
    err = capfd.readouterr().err
    assert f"{TRAIN_BAR}: 100%" in err and f"{TRAIN_ROWS}/{TRAIN_ROWS}" in err
    assert "eval: render and tokenize" not in err  # 20 rows: no bar
    assert "Saving the dataset" not in err  # only the maps' bars are turned on
    assert datasets.are_progress_bars_disabled()


def test_no_bar_when_progress_is_off(conversations, tmp_path, capfd, bars_off_after):
    data_lib.show_progress(False)  # trainer.progress_bar=false
    datasets.enable_progress_bars()  # even where datasets' own bars are on
    try:
        _build(conversations, tmp_path / "cache")
    finally:
        datasets.disable_progress_bars()
    assert "render and tokenize" not in capfd.readouterr().err


@pytest.mark.slow  # a fresh interpreter: imports take most of its 15 s
def test_no_bar_on_another_process(conversations, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_progress import _build
        from pathlib import Path
        _build(Path({str(conversations)!r}), Path({str(tmp_path / "cache")!r}))
        """
    )
    env = {**os.environ, "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "render and tokenize" not in proc.stderr
    assert list((tmp_path / "cache").glob("sft-train-*"))  # it did build the features
