#!/usr/bin/env python
"""Side by side: ``task=seq2seq`` against run_summarization_no_trainer.py's behaviour.

Both sides fine-tune the same pretrained encoder-decoder (MiniLM to MiniLM, built by
``scripts/make_encoder_decoder.py``) on the same SciTLDR rows with the same settings, each in a
fresh process, seeds alternating which side runs first; each run trains, then generates
summaries of the held-out rows and scores them. Reported: ROUGE (mean and spread over seeds),
training samples/s (median of the runs) and evaluation time (generation alone, and the whole
evaluation).

The peer is written from the example's documented behaviour (see docs/results.md), not copied:
AdamW with no decay on biases and LayerNorm weights, a linear schedule without warmup, no
gradient clipping, DataCollatorForSeq2Seq (labels padded with -100, decoder inputs from the
model), batches of the eval batch size in file order with right padding, and
``generate(max_length=val_max_target_length, num_beams=...)``, then its decoded labels as
references. Where the example splits sentences for ROUGE-Lsum with nltk's punkt (a data
download), both sides here use the same pysbd splitter, and both score with
``recipes.metrics.seq2seq.rouge_scores`` (the mean over rows; evaluate's rouge reports a
bootstrap median, within about 0.01 of it).

    OMP_NUM_THREADS=1 python scripts/compare_seq2seq.py --out /tmp/compare_seq2seq
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCITLDR = REPO / "recipes" / "assets" / "scitldr"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")


# ------------------------------------------------------------------------------------- peer


def run_peer(args: argparse.Namespace) -> dict:
    """One run as run_summarization_no_trainer.py behaves; returns its scores and timings."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        get_scheduler,
        set_seed,
    )

    from recipes.metrics.seq2seq import rouge_scores

    accelerator = Accelerator(cpu=args.cpu)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    if model.config.decoder_start_token_id is None:
        raise ValueError("the model has no decoder_start_token_id")

    def features(rows: list[dict]) -> list[dict]:
        inputs = tokenizer(
            [args.source_prefix + r["source"] for r in rows],
            max_length=args.max_source_length,
            truncation=True,
        )
        labels = tokenizer(
            text_target=[r["target"] for r in rows],
            max_length=args.max_target_length,
            truncation=True,
        )
        return [
            {"input_ids": i, "attention_mask": m, "labels": lab}
            for i, m, lab in zip(
                inputs["input_ids"], inputs["attention_mask"], labels["input_ids"], strict=True
            )
        ]

    data = Path(args.data)
    train = features(read_jsonl(data / "train.jsonl"))
    evaluation = features(read_jsonl(data / "dev.jsonl"))
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    train_loader = DataLoader(train, shuffle=True, collate_fn=collator, batch_size=args.batch_size)
    eval_loader = DataLoader(evaluation, collate_fn=collator, batch_size=args.eval_batch_size)

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    steps = args.epochs * len(train_loader)
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=steps
    )
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    train_s, samples = 0.0, 0
    for _ in range(args.epochs):
        model.train()
        started = time.perf_counter()
        for batch in train_loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            samples += batch["input_ids"].shape[0]
        train_s += time.perf_counter() - started

    model.eval()
    started = time.perf_counter()
    generate_s = 0.0
    predictions: list[str] = []
    references: list[str] = []
    pad = tokenizer.pad_token_id
    for batch in eval_loader:
        with torch.no_grad():
            t0 = time.perf_counter()
            generated = accelerator.unwrap_model(model).generate(
                batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_length=args.max_target_length,
                num_beams=args.num_beams,
            )
            generate_s += time.perf_counter() - t0
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=pad)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=pad)
        generated, labels = accelerator.gather_for_metrics((generated, labels))
        labels = torch.where(labels != -100, labels, pad)
        predictions += [
            t.strip() for t in tokenizer.batch_decode(generated, skip_special_tokens=True)
        ]
        references += [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
    scores = rouge_scores(predictions, references)
    eval_s = time.perf_counter() - started
    return {
        **scores,
        "train_samples_per_second": samples / train_s if train_s else 0.0,
        "train_s": train_s,
        "generate_s": generate_s,
        "eval_s": eval_s,
        "predictions": predictions,
    }


# -------------------------------------------------------------------------------------- ours


def ours_command(args: argparse.Namespace, seed: int, output_dir: Path) -> list[str]:
    data = Path(args.out) / "data"
    return [
        sys.executable,
        str(REPO / "train.py"),
        "recipe=t5_summarization",
        f"model.name_or_path={args.model}",
        f"data.train_file={data / 'train.jsonl'}",
        f"data.eval_file={data / 'dev.jsonl'}",
        "data.source_column=source",
        "data.target_column=target",
        f"data.source_prefix='{args.source_prefix}'",
        f"task.max_source_length={args.max_source_length}",
        f"task.max_target_length={args.max_target_length}",
        f"task.eval_max_target_length={args.max_target_length}",
        # The example's generate(max_length=L) counts the decoder start token: L - 1 new tokens.
        f"generation.max_new_tokens={args.max_target_length - 1}",
        f"generation.num_beams={args.num_beams}",
        f"optimizer.lr={args.lr}",
        f"optimizer.weight_decay={args.weight_decay}",
        "scheduler=linear",
        "scheduler.warmup_ratio=0",
        "scheduler.warmup_steps=0",
        f"trainer.num_epochs={args.epochs}",
        f"trainer.per_device_train_batch_size={args.batch_size}",
        f"trainer.per_device_eval_batch_size={args.eval_batch_size}",
        "trainer.max_grad_norm=null",
        "trainer.mixed_precision=no",
        f"trainer.seed={seed}",
        "trainer.eval_at_start=false",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
        f"trainer.log_every_n_steps={10**6}",
        "logger=none",
        f"output_dir={output_dir}",
    ]


def run_ours(
    args: argparse.Namespace, seed: int, output_dir: Path, eval_only: bool = False
) -> dict:
    command = ours_command(args, seed, output_dir) + (["mode=eval"] if eval_only else [])
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ours failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = read_jsonl(output_dir / "metrics.jsonl")
    last: dict = {}
    for line in lines:
        last.update(line)
    predictions = read_jsonl(output_dir / "eval_predictions.jsonl")
    return {
        **{k: last[f"eval/{k}"] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")},
        "train_samples_per_second": last.get("train/samples_per_second_run", 0.0),
        "train_s": last.get("train/runtime_s", 0.0),
        "generate_s": last["eval/generate_s"],
        "eval_s": last["eval/runtime_s"],
        "predictions": [r["generated"] for r in predictions],
    }


def run_peer_process(
    args: argparse.Namespace, seed: int, result: Path, eval_only: bool = False
) -> dict:
    command = [sys.executable, __file__, "--peer", "--seed", str(seed), "--result", str(result)]
    command += forwarded(args) + (["--epochs", "0"] if eval_only else [])
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"peer failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


# ------------------------------------------------------------------------------------ driver

SETTINGS = (
    "model",
    "out",
    "train_rows",
    "eval_rows",
    "epochs",
    "lr",
    "weight_decay",
    "batch_size",
    "eval_batch_size",
    "max_source_length",
    "max_target_length",
    "num_beams",
    "source_prefix",
)


def forwarded(args: argparse.Namespace) -> list[str]:
    return [x for k in SETTINGS for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    half = (max(values) - min(values)) / 2
    return f"{mean:6.2f} ± {half:4.2f}"


def report(runs: dict[str, list[dict]]) -> str:
    rows = [
        "| | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-Lsum | train samples/s | generate s | eval s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, results in runs.items():
        cells = [
            spread([r[k] for r in results]) for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")
        ]
        cells += [
            f"{statistics.median(r[k] for r in results):.2f}"
            for k in ("train_samples_per_second", "generate_s", "eval_s")
        ]
        rows.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def eval_rounds(args: argparse.Namespace, out: Path) -> tuple[dict[str, list[dict]], str]:
    """Evaluation alone on the same (untrained) weights, alternating sides: the same greedy
    decoding must give the same texts, so the times compare the implementations alone."""
    runs: dict[str, list[dict]] = {"ours": [], "example": []}
    for i in range(args.eval_rounds):
        for side in ("ours", "example") if i % 2 == 0 else ("example", "ours"):
            if side == "ours":
                result = run_ours(args, 0, out / f"ours-eval{i}", eval_only=True)
            else:
                result = run_peer_process(args, 0, out / f"example-eval{i}.json", eval_only=True)
            runs[side].append(result)
            print(f"eval round {i} {side:7s}: generate {result['generate_s']:.1f} s", flush=True)
    same = sum(
        a.strip() == b.strip()
        for a, b in zip(
            runs["ours"][0]["predictions"], runs["example"][0]["predictions"], strict=True
        )
    )
    rows = [
        "| same weights, evaluation only | generate s | eval s |",
        "|---|---|---|",
        *(
            f"| {side} | {statistics.median(r['generate_s'] for r in results):.2f} | "
            f"{statistics.median(r['eval_s'] for r in results):.2f} |"
            for side, results in runs.items()
        ),
    ]
    total = len(runs["ours"][0]["predictions"])
    return runs, "\n".join(rows) + f"\n\nidentical generated texts: {same} of {total} rows"


def prepare_data(args: argparse.Namespace) -> Path:
    """The first train rows and the first dev rows of the bundled SciTLDR slice (author TLDRs)."""
    data = Path(args.out) / "data"
    train = read_jsonl(SCITLDR / "train.jsonl")[: args.train_rows]
    dev = read_jsonl(SCITLDR / "dev.jsonl")[: args.eval_rows]
    keep = ("source", "target")
    write_jsonl(data / "train.jsonl", [{k: r[k] for k in keep} for r in train])
    write_jsonl(data / "dev.jsonl", [{k: r[k] for k in keep} for r in dev])
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/compare_seq2seq", help="results folder")
    parser.add_argument("--model", default="", help="encoder-decoder folder (default: built)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])  # none: --eval-rounds only
    parser.add_argument("--train-rows", type=int, default=240)
    parser.add_argument("--eval-rows", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--lr", type=float, default=3e-4
    )  # new cross-attention: 5e-5 is too slow here
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--max-source-length", type=int, default=96)
    parser.add_argument("--max-target-length", type=int, default=48)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--source-prefix", default="")
    parser.add_argument("--eval-rounds", type=int, default=2, help="evaluation-only rounds")
    parser.add_argument("--cpu", action="store_true", help="peer: force the CPU")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.peer:
        args.data = str(Path(args.out) / "data")
        Path(args.result).write_text(json.dumps(run_peer(args), indent=2))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.model:
        args.model = str(out / "minilm2minilm")
        if not (Path(args.model) / "config.json").is_file():
            sys.path.insert(0, str(REPO / "scripts"))
            import make_encoder_decoder

            make_encoder_decoder.main([args.model])
    prepare_data(args)
    runs: dict[str, list[dict]] = {"ours": [], "example": []}
    started = time.perf_counter()
    for i, seed in enumerate(args.seeds):
        order = ("ours", "example") if i % 2 == 0 else ("example", "ours")
        for side in order:
            t0 = time.perf_counter()
            if side == "ours":
                result = run_ours(args, seed, out / f"ours-seed{seed}")
            else:
                result = run_peer_process(args, seed, out / f"example-seed{seed}.json")
            runs[side].append({"seed": seed, **result})
            print(
                f"seed {seed} {side:7s}: rougeL {result['rougeL']:.2f}, "
                f"{result['train_samples_per_second']:.2f} samples/s, generate "
                f"{result['generate_s']:.1f} s ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    table = report(runs) if args.seeds else ""
    if args.eval_rounds:
        eval_runs, eval_table = eval_rounds(args, out)
        table += "\n\n" + eval_table
    else:
        eval_runs = {}
    settings = {k: getattr(args, k) for k in SETTINGS} | {"seeds": args.seeds}
    summary = {"settings": settings, "runs": runs, "eval_runs": eval_runs, "table": table}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{table}\n\n{len(args.seeds)} seeds, {time.perf_counter() - started:.0f} s; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
