"""End to end on CPU: ``python train.py ...`` trains, logs, evaluates and saves a usable model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN_RUN, run_train

from recipes import device
from recipes.config import ASSETS

pytestmark = pytest.mark.slow

# First losses of the bundled MiniLM (minilm-squad) on the bundled SQuAD slice: seed 42, fp32, CPU,
# batch 8, lr 1e-3, no warmup, windows of 256 tokens, no dropout (the smoke's). They depend only on
# the shipped weights, the new head's seeded init and the data order, so they hold across
# transformers 4.x / 5.x; a change means the loop, the loss or the features changed.
# (Re-measured when the smoke run turned dropout off.)
GOLDEN_LOSSES = [5.09681, 4.84078, 4.63916, 4.90027, 4.76427]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _smoke(tmp_path: Path, cache_dir: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    run_train(
        "recipe=bert_squad",
        "debug=smoke",
        "logger=none",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        "trainer.progress_bar=false",
        *overrides,
    )
    return run


def test_golden_losses(tmp_path, cache_dir):
    run = _smoke(
        tmp_path,
        cache_dir,
        *GOLDEN_RUN,
        "task.max_seq_length=256",
        "task.doc_stride=96",
        "scheduler.name=cosine",  # the smoke's constant lr warms up for 18 steps
        "scheduler.warmup_steps=0",
    )
    losses = [m["train/loss"] for m in _metrics(run) if "train/loss" in m]
    assert losses == pytest.approx(GOLDEN_LOSSES, abs=1e-4)


def test_smoke_run_trains_evaluates_and_saves(tmp_path, cache_dir):
    # The cadence of logs, evaluations and saving, on the tiny BERT with its old smoke settings:
    # 60 steps of the bundled MiniLM would take minutes (test_golden_losses runs that one).
    run = _smoke(
        tmp_path,
        cache_dir,
        f"model.name_or_path={ASSETS / 'tiny-bert'}",
        "optimizer.lr=1e-3",
        "trainer.per_device_train_batch_size=32",
        "trainer.max_steps=60",
        "trainer.log_every_n_steps=5",
        "trainer.eval_every_n_steps=30",
        "data.max_eval_examples=120",
        "trainer.mixed_precision=auto",  # the default, as a user runs it: bf16 on bf16 CPUs
    )
    log = (run / "train.log").read_text()
    assert f"mixed precision {device.default_mixed_precision()}," in log
    records = _metrics(run)
    train = [m for m in records if "train/loss" in m]
    assert [m["step"] for m in train] == list(range(5, 61, 5))
    assert all(m["train/lr"] > 0 or m["step"] == 60 for m in train)
    assert all(m["train/samples_per_second"] > 0 for m in train)
    assert all(m["train/tflops"] > 0 for m in train)  # model FLOP/s per device
    assert not any("train/mfu" in m for m in train)  # a CPU has no peak in the table
    assert sum(m["train/loss"] for m in train[-3:]) < sum(m["train/loss"] for m in train[:3]) - 1.0
    evals = [m for m in records if "eval/f1" in m]
    assert [m["step"] for m in evals] == [0, 30, 60]  # smoke also scores the untrained model
    assert all(0 <= m["eval/f1"] <= 100 and m["eval/exact_match"] <= m["eval/f1"] for m in evals)

    predictions = json.loads((run / "predictions.json").read_text())
    assert len(predictions) == 120
    assert (run / "nbest_predictions.json").exists() and (run / "config.yaml").exists()
    assert "eval at step 60" in log

    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    final = run / "final"
    model = AutoModelForQuestionAnswering.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    question, context = "Who wrote Hamlet?", "Hamlet is a tragedy written by William Shakespeare."
    try:
        from transformers import pipeline

        answer = pipeline("question-answering", model=model, tokenizer=tokenizer)(
            question=question, context=context
        )["answer"]
    except (KeyError, ImportError, ValueError):  # transformers 5 has no QA pipeline
        enc = tokenizer(question, context, return_tensors="pt", return_offsets_mapping=True)
        offsets = enc.pop("offset_mapping")[0]
        with torch.no_grad():
            out = model(**enc)
        in_context = torch.tensor([s == 1 for s in enc.sequence_ids(0)])
        start = out.start_logits[0].masked_fill(~in_context, -math.inf).argmax()
        end_logits = out.end_logits[0].masked_fill(~in_context, -math.inf)
        end_logits[:start] = -math.inf
        end = end_logits.argmax()
        answer = context[offsets[start][0] : offsets[end][1]]
    assert answer and answer in context


def test_v2_smoke_run_reports_no_answer_metrics(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(
        "recipe=bert_squad_v2",
        "debug=smoke",
        "logger=none",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=10",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
    )
    final = [m for m in _metrics(run) if "eval/f1" in m][-1]
    for key in ("eval/HasAns_f1", "eval/NoAns_f1", "eval/best_f1", "eval/best_f1_thresh"):
        assert key in final
    assert json.loads((run / "null_odds.json").read_text())


def test_two_processes_agree_with_one(tmp_path, cache_dir):
    """Two gloo processes: one run folder, one log, and the evaluation of the untrained model
    scores exactly what one process scores (no duplicated or dropped windows)."""
    from conftest import ROOT, run_cpu_launch

    common = (
        "recipe=bert_squad",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "data.max_eval_examples=61",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
    )
    single = tmp_path / "single"
    run_train(*common, f"output_dir={single}")
    double = tmp_path / "double"
    proc = run_cpu_launch(ROOT / "train.py", *common, f"output_dir={double}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _metrics(single), _metrics(double)
    # Written once, by the main process: the steps' records, and the run's memory (its plan
    # and measured peak, recipes/memory.py) once at the end.
    assert [m["step"] for m in two if "memory/peak_gib" not in m] == [0, 1, 2]
    assert [m["step"] for m in two if "memory/peak_gib" in m] == [2]
    assert two[0]["eval/f1"] == pytest.approx(one[0]["eval/f1"], abs=1e-9)
    assert two[0]["eval/exact_match"] == pytest.approx(one[0]["eval/exact_match"], abs=1e-9)
    assert "16 per device x 2 processes" in (double / "train.log").read_text()


def test_compiled_model_trains_like_eager_and_saves_plain_keys(tmp_path, cache_dir):
    """trainer.compile=true: the losses of eager training (within the difference of dropout
    masks: inductor draws them from its own generator), and checkpoints / final/ keep the model's
    own keys, so from_pretrained and resume read them."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    losses = {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        run_train(
            "recipe=gpt2_clm",
            "debug=smoke",
            "logger=none",
            f"output_dir={run}",
            f"data.cache_dir={cache_dir}",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=1",
            "trainer.save_every_n_steps=4",
            f"trainer.compile={str(compiled).lower()}",
            # One compiled evaluation (at the end) is enough; no generated sample.
            "trainer.eval_at_start=false",
            "task.sample_prompt=null",
        )
        losses[compiled] = [r["train/loss"] for r in _metrics(run) if "train/loss" in r]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=2e-3)
    assert losses[True][-1] < losses[True][0] - 0.3  # it trains
    with safe_open(str(run / "checkpoints" / "step-00000004" / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "_orig_mod" in k]  # noqa: SIM118 (not iterable)
    AutoModelForCausalLM.from_pretrained(run / "final")
    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step-00000004")
