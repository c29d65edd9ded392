"""``mode=predict`` on rows without labels, against what transformers computes from the same
final/: classification's probabilities, a chat model's greedy answers with its template, a causal
LM's continuations; sampled answers that do not depend on the number of processes. (QA:
tests/test_eval_mode.py, against the training run's own answers.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, run_torchrun, run_train
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

pytestmark = pytest.mark.slow

QUIET = ("logger=none", "trainer.progress_bar=false")
GLUE_DEV = ROOT / "recipes" / "assets" / "glue" / "qnli-squad" / "dev.tsv"
CHAT_DEV = ROOT / "recipes" / "assets" / "conversations" / "squad" / "dev.jsonl"


def _train(recipe: str, run: Path, cache: Path, *overrides: str) -> None:
    run_train(
        f"recipe={recipe}",
        "debug=smoke",
        *QUIET,
        f"data.cache_dir={cache}",
        f"output_dir={run}",
        "trainer.eval_at_start=false",
        *overrides,
    )


def _predict(recipe: str, run: Path, rows: Path, out: Path, *overrides: str):
    return run_train(
        f"recipe={recipe}",
        "debug=smoke",
        *QUIET,
        "mode=predict",
        f"model.name_or_path={run}/final",
        f"data.predict_file={rows}",
        f"output_dir={out}",
        *overrides,
    )


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_classification_predicts_each_rows_label_and_probabilities(tmp_path, cache_dir):
    run = tmp_path / "run"
    _train("bert_glue", run, cache_dir, "trainer.max_steps=30")
    header, *lines = GLUE_DEV.read_text().splitlines()
    assert header.split("\t")[-1] == "label"
    rows = tmp_path / "rows.tsv"  # the dev file without its labels
    rows.write_text("\n".join(line.rsplit("\t", 1)[0] for line in [header, *lines]) + "\n")
    out = tmp_path / "predicted"
    done = _predict("bert_glue", run, rows, out)
    assert "LOAD REPORT" not in done.stderr and "Some weights" not in done.stderr
    predicted = _jsonl(out / "predictions.jsonl")
    fields = [line.split("\t") for line in lines]
    assert [p["id"] for p in predicted] == [int(f[0]) for f in fields]  # GLUE's index column

    # The run's last accuracy, from the predicted labels and the dev file's.
    accuracy = sum(p["label"] == f[-1] for p, f in zip(predicted, fields, strict=True))
    results = json.loads((run / "results.json").read_text())["metrics"]
    assert accuracy / len(fields) == pytest.approx(results["eval/accuracy"], abs=1e-12)

    # Every row's probabilities, as transformers computes them from final/.
    max_length = yaml.safe_load((run / "config.yaml").read_text())["task"]["max_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    model = AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    for start in range(0, len(fields), 64):
        chunk = fields[start : start + 64]
        batch = tokenizer(
            [f[1] for f in chunk],
            [f[2] for f in chunk],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            expected = model(**batch).logits.softmax(-1)
        for p, probs in zip(predicted[start : start + 64], expected, strict=True):
            assert list(p["probabilities"]) == names
            assert list(p["probabilities"].values()) == pytest.approx(probs.tolist(), abs=1e-5)
            assert p["label"] == names[int(probs.argmax())]


def test_chat_model_answers_prompts_with_its_template(tmp_path, cache_dir):
    """Greedy answers (batched) equal the training run's own answers to its held-out prompts and
    transformers' (apply_chat_template, generate) one prompt at a time on final/; sampled
    answers are the same on one process and on two, and in batches of one, and a prompt-only
    row (TRL's layout) is answered too."""
    run = tmp_path / "run"
    _train("llama_sft", run, cache_dir, "trainer.max_steps=2", "optimizer.lr=1e-6")
    greedy = tmp_path / "greedy"
    _predict("llama_sft", run, CHAT_DEV, greedy)
    answers = _jsonl(greedy / "generations.jsonl")
    conversations = _jsonl(CHAT_DEV)
    assert len(answers) == len(conversations)
    for answer, conversation in zip(answers, conversations, strict=True):
        assert answer["messages"] == conversation["messages"][:-1]
        assert answer["reference"] == conversation["messages"][-1]["content"]
    after_training = _jsonl(run / "generations.jsonl")
    assert [a["generated"] for a in answers[: len(after_training)]] == [
        g["generated"] for g in after_training
    ]

    config = yaml.safe_load((run / "config.yaml").read_text())["task"]
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    model = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    compared = 0
    for answer in answers:
        ids = tokenizer.apply_chat_template(
            answer["messages"], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        new = config["generation_max_new_tokens"]
        if len(ids) + new > config["max_seq_length"]:
            continue  # cut to the length the model trained on: not what generate() does
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert answer["generated"] == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        compared += 1
    assert compared >= 10

    prompts = tmp_path / "prompts.jsonl"
    rows = [*conversations[:5], {"prompt": "Who wrote the plays of Shakespeare?"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sampled = ("generation.do_sample=true", "generation.temperature=1.5")
    one, two = tmp_path / "one", tmp_path / "two"
    _predict("llama_sft", run, prompts, one, *sampled)
    proc = run_torchrun(
        "recipe=llama_sft",
        "debug=smoke",
        *QUIET,
        "mode=predict",
        f"model.name_or_path={run}/final",
        f"data.predict_file={prompts}",
        f"output_dir={two}",
        *sampled,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    on_one = _jsonl(one / "generations.jsonl")
    assert on_one == _jsonl(two / "generations.jsonl")
    alone = tmp_path / "alone"  # one prompt per batch: the same draws
    _predict("llama_sft", run, prompts, alone, *sampled, "generation.batch_size=1")
    assert on_one == _jsonl(alone / "generations.jsonl")
    assert on_one[-1]["messages"] == [
        {"role": "user", "content": "Who wrote the plays of Shakespeare?"}
    ]
    assert "reference" not in on_one[-1]
    assert [a["generated"] for a in on_one[:5]] != [a["generated"] for a in answers[:5]]


def test_causal_lm_continues_each_text(tmp_path, cache_dir):
    run = tmp_path / "run"
    _train("gpt2_clm", run, cache_dir, "trainer.max_steps=2", "optimizer.lr=1e-6")
    texts = ["ROMEO:", "JULIET: What light", "First Citizen:\nBefore we proceed"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "predicted"
    _predict("gpt2_clm", run, rows, out, "generation.max_new_tokens=12")
    predicted = _jsonl(out / "generations.jsonl")
    assert [p["prompt"] for p in predicted] == texts
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    model = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    for p in predicted:
        inputs = tokenizer(p["prompt"], return_tensors="pt")
        with torch.no_grad():
            out_ids = model.generate(
                **inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        expected = tokenizer.decode(
            out_ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
        assert p["generated"] == expected
    assert any(p["generated"].strip() for p in predicted)


NER_DEV = ROOT / "recipes" / "assets" / "wnut17" / "smoke" / "dev.conll"
TATOEBA_DEV = ROOT / "recipes" / "assets" / "tatoeba-en-de" / "dev.jsonl"


def test_ner_predict_reads_the_runs_scheme_from_final(tmp_path, cache_dir):
    """A model trained with task.scheme=IOB2 lists entities by IOB2's strict rules in predict,
    though the predict command does not name the scheme (final/recipe.json carries it); named
    on the command line, the command line wins and the difference is said."""
    from recipes.data import read_conll
    from recipes.tasks.token_classification import entities

    run = tmp_path / "run"
    _train("bert_ner", run, cache_dir, "trainer.max_steps=6", "task.scheme=IOB2")
    assert json.loads((run / "final" / "recipe.json").read_text())["task"]["scheme"] == "IOB2"
    sentences = read_conll(NER_DEV)["tokens"][:20]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"tokens": words}) + "\n" for words in sentences))

    out = tmp_path / "predicted"
    done = _predict("bert_ner", run, rows, out)
    assert "task.scheme=IOB2, as" in done.stderr
    for record in _jsonl(out / "predictions.jsonl"):
        found = [(e["type"], e["words"]) for e in record["entities"]]
        strict = entities(record["tags"], "IOB2")
        assert len(found) == len(strict)

    lenient = tmp_path / "lenient"
    done = _predict("bert_ner", run, rows, lenient, "task.scheme=null")
    assert (
        "task.scheme=None (the command line)" in done.stderr and "trained with IOB2" in done.stderr
    )
    for record in _jsonl(lenient / "predictions.jsonl"):
        assert len(record["entities"]) == len(entities(record["tags"], None))


def test_seq2seq_predict_decodes_with_finals_generation_config(tmp_path, cache_dir):
    """t5_translation trained with generation.max_new_tokens=3 writes it to
    final/generation_config.json; predict decodes with it (not the recipe's 24) unless the
    command line names generation.max_new_tokens."""
    run = tmp_path / "run"
    _train("t5_translation", run, cache_dir, "trainer.max_steps=4", "data.max_eval_examples=8",
           "generation.max_new_tokens=3")  # fmt: skip
    saved = json.loads((run / "final" / "generation_config.json").read_text())
    assert saved["max_new_tokens"] == 3
    rows = tmp_path / "rows.jsonl"
    lines = TATOEBA_DEV.read_text().splitlines()[:12]
    rows.write_text(
        "".join(
            json.dumps({"translation": {"en": json.loads(x)["translation"]["en"]}}) + "\n"
            for x in lines
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(run / "final")

    def longest(folder: Path) -> int:
        texts = [r["generated"] for r in _jsonl(folder / "predictions.jsonl")]
        assert len(texts) == 12
        return max(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts)

    out = tmp_path / "predicted"
    done = _predict("t5_translation", run, rows, out)
    assert "'max_new_tokens': 3" in done.stderr
    assert longest(out) <= 3
    given = tmp_path / "given"
    done = _predict("t5_translation", run, rows, given, "generation.max_new_tokens=8")
    assert "'max_new_tokens': 8" in done.stderr  # (four steps of a random T5 say little)
    assert longest(given) <= 8
