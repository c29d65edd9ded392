#!/usr/bin/env python
"""Training tokens/s of chat SFT with and without packing, on the bundled conversations.

The bundled tiny Llama (or ``--model``) trains on the bundled SQuAD conversations rendered with
the zephyr template, ``--max-seq-length`` tokens, ``--batch-size`` rows per step: unpacked rows
in shuffled order (padded to each batch's longest), unpacked rows grouped by length (what the
loop's ``trainer.group_by_length`` does), and packed rows (``task.packing=true``). Rounds
alternate between the three so that a slower spell of a shared machine hits each alike; tokens
are the real (not padding) tokens forwarded and back-propagated. Prints one line per mode with
the median over rounds.

    python scripts/bench_sft_packing.py [--rounds 3] [--steps 6] [--row-length 1024] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM

from recipes.config import ASSETS, ModelConfig
from recipes.model import backend_kwargs, load_tokenizer
from recipes.tasks import chat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from task_yaml import make_task

DATA = ASSETS / "conversations" / "squad" / "train.jsonl"


def batches(rows: list[dict], size: int, order: list[int]) -> list[list[dict]]:
    return [[rows[i] for i in order[s : s + size]] for s in range(0, len(order), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ASSETS / "tiny-llama"))
    parser.add_argument("--template", default="zephyr")
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument(
        "--row-length",
        type=int,
        default=None,
        help="tokens per packed row (default: --max-seq-length); packed batches then hold "
        "batch-size * max-seq-length / row-length rows, the same positions as unpacked ones",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="batches per mode per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args()

    tokenizer = load_tokenizer(ModelConfig(name_or_path=args.model))
    template = chat.resolve_chat_template(tokenizer, args.template)
    features = []
    for line in Path(DATA).read_text(encoding="utf-8").splitlines():
        whole = chat.tokenize_conversation(tokenizer, template, json.loads(line)["messages"])
        if (fitted := chat.fit_length(whole, args.max_seq_length, "truncate")) is not None:
            features.append(fitted)
    row_length = args.row_length or args.max_seq_length
    packed = list(Dataset.from_dict(chat.packed_rows(Dataset.from_list(features), row_length)))
    packed_batch = max(1, args.batch_size * args.max_seq_length // row_length)
    rng = random.Random(0)
    shuffled = list(range(len(features)))
    rng.shuffle(shuffled)
    by_length = sorted(range(len(features)), key=lambda i: len(features[i]["input_ids"]))
    grouped = batches(features, args.batch_size, by_length)
    rng.shuffle(grouped)
    packed_order = list(range(len(packed)))
    rng.shuffle(packed_order)
    modes = {
        "unpacked, shuffled": batches(features, args.batch_size, shuffled),
        "unpacked, grouped by length": grouped,
        f"packed ({row_length}-token rows)": batches(packed, packed_batch, packed_order),
    }

    model = AutoModelForCausalLM.from_pretrained(
        args.model, attn_implementation=args.attn, **backend_kwargs()
    )
    model.to(args.device).train()
    # Positions restart in each conversation, so rows longer than the model's positions are fine.
    task = make_task("sft", max_seq_length=args.max_seq_length, packing=True)
    task.check_model(model)
    collate = chat.ChatCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    speeds: dict[str, list[float]] = {mode: [] for mode in modes}
    fill: dict[str, float] = {}
    for round_ in range(args.rounds):
        for mode, mode_batches in modes.items():
            chosen = mode_batches[round_ * args.steps : (round_ + 1) * args.steps]
            tokens = padded = 0
            started = time.perf_counter()
            for rows in chosen:
                batch = {k: v.to(args.device) for k, v in collate(rows).items()}
                task.loss(model, batch).backward()
                model.zero_grad(set_to_none=True)
                tokens += sum(len(r["input_ids"]) for r in rows)
                padded += batch["input_ids"].numel()
            speeds[mode].append(tokens / (time.perf_counter() - started))
            fill[mode] = tokens / padded
    for mode, values in speeds.items():
        print(
            f"{mode:28s} {statistics.median(values):9.0f} tokens/s (rounds: "
            f"{', '.join(f'{v:.0f}' for v in values)}; {100 * fill[mode]:.0f}% of positions real; "
            f"{len(modes[mode])} batches per epoch)"
        )


if __name__ == "__main__":
    main()
