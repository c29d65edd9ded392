"""task=seq2seq: columns, prefix, dotted fields, SQuAD rows, label padding, refusals, the
decoding written into the model's generation config; and (slow) the recipes end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, make_task, read_metrics, run_torchrun, run_train
from hydra import compose, initialize_config_dir
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, T5Config, T5ForConditionalGeneration

from recipes.config import (
    ASSETS,
    ConfigError,
    DataConfig,
    GenerationConfig,
    register_resolvers,
    validate,
)
from recipes.data import DataError
from recipes.modes import build_task
from recipes.tasks.seq2seq import IGNORE_INDEX, Seq2SeqCollator

TINY_T5 = ASSETS / "tiny-t5"
PREFIX = "translate English to German: "


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_T5)


def _task(**overrides):
    return make_task("seq2seq", **overrides)


def _write(folder: Path, name: str, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


PAIRS = [
    {"translation": {"en": "I like tea.", "de": "Ich mag Tee."}},
    {"translation": {"en": "Tom is here now.", "de": "Tom ist jetzt hier."}},
    {"translation": {"en": "Go.", "de": "Geh."}},
]


def _pairs_data(tmp_path: Path, train=PAIRS, dev=PAIRS, **keys) -> DataConfig:
    _write(tmp_path / "data", "train.jsonl", train)
    _write(tmp_path / "data", "dev.jsonl", dev)
    columns = {"source_column": "translation.en", "target_column": "translation.de"}
    return DataConfig(
        path=str(tmp_path / "data"),
        source_prefix=PREFIX,
        cache_dir=str(tmp_path / "cache"),
        **{**columns, **keys},
    )


def test_dotted_columns_prefix_and_lengths(tmp_path, tokenizer):
    task = _task(metric="bleu", max_source_length=12, max_target_length=4)
    data = task.build_data(_pairs_data(tmp_path), tokenizer)
    # Train targets are cut at max_target_length with the end of sequence kept.
    for row, pair in zip(data.train, PAIRS, strict=True):
        assert len(row["labels"]) <= 4 and row["labels"][-1] == tokenizer.eos_token_id
        source = tokenizer(PREFIX + pair["translation"]["en"], max_length=12, truncation=True)
        assert row["input_ids"] == source["input_ids"] and len(row["input_ids"]) <= 12
        full = tokenizer(text_target=pair["translation"]["de"])["input_ids"]
        assert row["labels"][:-1] == full[: len(row["labels"]) - 1]
    # Evaluation rows: longest source first, each with its number, references by number.
    lengths = [len(ids) for ids in data.eval["input_ids"]]
    assert lengths == sorted(lengths, reverse=True)
    assert sorted(data.eval["row"]) == [0, 1, 2]
    assert data.references == [[p["translation"]["de"]] for p in PAIRS]
    whole = tokenizer(PREFIX + "Go.")["input_ids"]
    go = data.eval[data.eval["row"].index(2)]
    assert go["input_ids"] == whole


def test_settings_leave_decoding_and_metric_out_of_the_cache_key():
    a, b = _task(metric="bleu"), _task(metric="rouge")
    assert a.features_key() == b.features_key()
    assert "generation" not in a.features_key()
    assert _task(max_target_length=9).features_key() != a.features_key()


def test_a_list_target_trains_on_the_first_and_scores_against_all(tmp_path, tokenizer):
    rows = [
        {"source": "An abstract.", "targets": ["First TLDR.", "Second one."]},
        {"source": "Another abstract.", "targets": ["Only TLDR."]},
    ]
    _write(tmp_path / "d", "train.jsonl", rows)
    _write(tmp_path / "d", "dev.jsonl", rows)
    cfg = DataConfig(
        path=str(tmp_path / "d"),
        source_column="source",
        target_column="targets",
        source_prefix="summarize: ",
        cache_dir=str(tmp_path / "c"),
    )
    data = _task().build_data(cfg, tokenizer)
    assert tokenizer.decode(data.train[0]["labels"], skip_special_tokens=True) == "First TLDR."
    assert data.references == [["First TLDR.", "Second one."], ["Only TLDR."]]
    assert _task().score_texts(["First TLDR.", "Only TLDR."], data.references)["rougeL"] == 100.0


def test_squad_rows_become_question_context_and_first_answer(tmp_path, tokenizer):
    squad = ASSETS / "squad" / "v1" / "dev.json"
    cfg = DataConfig(
        path=str(squad), eval_file=str(squad), cache_dir=str(tmp_path), max_eval_examples=5
    )
    task = _task(metric="squad", max_source_length=512, max_target_length=30)
    data = task.build_data(cfg, tokenizer)
    article = json.loads(squad.read_text())["data"][0]["paragraphs"][0]
    qa = article["qas"][0]
    source = tokenizer.decode(data.train[0]["input_ids"], skip_special_tokens=True)
    assert source.startswith(f"question: {qa['question'].strip()[:20]}")
    assert "context: " + article["context"][:30] in source
    target = tokenizer.decode(data.train[0]["labels"], skip_special_tokens=True)
    assert target == tokenizer.decode(tokenizer(qa["answers"][0]["text"])["input_ids"], True)
    assert data.references[0] == [a["text"] for a in qa["answers"]]
    assert data.row_ids[0] == qa["id"]
    # EM / F1 take the best of every answer.
    scores = task.score_texts([qa["answers"][-1]["text"], "nothing"], data.references[:2])
    assert scores == {"exact_match": 50.0, "f1": 50.0}


def test_labels_pad_with_minus_100_and_the_model_builds_decoder_inputs(tokenizer):
    model = AutoModelForSeq2SeqLM.from_pretrained(TINY_T5).eval()
    rows = [
        {"input_ids": tokenizer("summarize: a b c d")["input_ids"], "labels": [71, 1]},
        {"input_ids": tokenizer("x")["input_ids"], "labels": [5, 6, 7, 1]},
    ]
    batch = Seq2SeqCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)(rows)
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["labels"].shape == (2, 8)
    assert batch["labels"][0].tolist() == [71, 1] + [IGNORE_INDEX] * 6
    assert batch["input_ids"][1, len(rows[1]["input_ids"]) :].eq(tokenizer.pad_token_id).all()
    assert batch["attention_mask"].sum(1).tolist() == [len(r["input_ids"]) for r in rows]
    task = _task()
    with torch.no_grad():
        summed = task.loss(model, batch)
        # Row by row, unpadded: the same summed loss over the same 6 target tokens.
        alone = [task.loss(model, Seq2SeqCollator(0)([r])) for r in rows]
    assert summed.count.item() == 6
    assert summed.total.item() == pytest.approx(sum(a.total.item() for a in alone), rel=1e-5)
    # decoder_input_ids are the labels shifted right behind the decoder start token (pad 0).
    shifted = model._shift_right(batch["labels"])
    assert shifted[0, :3].tolist() == [0, 71, 1]


@pytest.mark.parametrize(
    ("metric", "main", "keys"),
    [
        ("rouge", "rougeL", {"rouge1", "rouge2", "rougeL", "rougeLsum"}),
        ("bleu", "bleu", {"bleu", "chrf"}),
        ("squad", "f1", {"exact_match", "f1"}),
    ],
)
def test_each_metric_ranks_by_a_score_it_reports(metric, main, keys):
    task = _task(metric=metric)
    perfect = task.score_texts(["Tom is here now."], [["Tom is here now."]])
    wrong = task.score_texts(["Nothing alike at all."], [["Tom is here now."]])
    assert set(perfect) == keys and task.main_metric == main and task.greater_is_better
    assert perfect[main] == pytest.approx(100.0) and wrong[main] < 50.0


def test_generation_settings_reach_the_models_generation_config():
    model = AutoModelForSeq2SeqLM.from_pretrained(TINY_T5)
    task = _task(max_target_length=20, eval_max_target_length=40)
    task._set_generation(
        model, GenerationConfig(num_beams=3, length_penalty=0.6, max_new_tokens=None)
    )
    config = model.generation_config
    assert (config.num_beams, config.length_penalty, config.max_new_tokens) == (3, 0.6, 40)
    assert config.decoder_start_token_id == 0 and config.do_sample is False
    _task()._set_generation(model, GenerationConfig(max_new_tokens=7, num_beams=1))
    assert (model.generation_config.max_new_tokens, model.generation_config.num_beams) == (7, 1)


def test_generation_comes_from_the_runs_generation_keys():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "output_dir=/tmp/unused",
                "recipe=t5_translation",
                "generation.num_beams=4",
                "generation.length_penalty=0.8",
            ],
        )
    register_resolvers()
    settings = validate(cfg)
    task = build_task(settings.task)
    assert (settings.generation.num_beams, settings.generation.length_penalty) == (4, 0.8)
    assert not hasattr(settings.task, "generation")
    assert task.main_metric == "bleu" and cfg.data.source_column == "translation.en"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"metric": "meteor"}, "task.metric"),
        ({"max_source_length": 1}, "task.max_source_length"),
        ({"max_target_length": 0}, "task.max_target_length"),
        ({"eval_max_target_length": 1}, "task.eval_max_target_length"),
    ],
)
def test_bad_task_settings_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        _task(**overrides)


@pytest.mark.parametrize(
    ("row", "where"),
    [
        ({"translation": {"en": "Hi."}}, "row 2: column 'translation' has no field 'de'"),
        # No row is an object: said once, not row by row.
        (
            {"translation": "Hi."},
            "train data: no row has field 'en' in column 'translation' "
            "(2 rows; data.source_column=translation.en): it holds str, not objects",
        ),
        ({"translation": {"en": "", "de": "Hallo."}}, "row 2: data.source_column "),
        ({"translation": {"en": "Hi.", "de": "   "}}, "row 2: data.target_column "),
        ({"translation": {"en": 5, "de": "Hallo."}}, "row 2: data.source_column"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_field(tmp_path, tokenizer, row, where):
    train = [PAIRS[0], row, PAIRS[1]]
    if isinstance(row["translation"], str):  # a column of one type: every row a text
        train = [{"translation": "x"}, row]
    cfg = _pairs_data(tmp_path, train=train)
    with pytest.raises(DataError) as err:
        _task(metric="bleu").build_data(cfg, tokenizer)
    message = str(err.value)
    assert str(tmp_path / "data" / "train.jsonl") in message
    assert where.split(":")[0] in message and where.split(": ", 1)[1] in message


def test_a_null_source_is_called_missing(tmp_path, tokenizer):
    """Not "holds null None": a null (or absent) text is missing, an empty one is empty."""
    rows = [{"document": "A text.", "summary": "Short."}, {"summary": "Short."}]
    cfg = _pairs_data(
        tmp_path, train=rows, dev=rows[:1], source_column="document", target_column="summary"
    )
    with pytest.raises(DataError) as err:
        _task(metric="bleu").build_data(cfg, tokenizer)
    message = str(err.value)
    assert "\n" not in message and "None" not in message
    assert "row 2: data.source_column 'document' is missing (no value, or null)" in message


def test_a_field_no_row_has_is_refused_once_with_the_fields_there_are(tmp_path, tokenizer):
    """A misnamed field is said once (with the row count and the fields the rows have), not
    row by row (a column of plain texts: test_bad_rows_are_refused_naming_file_row_and_field)."""
    rows = [*PAIRS[:3]]
    cfg = _pairs_data(tmp_path, train=rows)
    cfg.target_column = "translation.fr"
    with pytest.raises(DataError) as err:
        _task(metric="bleu").build_data(cfg, tokenizer)
    message = str(err.value)
    assert "\n" not in message and "row 1" not in message and "row 2" not in message
    assert (
        "no row has field 'fr' in column 'translation' (3 rows; "
        "data.target_column=translation.fr): the rows' fields: de, en; name one with "
        "data.target_column=translation.<field>."
    ) in message


def test_a_missing_column_or_unset_key_is_refused(tmp_path, tokenizer):
    cfg = _pairs_data(tmp_path)
    cfg.target_column = "translation_de"
    with pytest.raises(DataError, match=r"no column 'translation_de' \(data.target_column="):
        _task().build_data(cfg, tokenizer)
    cfg.target_column = None
    with pytest.raises(ConfigError, match=r"data\.target_column is not set"):
        _task().build_data(cfg, tokenizer)


def test_predict_rows_need_only_the_source(tmp_path, tokenizer):
    rows = [{"id": "a", "translation": {"en": "Hello."}}, {"id": "b", "translation": {"en": "Go."}}]
    cfg = _pairs_data(tmp_path, predict_file=str(_write(tmp_path, "ask.jsonl", rows)))
    data = _task(metric="bleu").build_predict_data(cfg, tokenizer)
    assert data.row_ids == ["a", "b"] and "labels" not in data.eval.column_names
    assert data.eval[1]["input_ids"] == tokenizer(PREFIX + "Go.")["input_ids"]
    # SQuAD questions without answers or ids: numbered from 0.
    questions = [{"question": "Who?", "context": "Tom did."}]
    squad = DataConfig(predict_file=str(_write(tmp_path, "q.jsonl", questions)))
    data = _task(metric="squad").build_predict_data(squad, tokenizer)
    source = tokenizer.decode(data.eval[0]["input_ids"], skip_special_tokens=True)
    assert source == "question: Who? context: Tom did." and data.row_ids == ["0"]


def test_a_model_without_decoder_start_token_is_refused():
    config = T5Config(
        vocab_size=64, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
        decoder_start_token_id=None,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)
    model.generation_config.decoder_start_token_id = None
    with pytest.raises(ConfigError, match="decoder_start_token_id"):
        _task().check_model(model)
    config.decoder_start_token_id = 0
    _task().check_model(model)


# ------------------------------------------------------------------------------ end to end


def _short(recipe: str, cache_dir: Path, *extra: str) -> tuple[str, ...]:
    """A few steps of ``recipe`` on its smoke data with the tiny T5, short sequences, no
    dropout (debug=smoke's tiny T5 has none), every step logged."""
    return (
        f"recipe={recipe}",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        "data.max_train_examples=64",
        "data.max_eval_examples=12",
        "task.max_source_length=48",
        "task.max_target_length=12",
        "generation.max_new_tokens=6",
        "trainer.per_device_train_batch_size=8",
        "trainer.per_device_eval_batch_size=5",
        "trainer.log_every_n_steps=1",
        "trainer.eval_every_n_steps=0",
        "trainer.eval_at_start=false",
        "trainer.progress_bar=false",
        "optimizer.lr=1e-2",
        *extra,
    )


def _train_losses(run: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["train/loss"]) for m in read_metrics(run) if "train/loss" in m]


def _final_eval(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())["metrics"]


@pytest.mark.slow
def test_two_processes_train_and_score_as_one(tmp_path, cache_dir):
    common = _short("t5_summarization", cache_dir, "trainer.max_steps=3")
    single = tmp_path / "single"
    run_train(*common, f"output_dir={single}", "trainer.save_final_model=false")
    double = tmp_path / "double"
    proc = run_torchrun(
        *common,
        f"output_dir={double}",
        "trainer.per_device_train_batch_size=4",
        "trainer.save_final_model=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _train_losses(single), _train_losses(double)
    assert [s for s, _ in one] == [s for s, _ in two] == [1, 2, 3]
    assert [v for _, v in two] == pytest.approx([v for _, v in one], rel=1e-5)
    assert one[-1][1] < one[0][1]  # it learns
    scores, scores2 = _final_eval(single), _final_eval(double)
    for key in ("rouge1", "rouge2", "rougeL", "rougeLsum", "loss", "gen_len", "generate_s"):
        assert f"eval/{key}" in scores
    # The same generated texts, gathered from both processes in row order.
    for key in ("eval/rouge1", "eval/rougeL", "eval/rougeLsum", "eval/gen_len"):
        assert scores2[key] == pytest.approx(scores[key], abs=1e-6)
    assert scores2["eval/loss"] == pytest.approx(scores["eval/loss"], rel=1e-5)
    ours = (single / "eval_predictions.jsonl").read_text()
    assert (double / "eval_predictions.jsonl").read_text() == ours


@pytest.mark.slow
def test_resumed_run_repeats_it_and_final_reproduces_its_decoding(tmp_path, cache_dir):
    common = _short(
        "t5_translation",
        cache_dir,
        "trainer.max_steps=6",
        "trainer.save_every_n_steps=3",
        "trainer.keep_last_n_checkpoints=null",
        "generation.num_beams=2",
        "generation.length_penalty=0.7",
    )
    whole = tmp_path / "whole"
    run_train(*common, f"output_dir={whole}")
    resumed = tmp_path / "resumed"
    run_train(*common, f"output_dir={resumed}", f"resume={whole / 'checkpoints' / 'step-00000003'}")
    steps = [(s, v) for s, v in _train_losses(whole) if s > 3]
    assert _train_losses(resumed) == steps and len(steps) == 3
    scores = _final_eval(whole)
    assert _final_eval(resumed)["eval/bleu"] == scores["eval/bleu"]
    assert {"eval/bleu", "eval/chrf", "eval/loss", "eval/gen_len"} <= set(scores)

    # final/ decodes as the evaluation did: its generation config alone, on every eval row.
    final = whole / "final"
    saved = json.loads((final / "generation_config.json").read_text())
    assert (saved["num_beams"], saved["length_penalty"], saved["max_new_tokens"]) == (2, 0.7, 6)
    assert saved["decoder_start_token_id"] == 0
    model = AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    evaluated = [json.loads(line) for line in (whole / "eval_predictions.jsonl").open()]
    dev = [json.loads(line) for line in (ASSETS / "tatoeba-en-de" / "dev.jsonl").open()]
    for row in evaluated:
        source = PREFIX + dev[row["id"]]["translation"]["en"]
        ids = tokenizer(source, return_tensors="pt", max_length=48, truncation=True)
        with torch.no_grad():
            out = model.generate(**ids)
        assert tokenizer.decode(out[0], skip_special_tokens=True).strip() == row["generated"]

    # mode=eval scores final/ as the run's last evaluation did.
    scored = tmp_path / "scored"
    run_train(*common, f"output_dir={scored}", "mode=eval", f"model.name_or_path={final}")
    assert _final_eval(scored)["eval/bleu"] == scores["eval/bleu"]
    # mode=predict: the source column alone, answered with final/'s decoding.
    rows = [{"id": f"q{r['id']}", **dev[r["id"]]} for r in evaluated]
    for row in rows:
        del row["translation"]["de"]
    predict_file = _write(tmp_path, "ask.jsonl", rows)
    asked = tmp_path / "asked"
    run_train(
        *common,
        f"output_dir={asked}",
        "mode=predict",
        f"model.name_or_path={final}",
        f"data.predict_file={predict_file}",
        "generation.num_beams=null",  # the model's own: final/'s
        "generation.length_penalty=null",
    )
    answers = [json.loads(line) for line in (asked / "predictions.jsonl").open()]
    assert [a["id"] for a in answers] == [r["id"] for r in rows]
    assert [a["generated"] for a in answers] == [r["generated"] for r in evaluated]


@pytest.mark.slow
def test_lora_run_saves_a_merged_seq2seq_model(tmp_path, cache_dir):
    run = tmp_path / "lora"
    run_train(
        *_short("t5_squad", cache_dir, "trainer.max_steps=2", "peft=lora"),
        f"output_dir={run}",
    )
    scores = _final_eval(run)
    assert {"eval/exact_match", "eval/f1", "eval/loss"} <= set(scores)
    final = run / "final"
    model = AutoModelForSeq2SeqLM.from_pretrained(final)  # merged: no peft needed
    base = AutoModelForSeq2SeqLM.from_pretrained(TINY_T5)
    changed = [
        name
        for name, p in model.state_dict().items()
        if not torch.equal(p, base.state_dict()[name])
    ]
    # The adapted linear layers changed; embeddings and norms (not adapted) did not.
    assert changed and not [n for n in changed if "shared" in n or "norm" in n]
    assert json.loads((final / "generation_config.json").read_text())["max_new_tokens"] == 6
