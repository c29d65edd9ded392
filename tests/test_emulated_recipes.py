"""Every recipe on the emulated MUSA device (``scripts/emulated_musa.py``, the newest torch_musa
stand-in, ``fake_torch_musa.NEWEST``, on S4000 cards unless a test says otherwise), as ``python train.py`` and under
``accelerate launch --config_file conf/accelerate/multi_musa.yaml``.

- On one card, in fp32 with the same seed, each step's loss equals the CPU run's within 1e-5:
  the device runs the CPU's kernels, so any larger gap is the project computing something else
  on the device (a tensor left behind, a branch on the device type).
- On two cards (MULTI_MUSA, mccl), half the batch each, the losses equal one card's with the
  same global batch.
- Under bf16 autocast, and with the oldest release on an S80 (fp16 with the grad scaler, no
  fused AdamW kernel), every step runs.

Dropout is switched off in the exact comparisons, so one process and two draw nothing that
could differ; the resume test (test_emulated_runs.py) keeps it.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from pathlib import Path

import pytest
from conftest import GOLDEN_RUN, Sweep, musa_launch, on_musa, read_metrics, run_train, sweep_train

pytestmark = pytest.mark.slow

RECIPES = (
    "bert_squad",
    "bert_squad_v2",
    "bert_glue",
    "bert_mlm",
    "gpt2_clm",
    "llama_clm",
    "llama_sft",
    "llama_dpo",
)
# The recipes of the later tasks: on one card; two cards for one recipe of each task.
ONE_CARD = (
    *RECIPES,
    *("bert_ner", "bert_swag", "t5_summarization", "t5_translation", "t5_squad", "llama_grpo"),
    "llama_kto",  # one card only: its KL estimate pairs rows within a micro-batch
    "llama_rm",
    "llama_gkd",
)
TWO_CARDS = (*RECIPES, "bert_ner", "bert_swag", "t5_squad", "llama_grpo")
# Runs that also evaluate: a sequence-to-sequence evaluation generates (beam search, the KV
# cache) on the card, and its texts must be the CPU's.
EVALUATES = {
    "t5_squad": (
        "trainer.eval_at_end=true",
        "data.max_eval_examples=16",
        "generation.num_beams=2",
    ),
}
GLOBAL_BATCH = 8
EXACT = (
    *GOLDEN_RUN,  # plain order, whole micro-batches, fp32, no evaluation
    "trainer.max_steps=3",
    "debug=smoke",
    "logger=none",
    "trainer.progress_bar=false",
)
BERT_NO_DROPOUT = (
    "model.attention_dropout=0.0",
    "++model.config_overrides.hidden_dropout_prob=0.0",
)
NO_DROPOUT = {
    "bert_squad": BERT_NO_DROPOUT,
    "bert_squad_v2": BERT_NO_DROPOUT,
    "bert_glue": BERT_NO_DROPOUT,
    "bert_mlm": BERT_NO_DROPOUT,
    "bert_ner": BERT_NO_DROPOUT,
    "bert_swag": BERT_NO_DROPOUT,
    "gpt2_clm": (
        "model.attention_dropout=0.0",
        "++model.config_overrides.resid_pdrop=0.0",
        "++model.config_overrides.embd_pdrop=0.0",
    ),
}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _losses(run: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run) if "train/loss" in m]


@functools.cache
def _runs() -> Path:
    return Path(tempfile.mkdtemp(prefix="emulated-recipes-"))


def _extras(recipe: str) -> tuple[str, ...]:
    return (*NO_DROPOUT.get(recipe, ()), *EVALUATES.get(recipe, ()))


@functools.cache
def _sweep(where: str, recipes: tuple[str, ...], extra: tuple[str, ...], cache_dir: Path) -> Sweep:
    """``recipes`` that share ``extra`` (their dropout and evaluation settings) as one Hydra
    sweep (:func:`conftest.sweep_train`); ``where``: ``cpu``, ``one`` card, ``two`` cards
    (MULTI_MUSA, mccl, half the global batch each, the sweep's jobs in the same two ranks under
    accelerate launch) or ``bf16`` (one card, bf16 autocast, 2 steps)."""
    per_device = GLOBAL_BATCH // 2 if where == "two" else GLOBAL_BATCH
    overrides = [
        *EXACT,
        *extra,
        f"trainer.per_device_train_batch_size={per_device}",
        f"data.cache_dir={cache_dir}",
    ]
    if where == "bf16":
        overrides += ["trainer.mixed_precision=bf16", "trainer.max_steps=2"]
    script = {
        "cpu": {},
        "two": {"script": musa_launch(2), "env": ONE_THREAD},
    }.get(where, {"script": on_musa()})
    sweep = _runs() / f"{where}-{'-'.join(recipes)}"
    return sweep_train(recipes, *overrides, output_dir=sweep, **script)


def _in_sweep(recipe: str, where: str, recipes: tuple[str, ...], cache_dir: Path) -> Path:
    """``recipe``'s run of ``where``, swept with the others of ``recipes`` that share its
    settings."""
    extra = _extras(recipe) if where != "bf16" else ()
    group = tuple(r for r in recipes if where == "bf16" or _extras(r) == extra)
    return _sweep(where, group, extra, cache_dir).job(recipe)


def _one_card(recipe: str, cache_dir: Path) -> Path:
    run = _in_sweep(recipe, "one", ONE_CARD, cache_dir)
    assert "device musa, 1 process(es)" in (run / "train.log").read_text()
    return run


def _two_cards(recipe: str, cache_dir: Path) -> Path:
    """Two cards (MULTI_MUSA, mccl), half the global batch each, under accelerate launch: the
    recipes that share their settings as one sweep in the same two ranks."""
    run = _in_sweep(recipe, "two", TWO_CARDS, cache_dir)
    log = (run / "train.log").read_text()
    assert "device musa:0, 2 process(es)" in log and "DistributedType.MULTI_MUSA" in log
    return run


@pytest.mark.parametrize("recipe", ONE_CARD)
def test_one_card_equals_the_cpu(recipe, cache_dir):
    cpu_run = _in_sweep(recipe, "cpu", ONE_CARD, cache_dir)
    musa_run = _one_card(recipe, cache_dir)
    cpu, musa = _losses(cpu_run), _losses(musa_run)
    assert len(musa) == len(cpu) == 3
    assert musa == pytest.approx(cpu, abs=1e-5)
    if recipe in EVALUATES:
        generated = [(r / "eval_predictions.jsonl").read_text() for r in (cpu_run, musa_run)]
        assert generated[0].count("\n") == 16 and generated[1] == generated[0]


@pytest.mark.parametrize("recipe", TWO_CARDS)
def test_two_cards_under_multi_musa_equal_one(recipe, cache_dir):
    two = _losses(_two_cards(recipe, cache_dir))
    one = _losses(_one_card(recipe, cache_dir))
    assert len(two) == 3
    if recipe == "bert_mlm":
        # Masked LM draws its masks per process from the process's generator (as
        # transformers' DataCollatorForLanguageModeling does), so two processes mask other
        # tokens than one: the first loss is of the same model on other masks.
        assert two[0] == pytest.approx(one[0], rel=0.01) and all(map(math.isfinite, two))
        return
    assert two == pytest.approx(one, abs=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_autocast(recipe, cache_dir):
    run = _in_sweep(recipe, "bf16", RECIPES, cache_dir)
    log = (run / "train.log").read_text()
    assert "autocast: bf16" in log and "device musa" in log
    losses = _losses(run)
    assert len(losses) == 2 and all(map(math.isfinite, losses))


def test_oldest_release_on_an_s80_trains_in_fp16_with_the_grad_scaler(tmp_path, cache_dir):
    """torch_musa v1.3.0 on an MTT S80: no bf16 (fp16 and accelerate's grad scaler by default),
    no fused AdamW kernel (choosing it would fail at the first step), no MCCL; the SFT recipe
    trains and saves a final/ that loads on the CPU."""
    run = tmp_path / "run"
    done = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.mixed_precision=auto",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        f"data.cache_dir={cache_dir}",
        f"output_dir={run}",
        script=on_musa(release="v1.3.0", card="S80"),
    )
    assert "mixed precision fp16" in done.stderr and "autocast: fp16" in done.stderr
    assert len(_losses(run)) == 3 and all(map(math.isfinite, _losses(run)))
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["model_type"] == "llama"
