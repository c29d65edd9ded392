"""task=multiple_choice: both layouts, run_swag's inputs, padded choices masked out of the loss
and the argmax, the label forms, every refusal (naming file, row and field); then a few
end-to-end runs of recipe=bert_swag (slow): a smoke run that learns, reloaded with transformers,
mode=eval and mode=predict on it; resume; one process against two; LoRA with early stopping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from conftest import ROOT, make_task, read_metrics, run_torchrun, run_train
from torch.utils.data import DataLoader
from transformers import AutoModelForMultipleChoice, AutoTokenizer

from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError
from recipes.evaluation import evaluate
from recipes.tasks.base import RunContext
from recipes.tasks.multiple_choice import MultipleChoiceCollator, masked_logits

ASSETS = ROOT / "recipes" / "assets"
HELLASWAG = ASSETS / "multiple-choice" / "hellaswag"
TINY_BERT = ASSETS / "tiny-bert"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_BERT)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = AutoModelForMultipleChoice.from_pretrained(TINY_BERT, ignore_mismatched_sizes=True)
    return m.eval()


def _rows(folder: Path, rows: list[dict], dev: list[dict] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", rows), ("dev.jsonl", dev if dev is not None else rows)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder


def _build(folder: Path, cache: Path, task=None, **data):
    task = task or make_task("multiple_choice")
    cfg = DataConfig(path=str(folder), cache_dir=str(cache), **data)
    return task, task.build_data(cfg, AutoTokenizer.from_pretrained(TINY_BERT))


SWAG = {
    "sent1": "Students lower their eyes nervously.",
    "sent2": "She",
    "ending0": "pats her shoulder, then saunters toward someone.",
    "ending1": "turns with two students.",
    "ending2": "walks slowly towards someone.",
    "ending3": "wheels around as her dog thunders out.",
    "label": 2,
}


# ----------------------------------------------------------------------------- layouts


def test_swag_rows_become_run_swags_pairs(tmp_path, tokenizer):
    """Real HellaSwag rows: one (sent1, f"{sent2} {ending}") pair per ending, cut longest first
    at task.max_seq_length, the label the ending's index."""
    rows = [json.loads(x) for x in (HELLASWAG / "dev.jsonl").read_text().splitlines()[:20]]
    _, data = _build(
        _rows(tmp_path / "d", rows), tmp_path / "c", make_task("multiple_choice", max_seq_length=32)
    )
    assert len(data.train) == 20
    for row, feature in zip(rows, data.train, strict=True):
        endings = [row[f"ending{i}"] for i in range(4)]
        want = tokenizer(
            [row["sent1"]] * 4,
            [f"{row['sent2']} {e}" for e in endings],
            truncation=True,
            max_length=32,
        )
        assert feature["input_ids"] == want["input_ids"]
        assert feature["token_type_ids"] == want["token_type_ids"]
        assert feature["labels"] == row["label"]
        assert max(len(ids) for ids in feature["input_ids"]) <= 32


def test_swag_takes_any_number_of_endings_and_labels_column(tmp_path):
    row = {k: v for k, v in SWAG.items() if k != "label"}
    row.update(ending4="stops.", ending5="sits down.", labels=5)
    _, data = _build(_rows(tmp_path / "d", [row, {**row, "labels": 0}]), tmp_path / "c")
    assert [len(f["input_ids"]) for f in data.train] == [6, 6]
    assert list(data.train["labels"]) == [5, 0]


def test_generic_layout_label_as_index_text_or_digits(tmp_path, tokenizer):
    rows = [
        {"question": "Where?", "context": "In the park.", "choices": ["here", "there"],
         "label": "there"},
        {"question": "Who?", "context": "Ann met Bo.", "choices": ["Ann", "Bo", "Cy"],
         "label": "Cy"},
        {"question": "When?", "context": "At noon.", "choices": ["2", "noon", "4"],
         "label": "2"},  # a choice's text wins over an index
        {"question": "How?", "context": "By bus.", "choices": ["car", "bus", "foot"],
         "label": "1"},  # digits that are not a choice: an index
    ]  # fmt: skip
    _, data = _build(_rows(tmp_path / "d", rows), tmp_path / "c")
    assert list(data.train["labels"]) == [1, 2, 0, 1]
    # Whole-number indices (a column of text labels holds none: JSON mixes are decoded).
    rows = [{**r, "label": i} for r, i in zip(rows, [1, 2, 0, 1], strict=True)]
    _, data = _build(_rows(tmp_path / "e", rows), tmp_path / "c")
    assert list(data.train["labels"]) == [1, 2, 0, 1]
    assert [len(f["input_ids"]) for f in data.train] == [2, 3, 3, 3]
    want = tokenizer(["Ann met Bo."] * 3, ["Who? Ann", "Who? Bo", "Who? Cy"])
    assert data.train[1]["input_ids"] == want["input_ids"]


def test_generic_layout_with_named_columns_or_a_question_alone(tmp_path, tokenizer):
    rows = [{"q": "2+2?", "options": ["3", "4"], "answer": "4"}]
    _, data = _build(
        _rows(tmp_path / "d", rows),
        tmp_path / "c",
        choices_column="options",
        text_column="q",
        label_column="answer",
    )
    assert data.train[0]["input_ids"] == tokenizer(["2+2?"] * 2, ["3", "4"])["input_ids"]
    assert data.train[0]["labels"] == 1
    rows = [{"question": "2+2?", "choices": ["3", "4"], "label": 1}]
    _, data = _build(_rows(tmp_path / "e", rows), tmp_path / "c")
    assert data.train[0]["input_ids"] == tokenizer(["2+2?"] * 2, ["3", "4"])["input_ids"]


# ----------------------------------------------------------------------------- padding


def test_padded_choices_are_masked_out_of_the_loss_and_the_argmax(tmp_path, model, tokenizer):
    """Rows of 2, 3 and 4 choices in one batch: the loss is the mean of each row's loss run
    alone (no padding), the gradient is finite, and the argmax never picks a padding choice
    even when its raw score is the highest."""
    rows = [
        {"question": "Which is red?", "choices": ["blood", "grass"], "label": 0},
        {"question": "Which flies?", "choices": ["stone", "bird", "fish"], "label": 1},
        {"question": "Which is cold?", "choices": ["fire", "sun", "oven", "ice"], "label": 3},
    ]
    task, data = _build(_rows(tmp_path / "d", rows), tmp_path / "c")
    collate = MultipleChoiceCollator(tokenizer)
    batch = collate(list(data.train))
    assert batch["input_ids"].shape[:2] == (3, 4)
    assert batch["choice_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    model.eval()
    alone = [task.loss(model, collate([f])) for f in data.train]
    together = task.loss(model, batch)
    assert together.item() == pytest.approx(torch.stack(alone).mean().item(), abs=1e-5)
    model.zero_grad()
    together.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # Padding choices get the highest raw score by hand: still never chosen.
    with torch.no_grad():
        logits = masked_logits(model, batch)
    assert torch.isinf(logits[0, 2:]).all() and torch.isinf(logits[1, 3:]).all()
    assert (logits.argmax(-1) < batch["choice_mask"].sum(-1)).all()


def test_collator_pads_to_a_multiple_and_rounds_the_padding_choice(tokenizer):
    collate = MultipleChoiceCollator(tokenizer)
    collate.pad_to_multiple_of = 8
    f = {"input_ids": [[2, 5, 3], [2, 6, 7, 3]], "attention_mask": [[1] * 3, [1] * 4],
         "token_type_ids": [[0] * 3, [0] * 4], "labels": 1}  # fmt: skip
    g = {**f, "input_ids": [[2, 5, 3]] * 3, "attention_mask": [[1] * 3] * 3,
         "token_type_ids": [[0] * 3] * 3, "labels": 2}  # fmt: skip
    batch = collate([f, g])
    assert batch["input_ids"].shape == (2, 3, 8)
    empty = tokenizer("")["input_ids"]
    assert batch["input_ids"][0, 2, : len(empty)].tolist() == empty
    assert batch["attention_mask"][0, 2].sum().item() == len(empty)
    assert batch["labels"].tolist() == [1, 2]


def test_accuracy_and_loss_against_a_direct_computation(tmp_path, model, tokenizer):
    rows = [json.loads(x) for x in (HELLASWAG / "dev.jsonl").read_text().splitlines()[:30]]
    task, data = _build(_rows(tmp_path / "d", rows), tmp_path / "c")
    run = RunContext(Accelerator(cpu=True), tokenizer, None, GenerationConfig())
    loader = DataLoader(data.eval, batch_size=7, collate_fn=data.eval_collator)
    scores = evaluate(task, model, loader, data, run)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(**{k: v for k, v in b.items() if k not in ("labels",
                 "choice_mask")}).logits for b in loader])  # fmt: skip
    labels = torch.tensor([r["label"] for r in rows])
    assert scores["eval/accuracy"] == pytest.approx(
        (logits.argmax(-1) == labels).float().mean().item()
    )
    want = torch.nn.functional.cross_entropy(logits, labels).item()
    assert scores["eval/loss"] == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("rows", "data", "message"),
    [
        ([{k: v for k, v in SWAG.items() if k != "sent2"}], {}, "without column 'sent2'"),
        ([{k: v for k, v in SWAG.items() if k != "label"}], {}, "no label column"),
        ([{"question": "q", "options": ["a", "b"], "label": 0}], {}, "no choices found"),
        ([{"choices": ["a", "b"], "label": 0}], {}, "no question or context column"),
        ([{"sent1": "s", "sent2": "t", "ending0": "a", "label": 0}], {}, "ending1 is missing"),
        ([{"question": "q", "choices": ["a", "b"], "label": 0}], {"choices_column": "opts"},
         "data.choices_column=opts: no such column"),
    ],
)  # fmt: skip
def test_missing_columns_are_refused_by_name(tmp_path, rows, data, message):
    with pytest.raises(DataError, match=message) as err:
        _build(_rows(tmp_path / "d", rows), tmp_path / "c", **data)
    assert str(tmp_path / "d") in str(err.value)


GOOD = {"question": "q", "choices": ["a", "b", "c"], "label": 0}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"label": 3}, r"row 2, field 'label': label 3 is out of range .* \(0 to 2\)"),
        ({"label": -1}, r"row 2, field 'label': label -1 is out of range"),
        ({"label": "d"}, r"row 2, field 'label': label 'd' is not one of the row's 3 choices"),
        ({"label": None}, r"row 2, field 'label': label None is neither"),
        ({"choices": ["a"]}, r"row 2, field 'choices': 1 choice\(s\); a row needs at least 2"),
        ({"choices": ["a", " "]}, r"row 2, field 'choices'\[1\]: the choice is empty"),
        ({"question": None}, r"row 2, field 'question': the text is missing \(no value, or null\)"),
        ({"choices": ["a", None]}, r"row 2, field 'choices'\[1\]: the choice is missing \(null\)"),
    ],
)
def test_bad_generic_rows_are_refused_naming_file_row_and_field(tmp_path, bad, message):
    folder = _rows(tmp_path / "d", [GOOD, {**GOOD, **bad}], [GOOD])
    with pytest.raises(DataError, match=message) as err:
        _build(folder, tmp_path / "c")
    assert str(folder / "train.jsonl") in str(err.value)


def test_bad_swag_rows_are_refused_naming_file_row_and_field(tmp_path):
    without_ending3 = {k: v for k, v in SWAG.items() if k != "ending3"}
    for n, (row, message) in enumerate(
        (
            ({**SWAG, "ending2": ""}, r"row 2, field 'ending2': the choice is empty;"),
            ({**SWAG, "ending2": "  "}, r"row 2, field 'ending2': the choice is empty;"),
            # The key absent (or null) in one row: missing, not empty.
            (
                without_ending3,
                r"row 2, field 'ending3': the choice is missing \(no value, or null\)",
            ),
            ({**SWAG, "ending3": None}, r"row 2, field 'ending3': the choice is missing"),
            ({**SWAG, "ending1": 7}, r"row 2, field 'ending1': holds 7 \(int\), not text"),
            ({**SWAG, "label": 4}, r"row 2, field 'label': label 4 is out of range"),
        )
    ):
        folder = _rows(tmp_path / f"d{n}", [SWAG, row], [SWAG])
        with pytest.raises(DataError, match=message) as err:
            _build(folder, tmp_path / "c")
        assert "\n" not in str(err.value)
    # A CSV's blank cell is read as no value: missing too.
    import pandas as pd

    folder = tmp_path / "csv"
    folder.mkdir()
    pd.DataFrame([SWAG, {**SWAG, "ending2": ""}]).to_csv(folder / "train.csv", index=False)
    pd.DataFrame([SWAG]).to_csv(folder / "val.csv", index=False)
    with pytest.raises(DataError, match=r"row 2, field 'ending2': the choice is missing"):
        _build(folder, tmp_path / "c")


def test_a_too_short_max_seq_length_is_refused():
    with pytest.raises(ConfigError, match=r"task\.max_seq_length=4"):
        make_task("multiple_choice", max_seq_length=4)


# ----------------------------------------------------------------------------- end to end

QUIET = ("logger=none", "trainer.progress_bar=false")


def _smoke(run: Path, cache: Path, *overrides: str, launcher=run_train):
    return launcher(
        "recipe=bert_swag",
        "debug=smoke",
        *QUIET,
        f"data.cache_dir={cache}",
        f"output_dir={run}",
        *overrides,
    )


@pytest.mark.slow
def test_smoke_learns_reloads_evaluates_and_predicts(tmp_path, cache_dir):
    """debug=smoke as shipped: accuracy clearly above its untrained value and chance; final/
    loads with AutoModelForMultipleChoice and scores the same in mode=eval; mode=predict writes
    every row's choice and probabilities, as transformers computes them."""
    run = tmp_path / "run"
    _smoke(run, cache_dir, "trainer.max_steps=100")
    evals = [r for r in read_metrics(run) if "eval/accuracy" in r]
    first, last = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert evals[0]["step"] == 0
    assert last >= 0.29 and last >= first + 0.04, (first, last)
    model = AutoModelForMultipleChoice.from_pretrained(run / "final").eval()
    assert model.classifier.out_features == 1

    out = tmp_path / "eval"
    _smoke(out, cache_dir, "mode=eval", f"model.name_or_path={run}/final")
    scores = [r for r in read_metrics(out) if "eval/accuracy" in r][-1]
    kept = json.loads((run / "results.json").read_text())["metrics"]["eval/accuracy"]
    assert kept == max(r["eval/accuracy"] for r in evals[1:])  # load_best_model_at_end
    assert scores["eval/accuracy"] == pytest.approx(kept, abs=1e-9)

    rows = [json.loads(x) for x in (HELLASWAG / "dev.jsonl").read_text().splitlines()[:12]]
    predict_file = tmp_path / "rows.jsonl"
    predict_file.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "label"}) + "\n" for r in rows)
    )
    pred = tmp_path / "pred"
    _smoke(pred, cache_dir, "mode=predict", f"model.name_or_path={run}/final",
           f"data.predict_file={predict_file}")  # fmt: skip
    got = [json.loads(x) for x in (pred / "predictions.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    for row, answer in zip(rows, got, strict=True):
        endings = [row[f"ending{i}"] for i in range(4)]
        enc = tokenizer([row["sent1"]] * 4, [f"{row['sent2']} {e}" for e in endings],
                        truncation=True, max_length=96, padding=True, return_tensors="pt")  # fmt: skip
        with torch.no_grad():
            probs = model(**{k: v[None] for k, v in enc.items()}).logits.softmax(-1)[0]
        assert answer["id"] == row["ind"]
        assert answer["probabilities"] == pytest.approx(probs.tolist(), abs=1e-4)
        assert answer["label"] == int(probs.argmax())
        assert answer["choice"] == endings[answer["label"]]
        assert math.isclose(sum(answer["probabilities"]), 1.0, abs_tol=1e-5)


@pytest.mark.slow
def test_two_processes_and_resume_train_as_one(tmp_path, cache_dir):
    """Rows of 2 to 5 choices (padded, masked): two gloo processes log the losses of one; a run
    stopped at its checkpoint and resumed logs the uninterrupted run's losses."""
    rows = [json.loads(x) for x in (ASSETS / "multiple-choice/squad/train.jsonl")
            .read_text().splitlines()[:96]]  # fmt: skip
    data = _rows(tmp_path / "data", rows, rows[:16])
    common = (f"data.path={data}", "trainer.max_steps=6", "trainer.log_every_n_steps=1",
              "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2",
              "trainer.eval_at_start=false", "trainer.eval_every_n_steps=0",
              "trainer.load_best_model_at_end=false", "trainer.save_final_model=false", "task.max_seq_length=48",
              # Dropout draws per process: without it one process and two compute alike.
              "+model.config_overrides.hidden_dropout_prob=0.0",
              "+model.config_overrides.attention_probs_dropout_prob=0.0")  # fmt: skip
    one = tmp_path / "one"
    _smoke(one, cache_dir, *common, "trainer.save_every_n_steps=3")
    two = tmp_path / "two"
    proc = _smoke(two, cache_dir, *common, "trainer.per_device_train_batch_size=2",
                  launcher=run_torchrun)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    def losses(run: Path) -> list[float]:
        return [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]

    assert len(losses(one)) == 6
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    resumed = tmp_path / "resumed"
    _smoke(resumed, cache_dir, *common, f"resume={one}/checkpoints/step-00000003")
    assert losses(resumed)[-3:] == pytest.approx(losses(one)[-3:], abs=1e-6)


@pytest.mark.slow
def test_lora_trains_the_head_in_full_and_stops_early_on_accuracy(tmp_path, cache_dir):
    run = tmp_path / "lora"
    _smoke(run, cache_dir, "peft=lora", "trainer.max_steps=40", "trainer.eval_every_n_steps=20",
           "trainer.early_stopping_patience=1", "data.max_train_examples=640",
           "data.max_eval_examples=64", "task.max_seq_length=64")  # fmt: skip
    log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
    evals = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert evals, log[-2000:]
    model = AutoModelForMultipleChoice.from_pretrained(run / "final")
    base = AutoModelForMultipleChoice.from_pretrained(TINY_BERT, ignore_mismatched_sizes=True)
    # The new head trained in full (it is not the fresh one's shape-only copy).
    assert model.classifier.weight.shape == (1, base.config.hidden_size)
    assert not torch.equal(model.classifier.weight, base.classifier.weight[:1])
