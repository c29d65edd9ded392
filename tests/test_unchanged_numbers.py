"""Every recipe's smoke run gives the numbers it gave before the task layer was reshaped (issue
43): per-step losses and the task's own logged statistics, the evaluation's scores, and the
answers of ``mode=predict``, in fp32 on the CPU (the emulated MUSA card's one-card runs are
compared with these CPU runs step by step in test_emulated_recipes.py).

The pinned numbers are in ``tests/unchanged_numbers.json``; a refactor must leave them as they
are. Re-record them only for a change that is meant to change numbers, and say so in its commit:

    python tests/test_unchanged_numbers.py --record            # every recipe, ~6 min on 2 cores
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import GOLDEN_RUN, ROOT, Sweep, read_metrics, run_train, sweep_train

pytestmark = pytest.mark.slow

PINS = Path(os.environ.get("UNCHANGED_PINS", Path(__file__).with_name("unchanged_numbers.json")))
RECIPES = (
    "bert_squad",
    "bert_squad_v2",
    "bert_glue",
    "bert_mlm",
    "bert_ner",
    "bert_swag",
    "gpt2_clm",
    "llama_clm",
    "llama_sft",
    "llama_dpo",
    "llama_kto",
    "llama_grpo",
    "llama_gkd",
    "t5_summarization",
    "t5_translation",
    "t5_squad",
)
# Three logged fp32 steps, then one evaluation on 16 held-out rows (generation too, where the
# task evaluates by generating), and final/ for the predict runs.
RUN = (
    *GOLDEN_RUN,
    "trainer.max_steps=3",
    "trainer.eval_at_end=true",
    "data.max_eval_examples=16",
    "trainer.per_device_eval_batch_size=8",
    "debug=smoke",
    "logger=none",
    "trainer.progress_bar=false",
)
PREDICTS = {
    "bert_glue": ROOT / "recipes/assets/glue/qnli-squad/dev.tsv",
    "llama_sft": ROOT / "recipes/assets/conversations/squad/dev.jsonl",
    "bert_squad": ROOT / "recipes/assets/squad/v1/dev.json",
}
# Logged values that measure time or memory, not the computation.
_TIMED = (
    "per_second",
    "runtime",
    "s_per_step",
    "seconds",
    "generate_s",
    "mfu",
    "flops",
    "peak_memory",
)


def _numbers(record: dict) -> dict[str, float]:
    return {
        k: v
        for k, v in record.items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and k not in ("step", "time")
        and not any(t in k for t in _TIMED)
        and k != "train/samples_seen"
    }


def _predictions(folder: Path) -> list:
    """The predict run's file, read as records (answers, labels, probabilities, texts)."""
    for name in ("predictions.jsonl", "generations.jsonl"):
        if (folder / name).exists():
            return [json.loads(line) for line in (folder / name).read_text().splitlines()]
    found = json.loads((folder / "predictions.json").read_text())
    return sorted(found.items())


@functools.cache
def _sweep(recipes: tuple[str, ...], predicts: bool, root: Path, cache: Path) -> Sweep:
    """``recipes`` (all with a predict run, or all without) as one Hydra sweep
    (:func:`conftest.sweep_train`): a job's numbers are a fresh process's, so they match the
    pins, recorded one run per process."""
    return sweep_train(
        recipes,
        *RUN,
        f"trainer.save_final_model={'true' if predicts else 'false'}",
        f"data.cache_dir={cache}",
        output_dir=root / "-".join(recipes),
    )


def measure(recipe: str, recipes: tuple[str, ...], root: Path, cache: Path) -> dict:
    """``recipe``'s numbers, from the sweep of those of ``recipes`` that share its settings."""
    predict_file = PREDICTS.get(recipe)
    predicts = predict_file is not None
    group = tuple(r for r in recipes if (r in PREDICTS) == predicts)
    run = _sweep(group, predicts, root, cache).job(recipe)
    records = read_metrics(run)
    out = {
        "train": [_numbers(m) for m in records if "train/loss" in m],
        "eval": [_numbers(m) for m in records if any(k.startswith("eval/") for k in m)],
    }
    if predict_file:
        predicted = root / f"{recipe}-predict"
        run_train(
            f"recipe={recipe}",
            "debug=smoke",
            "logger=none",
            "trainer.progress_bar=false",
            "mode=predict",
            f"model.name_or_path={run}/final",
            f"data.predict_file={predict_file}",
            "data.max_eval_examples=16",
            "generation.max_new_tokens=12",
            f"data.cache_dir={cache}",
            f"output_dir={predicted}",
        )
        out["predict"] = _predictions(predicted)[:16]
    return out


def _close(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: {len(a)} entries != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, int | float):
        ok = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
        assert ok, f"{where}: {a} != pinned {b}"
    else:
        assert a == b, f"{where}: {a!r} != pinned {b!r}"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("unchanged-numbers")


@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_numbers_are_unchanged(recipe, root, cache_dir):
    pinned = json.loads(PINS.read_text())[recipe]
    _close(measure(recipe, RECIPES, root, cache_dir), pinned, recipe)


if __name__ == "__main__":  # python tests/test_unchanged_numbers.py --record [recipe ...]
    assert sys.argv[1:2] == ["--record"], __doc__
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    chosen = sys.argv[2:] or list(RECIPES)
    pins = json.loads(PINS.read_text()) if PINS.exists() else {}
    root = Path(tempfile.mkdtemp(prefix="unchanged-numbers-"))
    for name in chosen:
        pins[name] = measure(name, tuple(chosen), root, root / "cache")
        print(name, json.dumps(pins[name]["train"][-1]), flush=True)
        PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
