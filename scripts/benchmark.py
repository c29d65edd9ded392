"""Training throughput of this project's loop against a plain ``transformers.Trainer``, side by side.

Both sides train the same model (same initial weights) on the same packed blocks, with the same
block size, batch, optimizer (AdamW), learning rate, clipping and precision, on the same device,
each in a fresh process, alternating ``--rounds`` times. Only the steps after ``--warmup`` count.
Prints a table (tokens/s, samples/s, s/step, peak memory, ours/peer) and writes it as JSON.

    python scripts/benchmark.py clm                              # bundled tiny GPT-2 and text
    python scripts/benchmark.py clm --model PATH --data FILE --block-size 512 --batch-size 8

Peak memory is the device's peak allocation on an accelerator, and the process's peak resident
set size (which includes the Python runtime and libraries) on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipes.config import ASSETS  # noqa: E402


def _peak_memory_mb(device) -> float:
    from recipes import device as device_lib

    peak = device_lib.max_memory_allocated(device)
    if peak is not None:
        return peak / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------------------------ our side


def run_ours(args: argparse.Namespace, out: Path) -> dict:
    """``train.py`` itself, as a user runs it, with one log window for warm-up and one measured."""
    run_dir = out / "ours"
    overrides = [
        "recipe=gpt2_clm",
        f"model.name_or_path={args.model}",
        f"data.path={args.data}",
        "data.sample_by=paragraph",
        f"data.cache_dir={args.cache}",
        f"task.block_size={args.block_size}",
        "task.sample_prompt=null",
        f"trainer.per_device_train_batch_size={args.batch_size}",
        f"trainer.max_steps={args.warmup + args.steps}",
        f"trainer.log_every_n_steps={args.warmup}",
        f"trainer.mixed_precision={args.mixed_precision}",
        f"optimizer.lr={args.lr}",
        "scheduler.warmup_ratio=0",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
        "logger=none",
        f"output_dir={run_dir}",
    ]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "_ours", *overrides],
        check=True,
        cwd=ROOT,
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "train/tokens_per_second" in r and r["step"] > args.warmup]
    tokens = sum(r["train/tokens_per_second"] * _window_seconds(r, args) for r in windows)
    elapsed = sum(_window_seconds(r, args) for r in windows)
    result = json.loads((run_dir / "benchmark.json").read_text())
    result.update(
        tokens_per_second=tokens / elapsed,
        samples_per_second=tokens / elapsed / args.block_size,
        s_per_step=elapsed / args.steps,
    )
    return result


def _window_seconds(record: dict, args: argparse.Namespace) -> float:
    """A log window's length, from its sample count (batch x warmup steps) and its rate."""
    return args.batch_size * args.warmup / record["train/samples_per_second"]


def _ours_child(overrides: list[str]) -> None:
    """Run train.py in this process, then record its peak memory next to its metrics."""
    import runpy

    import torch

    sys.argv = [str(ROOT / "train.py"), *overrides]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            raise
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")))
    device = torch.device(_device_name())
    (run_dir / "benchmark.json").write_text(json.dumps({"peak_memory_mb": _peak_memory_mb(device)}))


def _device_name() -> str:
    from accelerate import PartialState

    return str(PartialState().device)


# ------------------------------------------------------------------------------------ the peer


def _peer_child(args: argparse.Namespace, out: Path) -> None:
    """A plain ``transformers.Trainer`` on the same blocks, model and settings."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from recipes.config import DataConfig
    from recipes.tasks.lm import CausalLanguageModeling

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data_cfg = DataConfig(path=str(args.data), sample_by="paragraph", cache_dir=str(args.cache))
    data = CausalLanguageModeling(block_size=args.block_size).build_data(data_cfg, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model)

    class Clock(TrainerCallback):
        start = end = 0.0

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step == args.warmup:
                Clock.start = time.perf_counter()
            if state.global_step == args.warmup + args.steps:
                Clock.end = time.perf_counter()

    training_args = TrainingArguments(
        output_dir=str(out / "peer"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",  # recipe=gpt2_clm's schedule
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=args.warmup,
        save_strategy="no",
        report_to=[],
        seed=42,
        bf16=args.mixed_precision == "bf16",
        fp16=args.mixed_precision == "fp16",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        data_collator=_with_labels(default_data_collator),
        callbacks=[Clock()],
    )
    trainer.train()
    elapsed = Clock.end - Clock.start
    tokens = args.steps * args.batch_size * args.block_size
    result = {
        "tokens_per_second": tokens / elapsed,
        "samples_per_second": args.steps * args.batch_size / elapsed,
        "s_per_step": elapsed / args.steps,
        "peak_memory_mb": _peak_memory_mb(trainer.args.device),
    }
    (out / "peer.json").write_text(json.dumps(result))


def _with_labels(collate):
    def collate_with_labels(features):
        batch = collate(features)
        batch["labels"] = batch["input_ids"].clone()  # the model shifts them, as ours does
        return batch

    return collate_with_labels


def run_peer(args: argparse.Namespace, out: Path) -> dict:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "_peer", *_argv(args), str(out)],
        check=True,
        cwd=ROOT,
    )
    return json.loads((out / "peer.json").read_text())


def _argv(args: argparse.Namespace) -> list[str]:
    return [
        args.task, "--model", str(args.model), "--data", str(args.data),
        "--block-size", str(args.block_size), "--batch-size", str(args.batch_size),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
        "--mixed-precision", args.mixed_precision, "--cache", str(args.cache),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------ driver


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("task", choices=["clm"])
    parser.add_argument("--model", type=Path, default=ASSETS / "tiny-gpt2")
    parser.add_argument(
        "--resize",
        default="",
        help="config changes for a model built fresh from --model's config and tokenizer "
        "(seeded; both sides start from the same weights), e.g. n_layer=6,n_embd=384,n_head=6",
    )
    parser.add_argument("--data", type=Path, default=ASSETS / "text" / "tinyshakespeare.txt")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=2, help="ours/peer alternations")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (the log window)")
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    with tempfile.TemporaryDirectory() as tmp:
        args.cache = Path(tmp) / "cache"  # both sides train on the very same cached blocks
        if args.resize:
            args.model = _resized_model(args.model, args.resize, Path(tmp) / "model")
        for round_ in range(args.rounds):
            for side, run in (("ours", run_ours), ("peer", run_peer)):
                out = Path(tmp) / f"{side}{round_}"
                out.mkdir()
                results[side].append(run(args, out))
                print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    summary = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in results.items()
    }
    ratio = summary["ours"]["tokens_per_second"] / summary["peer"]["tokens_per_second"]
    report = {
        "task": args.task,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "ours": summary["ours"],
        "peer": summary["peer"],
        "ratio_tokens_per_second": ratio,
        "rounds": results,
    }
    print(_table(summary, ratio))
    out = args.out or ROOT / "outputs" / "benchmark" / f"{args.task}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


def _resized_model(source: Path, changes: str, folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    for change in changes.split(","):
        key, value = change.split("=")
        setattr(config, key.strip(), type(getattr(config, key.strip()))(value))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {source.name} with {changes}: {parameters / 1e6:.1f}M parameters")
    return folder


def _table(summary: dict, ratio: float) -> str:
    rows = [
        ("tokens/s", "tokens_per_second", "{:.0f}"),
        ("samples/s", "samples_per_second", "{:.2f}"),
        ("s/step", "s_per_step", "{:.3f}"),
        ("peak memory (MiB)", "peak_memory_mb", "{:.0f}"),
    ]
    lines = ["| | ours | Trainer | ours/Trainer |", "|---|---:|---:|---:|"]
    for label, key, fmt in rows:
        ours, peer = summary["ours"][key], summary["peer"][key]
        lines.append(f"| {label} | {fmt.format(ours)} | {fmt.format(peer)} | {ours / peer:.3f} |")
    lines.append(f"\nours/Trainer tokens/s: {ratio:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        _ours_child(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_peer":
        _peer_child(parse(sys.argv[2:-1]), Path(sys.argv[-1]))
    else:
        main(sys.argv[1:])
