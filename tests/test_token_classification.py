"""Token classification (task=token_classification): reading CoNLL / datasets / JSON lines data,
word labels on sub-words, windows, seqeval's scores over words, refusals, and (slow) the recipe
end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from conftest import FP32, ROOT, make_task, read_metrics, run_cpu_launch, run_train
from datasets import ClassLabel, Dataset, Features, Sequence, Value
from seqeval import metrics as seqeval
from seqeval import scheme as seqeval_schemes
from torch.utils.data import DataLoader
from transformers import AutoModelForTokenClassification, AutoTokenizer, BertConfig

from recipes.config import ConfigError, DataConfig, GenerationConfig
from recipes.data import DataError, read_conll
from recipes.tasks import token_classification as ner
from recipes.tasks.base import RunContext

SMOKE_GAIN = 0.05  # debug=smoke must raise F1 at least this much
WNUT = ROOT / "recipes" / "assets" / "wnut17"
TINY_BERT = ROOT / "recipes" / "assets" / "tiny-bert"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_BERT)


@pytest.fixture(scope="module")
def wnut_train() -> Dataset:
    return read_conll(WNUT / "train.conll")


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------- reading


def test_the_bundled_wnut17_reads_as_published(wnut_train):
    # The WNUT-17 paper's counts; the train file ends half its sentences with a tab-only line.
    assert len(wnut_train) == 3394
    assert sum(len(t) for t in wnut_train["tokens"]) == 62730
    assert wnut_train[2]["tokens"][0] == "Pxleyes"
    assert wnut_train[2]["ner_tags"][0] == "B-corporation"
    assert wnut_train[1]["line"] == 29  # the file line of the sentence's first word
    assert len(read_conll(WNUT / "dev.conll")) == 1009
    assert len(read_conll(WNUT / "test.conll")) == 1287


def test_conll_2003_layout_docstart_and_spaces(tmp_path):
    path = _write(
        tmp_path / "train.txt",
        "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n"
        "German JJ B-NP B-MISC\n\nPeter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n",
    )
    rows = ner.read_columns(path)
    assert rows["tokens"] == [["EU", "rejects", "German"], ["Peter", "Blackburn"]]
    assert rows["ner_tags"] == [["B-ORG", "O", "B-MISC"], ["B-PER", "I-PER"]]
    assert rows["line"] == [3, 7]
    # A plain text file is not taken for a column file.
    assert ner.read_columns(_write(tmp_path / "prose.txt", "One sentence.\nAnother\n")) is None


def test_a_conll_line_without_a_tag_is_refused_naming_the_line(tmp_path):
    path = _write(tmp_path / "train.conll", "EU\tB-ORG\nrejects\tO\n\nPeter\nBlackburn\tI-PER\n")
    with pytest.raises(DataError, match=r"train\.conll line 4: 'Peter' has no tag column"):
        read_conll(path)


def test_datasets_layout_with_class_label_ids(tmp_path, tokenizer):
    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    features = Features(
        {"tokens": Sequence(Value("string")), "ner_tags": Sequence(ClassLabel(names=names))}
    )
    rows = {"tokens": [["Peter", "Blackburn", "visits", "Paris"]], "ner_tags": [[1, 2, 0, 3]]}
    for split in ("train", "validation"):
        Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds" / split))
    (tmp_path / "ds" / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    data = make_task("token_classification").build_data(
        _cfg(tmp_path, path=str(tmp_path / "ds")), tokenizer
    )
    assert data.label_names == names  # the features' order, not sorted
    assert data.tags == [["B-PER", "I-PER", "O", "B-LOC"]]


def test_json_lines_with_string_tags_and_named_columns(tmp_path, tokenizer):
    rows = [{"words": ["Paris", "is", "nice"], "labels": ["B-LOC", "O", "O"]}] * 3
    for name in ("train.jsonl", "dev.jsonl"):
        _write(tmp_path / name, "".join(json.dumps(r) + "\n" for r in rows))
    task = make_task("token_classification")
    data = task.build_data(_cfg(tmp_path, path=str(tmp_path)), tokenizer)
    # Sorted, as run_ner, with I-LOC: the partner of a type seen in training (a training slice
    # without it still reads evaluation data that has it).
    assert data.label_names == ["B-LOC", "I-LOC", "O"]
    assert task.model_kwargs(data)["id2label"] == {0: "B-LOC", 1: "I-LOC", 2: "O"}
    # Explicit columns, and ids read through task.label_list.
    ids = [{"w": ["Paris"], "t": [1]}]
    for name in ("train.jsonl", "dev.jsonl"):
        _write(tmp_path / "ids" / name, json.dumps(ids[0]) + "\n")
    listed = make_task("token_classification", label_list=["O", "B-LOC"])
    cfg = _cfg(tmp_path, path=str(tmp_path / "ids"), text_column="w", label_column="t")
    assert listed.build_data(cfg, tokenizer).tags == [["B-LOC"]]


# ------------------------------------------------------------------------------- alignment


def _cells(text: str) -> list[str]:
    return text.split()


# Sentence 0 of WNUT-17 train through the tiny BERT (lower-cased WordPiece), position by
# position: "-" is -100. Checked by hand against the sub-words.
SUBWORDS = _cells(
    "[CLS] [UNK] paul ##w ##al ##k it ' s the view from where i ' m living for two weeks . "
    "empire state building = e ##s ##b . pre ##t ##ty bad storm here last even ##ing . [SEP]"
)
FIRST_ONLY = _cells(
    "- O - - - - O O - O O O O O O - O O O O O B-location I-location I-location O B-location "
    "- - O O - - O O O O O - O -"
)
ALL_TOKENS = _cells(
    "- O O O O O O O O O O O O O O O O O O O O B-location I-location I-location O B-location "
    "I-location I-location O O O O O O O O O O O -"
)


@pytest.mark.parametrize("all_tokens", [False, True])
def test_word_labels_on_sub_words_of_a_real_row(tokenizer, wnut_train, all_tokens):
    row = wnut_train[0]
    names = sorted({t for tags in wnut_train["ner_tags"] for t in tags})
    encoded = tokenizer(row["tokens"], is_split_into_words=True)
    assert tokenizer.convert_ids_to_tokens(encoded["input_ids"]) == SUBWORDS
    word_ids = encoded.word_ids()
    tags = [names.index(t) for t in row["ner_tags"]]
    (window,) = ner.windows(word_ids, 128, 32, True, len(tags))
    b_to_i = ner.inside_labels(names) if all_tokens else None
    labels, owned = ner.window_labels(window, word_ids, tags, b_to_i)
    assert [names[i] if i >= 0 else "-" for i in labels] == (
        ALL_TOKENS if all_tokens else FIRST_ONLY
    )
    assert owned == list(range(len(tags)))


def test_byte_level_words_get_a_leading_space_as_run_ner_gives_them(tmp_path):
    """GPT-2 / RoBERTa-style tokenizers read each word as the start of a text unless told
    otherwise (run_ner loads them with add_prefix_space=True)."""
    gpt2 = AutoTokenizer.from_pretrained(ROOT / "recipes" / "assets" / "tiny-gpt2")
    task = make_task("token_classification")
    row = {"tokens": [["Hello", "world"]], "tags": [[0, 0]], "row": [0]}
    ids = task._features(row, gpt2, None)["input_ids"][0]
    assert gpt2.convert_ids_to_tokens(ids)[-1] == "Ġworld"
    assert ids == gpt2(" Hello world")["input_ids"]


def test_b_becomes_i_only_where_i_exists():
    assert ner.inside_labels(["B-PER", "I-PER", "B-MISC", "O"]) == [1, 1, 2, 3]


def test_long_sentences_are_windowed_each_word_once(tokenizer, wnut_train):
    row = wnut_train[0]
    word_ids = tokenizer(row["tokens"], is_split_into_words=True).word_ids()
    spans = ner.windows(word_ids, 16, 4, True, len(row["tokens"]))
    assert len(spans) > 2 and all(len(w.positions) <= 16 for w in spans)
    owned = [w for s in spans for w in sorted(s.owned)]
    assert owned == list(range(len(row["tokens"])))  # every word once, in order
    assert spans[0].dropped == 0
    # A word is owned where it sits farthest from a window edge: never on an edge between two.
    for s in spans[1:]:
        first = s.positions[1]
        if word_ids[first] in s.owned:
            assert word_ids[first - 1] is None or word_ids[first - 1] != word_ids[first]
    cut = ner.windows(word_ids, 16, 4, False, len(row["tokens"]))
    assert len(cut) == 1 and cut[0].dropped == len(row["tokens"]) - len(cut[0].owned) > 0


class _ByToken(torch.nn.Module):
    """A stand-in token classifier whose logits are a fixed function of each token id."""

    def __init__(self, vocab: int, labels: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, labels)
        torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.table(input_ids))


@pytest.mark.parametrize("length", [128, 12])
def test_scores_over_words_equal_seqeval_on_real_rows(tmp_path, tokenizer, length):
    """Word predictions read back from (windowed) features and scored: the same as seqeval on
    each word's first sub-word's prediction, computed here without the task's features."""
    task = make_task("token_classification", max_seq_length=length, stride=3)
    cfg = _cfg(tmp_path, path=str(WNUT), max_train_examples=200, max_eval_examples=150)
    data = task.build_data(cfg, tokenizer)
    model = _ByToken(tokenizer.vocab_size, len(data.label_names))
    loader = DataLoader(data.eval, batch_size=7, collate_fn=data.eval_collator)
    run = RunContext(Accelerator(cpu=True), tokenizer, None, GenerationConfig())
    scores = task.evaluate(model, loader, data, run)
    expected = []
    for words in data.words:
        row = []
        for word in words:
            ids = tokenizer(word, add_special_tokens=False)["input_ids"]
            row.append(data.label_names[int(model.table.weight[ids[0]].argmax())] if ids else "O")
        expected.append(row)
    assert scores["f1"] == pytest.approx(seqeval.f1_score(data.tags, expected))
    assert scores["precision"] == pytest.approx(seqeval.precision_score(data.tags, expected))
    assert scores["accuracy"] == pytest.approx(seqeval.accuracy_score(data.tags, expected))
    report = seqeval.classification_report(data.tags, expected, output_dict=True)
    assert scores["f1_person"] == pytest.approx(report["person"]["f1-score"])


def _iobes(tags: list[str]) -> list[str]:
    out = []
    for i, tag in enumerate(tags):
        after = tags[i + 1] if i + 1 < len(tags) else "O"
        ends = not after.startswith("I-")
        if tag.startswith("B-"):
            out.append(("S-" if ends else "B-") + tag[2:])
        elif tag.startswith("I-"):
            out.append(("E-" if ends else "I-") + tag[2:])
        else:
            out.append(tag)
    return out


def test_strict_schemes_score_as_seqeval_strict(wnut_train):
    gold = wnut_train["ner_tags"][:400]
    # Predictions that break IOB2 (an entity's B- turned into I-): lenient reading keeps them.
    pred = [
        [("I-" + t[2:]) if t.startswith("B-") and n % 3 == 0 else t for t in row]
        for n, row in enumerate(gold)
    ]
    lenient = ner.ner_scores(gold, pred, None)
    strict = ner.ner_scores(gold, pred, "IOB2")
    assert lenient["f1"] == pytest.approx(seqeval.f1_score(gold, pred))
    assert strict["f1"] == pytest.approx(
        seqeval.f1_score(gold, pred, mode="strict", scheme=seqeval_schemes.IOB2)
    )
    assert strict["f1"] < lenient["f1"]
    gold_e, pred_e = [_iobes(r) for r in gold], [_iobes(r) for r in pred]
    assert ner.ner_scores(gold_e, pred_e, "IOBES")["f1"] == pytest.approx(
        seqeval.f1_score(gold_e, pred_e, mode="strict", scheme=seqeval_schemes.IOBES)
    )
    # The entities a prediction file lists are the metric's.
    assert ner.entities(["B-person", "I-person", "O", "I-location"], None) == [
        ("person", 0, 2),
        ("location", 3, 4),
    ]
    assert ner.entities(["B-person", "I-person", "O", "I-location"], "IOB2") == [("person", 0, 2)]


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ({"long_sentences": "wrap"}, "task.long_sentences"),
        ({"scheme": "BIO"}, "task.scheme"),
        ({"stride": 100}, "task.stride"),
        ({"max_seq_length": 2}, "task.max_seq_length"),
        ({"label_list": ["O", "O"]}, "task.label_list"),
        ({"label_list": ["O", "X-PER"], "scheme": "IOB2"}, "task.label_list"),
    ],
)
def test_bad_settings_name_the_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make_task("token_classification", **setting)


def _folder(tmp_path: Path, train: str, dev: str, suffix: str = ".conll") -> DataConfig:
    _write(tmp_path / "data" / f"train{suffix}", train)
    _write(tmp_path / "data" / f"dev{suffix}", dev)
    return _cfg(tmp_path, path=str(tmp_path / "data"))


def test_refusals_name_the_file_line_and_field(tmp_path, tokenizer):
    good = "Peter\tB-PER\nBlackburn\tI-PER\nin\tO\nParis\tB-LOC\n"
    task = make_task("token_classification")
    # A tag of the evaluation split that training never saw.
    cfg = _folder(tmp_path / "a", good, "Anna\tB-PER\n\nBerlin\tB-CITY\n")
    with pytest.raises(DataError, match=r"dev\.conll line 3: tag 'B-CITY' .*word 'Berlin'"):
        task.build_data(cfg, tokenizer)
    # An I- tag that continues nothing, under a strict scheme (lenient: accepted).
    cfg = _folder(tmp_path / "b", good + "\nthe\tO\nParis\tI-LOC\n", good)
    strict = make_task("token_classification", scheme="IOB2")
    with pytest.raises(DataError, match=r"train\.conll line 7: tag 'I-LOC'.* does not continue"):
        strict.build_data(cfg, tokenizer)
    assert task.build_data(cfg, tokenizer).label_names == ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
    # A tag outside task.label_list.
    listed = make_task("token_classification", label_list=["O", "B-PER", "I-PER"])
    with pytest.raises(DataError, match=r"train\.conll line 4: tag 'B-LOC'"):
        listed.build_data(_folder(tmp_path / "c", good, good), tokenizer)
    # Words and tags of different lengths (JSON lines), and tag ids without names.
    row = json.dumps({"tokens": ["a", "b"], "ner_tags": ["O"]})
    cfg = _folder(tmp_path / "d", row + "\n", row + "\n", ".jsonl")
    with pytest.raises(DataError, match=r"train\.jsonl row 1: 2 words .* but 1 tags"):
        task.build_data(cfg, tokenizer)
    row = json.dumps({"tokens": ["a"], "ner_tags": [3]})
    cfg = _folder(tmp_path / "e", row + "\n", row + "\n", ".jsonl")
    with pytest.raises(DataError, match=r"tag ids.*task\.label_list"):
        task.build_data(cfg, tokenizer)


def test_predict_rows_split_text_into_words_with_offsets(tmp_path, tokenizer):
    path = _write(
        tmp_path / "rows.jsonl",
        json.dumps({"text": "@ana saw the Empire State Building, twice!"})
        + "\n"
        + json.dumps({"tokens": ["Empire", "State"]})
        + "\n",
    )
    task = make_task("token_classification")
    data = task.build_predict_data(_cfg(tmp_path, predict_file=str(path)), tokenizer)
    assert data.words[0] == ["@ana", "saw", "the", "Empire", "State", "Building", ",", "twice", "!"]
    assert data.texts[1] == "Empire State"
    entity = ner._entity("location", 3, 6, data, 0, [0.5] * 3 + [0.9, 0.8, 0.7] + [0.1] * 3)
    assert entity["text"] == "Empire State Building"
    assert (entity["start"], entity["end"]) == (13, 34)
    assert entity["score"] == pytest.approx(0.8)
    assert ner._entity("x", 1, 2, data, 1, [0.1, 0.2])["start"] == 7


# ------------------------------------------------------------------------------- end to end

# The tiny BERT without dropout on a few WNUT-17 rows: cheap runs whose losses must match exactly.
TINY = (
    "recipe=bert_ner",
    "debug=smoke",
    "model=tiny_bert",
    "model.attention_dropout=0.0",
    "+model.config_overrides.hidden_dropout_prob=0.0",
    "logger=none",
    "data.max_train_examples=96",
    "data.max_eval_examples=40",
    "task.max_seq_length=24",  # windows on most rows
    "task.stride=8",
    "trainer.log_every_n_steps=1",
    "trainer.eval_at_start=false",
    "trainer.progress_bar=false",
)


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["train/loss"]) for m in read_metrics(run) if "train/loss" in m]


def _last_eval(run: Path) -> dict:
    return [m for m in read_metrics(run) if "eval/f1" in m][-1]


@pytest.mark.slow
def test_one_process_two_processes_and_a_resumed_run_agree(tmp_path, cache_dir):
    """Per-token losses summed over the whole step: 16 rows on one process and 8 + 8 on two log
    the same losses and evaluation (gathered across processes, windows put back together); a
    run resumed from step 2 repeats steps 3 and 4 exactly."""
    common = (*TINY, FP32, f"data.cache_dir={cache_dir}", "trainer.max_steps=4")
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    single = run_train(
        *common, "trainer.per_device_train_batch_size=16", "trainer.save_every_n_steps=2",
        "trainer.save_final_model=false", f"output_dir={one}",
    )  # fmt: skip
    assert "windows" in single.stderr  # long rows were windowed
    # 16 rows on one device, 8 on each of two processes.
    proc = run_cpu_launch(
        ROOT / "train.py", *common, "trainer.per_device_train_batch_size=8",
        "trainer.save_final_model=false", f"output_dir={two}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ones, twos = _losses(one), _losses(two)
    assert [s for s, _ in ones] == [s for s, _ in twos] == [1, 2, 3, 4]
    assert [v for _, v in ones] == pytest.approx([v for _, v in twos], rel=1e-5)
    assert ones[-1][1] < ones[0][1]
    a, b = _last_eval(one), _last_eval(two)
    assert a["eval/loss"] == pytest.approx(b["eval/loss"], rel=1e-5)
    assert a["eval/accuracy"] == b["eval/accuracy"] and a["eval/f1"] == b["eval/f1"]
    run_train(
        *common, "trainer.per_device_train_batch_size=16",
        f"resume={one / 'checkpoints' / 'step-00000002'}",
        "trainer.save_final_model=false", f"output_dir={resumed}",
    )  # fmt: skip
    assert _losses(resumed)[-2:] == _losses(one)[-2:]


@pytest.mark.slow
def test_lora_trains_the_classifier_whole_and_stops_early_on_f1(tmp_path, cache_dir):
    run = tmp_path / "lora"
    done = run_train(
        *TINY, f"data.cache_dir={cache_dir}", "peft=lora", "optimizer.lr=1e-3",
        "trainer.max_steps=40", "trainer.eval_every_n_steps=2",
        "trainer.early_stopping_patience=1", f"output_dir={run}",
    )  # fmt: skip
    assert re.search(r"trained in full: .*classifier", done.stderr)
    results = json.loads((run / "results.json").read_text())
    assert results["main_metric"] == "eval/f1" and results["greater_is_better"]
    assert results["steps"] < 40 and "early stopping at step" in done.stderr
    model = AutoModelForTokenClassification.from_pretrained(run / "final")
    assert model.config.id2label[0] == "B-corporation" and model.config.num_labels == 13


@pytest.mark.slow
def test_smoke_learns_and_its_final_model_evaluates_and_predicts(tmp_path, cache_dir):
    smoke = ("recipe=bert_ner", "debug=smoke", "logger=none", f"data.cache_dir={cache_dir}")
    run = tmp_path / "smoke"
    run_train(*smoke, "trainer.progress_bar=false", f"output_dir={run}")
    evals = [m for m in read_metrics(run) if "eval/f1" in m]
    assert evals[0]["step"] == 0 and evals[0]["eval/f1"] < 0.03
    assert evals[-1]["eval/f1"] > evals[0]["eval/f1"] + SMOKE_GAIN
    assert {"eval/precision", "eval/recall", "eval/accuracy", "eval/f1_person"} <= set(evals[-1])
    model = AutoModelForTokenClassification.from_pretrained(run / "final")
    names = sorted({t for tags in read_conll(WNUT / "train.conll")["ner_tags"] for t in tags})
    assert [model.config.id2label[i] for i in range(len(names))] == names

    scored = tmp_path / "eval"
    final = f"model.name_or_path={run / 'final'}"
    run_train(*smoke, "mode=eval", final, f"output_dir={scored}")
    metrics = json.loads((scored / "results.json").read_text())["metrics"]
    assert metrics["eval/f1"] == pytest.approx(evals[-1]["eval/f1"])

    dev = read_conll(WNUT / "dev.conll")
    rows = tmp_path / "rows.jsonl"
    text = " ".join(dev[0]["tokens"])
    rows.write_text(
        json.dumps({"id": "a", "text": text})
        + "\n"
        + json.dumps({"tokens": dev[1]["tokens"]})
        + "\n"
    )
    predicted = tmp_path / "predict"
    run_train(*smoke, "mode=predict", final, f"data.predict_file={rows}", f"output_dir={predicted}")
    records = [json.loads(x) for x in (predicted / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", 1]
    assert records[1]["words"] == dev[1]["tokens"]
    for record, source in zip(records, (text, " ".join(dev[1]["tokens"])), strict=True):
        assert len(record["tags"]) == len(record["words"])
        assert set(record["tags"]) <= set(names)
        for entity in record["entities"]:
            assert source[entity["start"] : entity["end"]] == entity["text"]
            assert 0 < entity["score"] <= 1 and entity["type"] in {n[2:] for n in names}


def test_a_trained_models_label_order_is_kept(tmp_path, tokenizer):
    """Scoring or training further a model that names the data's labels in another order (a
    final/ trained with task.label_list) keeps the model's order, as run_ner does: its head's
    rows stay the labels they learnt; a task.label_list in another order is refused."""
    good = "Peter\tB-PER\nBlackburn\tI-PER\nin\tO\nParis\tB-LOC\n"
    cfg = _folder(tmp_path / "data", good, good)
    saved = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    model = tmp_path / "model"
    tokenizer.save_pretrained(model)
    BertConfig(id2label=dict(enumerate(saved))).save_pretrained(model)
    trained = AutoTokenizer.from_pretrained(model)
    assert make_task("token_classification").build_data(cfg, trained).label_names == saved
    assert make_task("token_classification").build_data(cfg, tokenizer).label_names == sorted(saved)
    listed = make_task("token_classification", label_list=sorted(saved))
    with pytest.raises(ConfigError, match=r"task\.label_list=.*with the labels \['O', 'B-PER'"):
        listed.build_data(cfg, trained)
    # Data without one of the model's types (a rare one missing) keeps the model's labels too.
    more = tmp_path / "more"
    tokenizer.save_pretrained(more)
    BertConfig(id2label=dict(enumerate([*saved, "B-ORG", "I-ORG"]))).save_pretrained(more)
    wider = AutoTokenizer.from_pretrained(more)
    assert make_task("token_classification").build_data(cfg, wider).label_names == [
        *saved,
        "B-ORG",
        "I-ORG",
    ]


def test_tag_ids_are_read_by_their_own_label_names(tmp_path, tokenizer):
    """A data set whose ClassLabel names the labels in another order than the model's (the hub's
    wnut_17, O first, scored with a final/ trained on the CoNLL files, labels sorted): each id is
    read as its own name, then given the model's id; the gold tags are not permuted."""
    from datasets import DatasetDict

    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    features = Features(
        {"tokens": Sequence(Value("string")), "ner_tags": Sequence(ClassLabel(names=names))}
    )
    rows = {"tokens": [["Peter", "Blackburn", "in", "Paris"]], "ner_tags": [[1, 2, 0, 3]]}
    split = Dataset.from_dict(rows, features=features)
    DatasetDict({"train": split, "validation": split}).save_to_disk(tmp_path / "data")
    model = tmp_path / "model"
    tokenizer.save_pretrained(model)
    BertConfig(id2label=dict(enumerate(sorted(names)))).save_pretrained(model)
    data = make_task("token_classification").build_data(
        _cfg(tmp_path, path=str(tmp_path / "data")), AutoTokenizer.from_pretrained(model)
    )
    assert data.label_names == sorted(names)
    assert data.tags == [["B-PER", "I-PER", "O", "B-LOC"]]
