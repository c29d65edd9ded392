"""The checks that need a GPU (MUSA or CUDA), in one run of a few minutes, as a Markdown table.

    python scripts/gpu_check.py --out DIR          # issue 44's rows: about 9 minutes at most
    python scripts/gpu_check.py --only '*' --out DIR   # every row (more than one command's time)
    python scripts/gpu_check.py --plan             # the rows, their commands and time caps
    python scripts/gpu_check.py --dry-run --out DIR    # every row's code path here (CPU), shrunk
    python scripts/gpu_check.py --only 'smoke/*' --only bert_large/compile
    python3 scripts/gpu_check.py --wheels .whl --out DIR   # a machine without hydra / datasets

Rows (each in a child process with its own time cap; rows that can share a process run as the
jobs of one Hydra multirun, so they pay the start-up once):

- setup/models: random models of real shapes for the rows below (bert-large-uncased QA with the
  bundled uncased vocabulary; a Llama of SmolLM2-135M's shape with the bundled tokenizer);

Planned by default (issue 44, "fast where it is meant to run"):

- profile/*: bert-large QA (384, batch 32, padding=longest) in the project's loop under the step
  profiler (scripts/gpu_check_hydra.py StepProfiler: per-step host time and new input shapes,
  and torch.profiler over 3 steps): sub_batches=4 and 1 alternating twice, then lengths to 64,
  then expandable segments in a process of its own; profile/sub_batches sums them up (the
  likely cause of the gap, from the numbers);
- bert_squad/defaults: ours at the device's defaults against run_qa_no_trainer.py's and
  run_qa.py's behaviour (throughput.py qa's peers), samples/s, MFU, peak memory, rounds
  alternating; bert_squad/f1: F1 after a short real-data run on both sides (MiniLM);
- llm/sft_vs_trl, llm/grpo_vs_trl: throughput.py sft / grpo (ours against TRL's trainers);
- generate/batch_vs_continuous: recipes/generation.py against transformers' continuous batching.

Only with --only (a glob such as 'smoke/*', or '*' for all):

- micro/*: the doctor's one-step SDPA-against-eager probe, the AdamW the project builds
  (``optimizer.fused=null``, and ``true``) against the foreach one (``false``): speed and the
  same parameters, and the cost of the loop's per-step host sync;
- smoke/<recipe>: every recipe's smoke run (``debug=smoke``) in bf16 (fp16 where the device has
  no bf16), 30 steps and its final evaluation;
- bert_large/*: bert-large at sequence length 384, batch 32, 30 steps (the last 10 timed):
  samples/s, tokens/s, MFU and peak memory, then eager attention, dynamic padding with
  sub-batches (4 and 1), length grouping, and ``torch.compile`` on the same data;
- llama135m/*: chat fine-tuning without and with packing, and LoRA with gradient checkpointing
  (peak memory against full fine-tuning);
- compare/*: the ratios a reader decides on (each says which setting won here);
- fsdp/llama_clm, fsdp/llama_sft_lora (optional: only with ``--only fsdp``): FSDP through
  accelerate, one process; the second with LoRA (merged on the main process at the end);
- micro/generate (optional: ``--only micro/generate``): batched generation against one prompt
  at a time on the SmolLM2-shaped Llama, fp32 and bf16, and how many answers are the same;
- generate/rollouts (optional: ``--only generate/rollouts``, issue 47): scripts/bench_rollouts.py
  on the SmolLM2-shaped Llama: rollout tokens/s of generation.engine=batched and continuous and
  TRL's GRPOTrainer with transformers' continuous batching, and their ratios.

Output (``--out DIR``; at most 8 files, as a device machine returns): ``rows.jsonl`` (one JSON
record per row, appended as each row ends), ``table.md`` (rewritten after every row, with the
rows still to run), ``logs.tar.gz`` (every process's full log and each row's run files,
rewritten after every row). A run stopped at any point keeps what finished. A failed row quotes
its real exception (the last line of the traceback; children run with HYDRA_FULL_ERROR=1).

Time: each row has a cap (the plan prints them and their sum, 540 s; estimates until the first
device run); a row may run over its cap by the time earlier rows left unused (at most its cap
again), so the rows stay within the sum, to which each process's start-up, exit and restart
are added; on a device no row starts after ``--deadline`` (540 s by default), so a run fits
one 600 s command. A row past its cap is stopped and recorded as timed out; a failed or timed-out job ends its
shared process and the rows after it go on in a fresh one.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_check_data import DATA_FOLDER, squad_slice  # noqa: E402

ASSETS = ROOT / "recipes" / "assets"
RECIPES = (
    "bert_glue",
    "bert_mlm",
    "bert_ner",
    "bert_squad",
    "bert_squad_v2",
    "bert_swag",
    "gpt2_clm",
    "llama_clm",
    "llama_dpo",
    "llama_gkd",
    "llama_grpo",
    "llama_grpo_tools",
    "llama_kto",
    "llama_rm",
    "llama_sft",
    "t5_squad",
    "t5_summarization",
    "t5_translation",
)
# Added to every train.py process: writes each job's start and failure into its folder.
CALLBACK = "+hydra.callbacks.gpu_check._target_=scripts.gpu_check_hydra.JobRecorder"
# The profile rows add the step profiler (its settings filled in by command()).
PROFILER = "+hydra.callbacks.gpu_check_profile._target_=scripts.gpu_check_hydra.StepProfiler"
PROFILE_STEPS = {False: (5, 3), True: (1, 1)}  # (warm-up, profiled) on a device, --dry-run
CHILD_ENV = {
    "HYDRA_FULL_ERROR": "1",  # the real traceback, not Hydra's one-line hint
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "PYTHONUNBUFFERED": "1",
    "MPLBACKEND": "Agg",
}
# The device README's install: no index, no dependencies, nothing of the machine's replaced.
PIP_INSTALL = (
    sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
    "--no-cache-dir", "--upgrade",
)  # fmt: skip
# Exceptions that only say a child process failed (its own traceback came first).
WRAPPERS = ("CalledProcessError", "ChildFailedError")
HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"
KEPT = (".log", ".json", ".jsonl", ".yaml", ".txt", ".md")  # a row's run files in logs.tar.gz
POLL_S = 0.25
EXIT_GRACE_S = 5.0  # after a process's last job: its sweep summary, then it is stopped
DRY_CAP_SCALE = 4.0  # --dry-run's default: the CPU is slower than the device
MIN_CAP_S = 3.0  # a row is not started with less time than this left before --deadline

OK, FAILED, TIMED_OUT, SKIPPED, NOT_APPLICABLE, NOT_RUN = (
    "ok",
    "FAILED",
    "TIMED OUT",
    "skipped",
    "n/a",
    "not run",
)

# ------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Process:
    """How rows run: a child of this script (``child``), train.py (``train``, the rows being
    the jobs of one Hydra multirun over ``sweep``), or train.py under ``accelerate launch``."""

    key: str
    kind: str
    startup_s: float  # allowance added to the cap of the first row of each start
    base: tuple[str, ...] = ()  # train.py overrides every row of the process shares
    sweep: str | None = None  # the key whose value each row sets (Hydra multirun)
    dry: tuple[str, ...] = ()  # what --dry-run adds (smaller shapes)
    models: bool = False  # needs setup/models
    launch_config: str | None = None
    distributed: str | None = None  # the distributed type a device run must show (train.log)
    env: tuple[tuple[str, str], ...] = ()  # set for this process only (before torch starts)


@dataclass(frozen=True)
class Row:
    name: str
    process: str
    cap_s: float  # on the device, without the process's start-up
    value: str = ""  # the sweep value (train) or the child's name
    what: str = ""
    optional: bool = False  # planned only when --only names it


@dataclass(frozen=True)
class Comparison:
    """``row`` (setting ``a``) against ``base`` (setting ``b``) on one metric. ``loss``: the
    two runs train on the same batches, so their losses must agree within 5 %; ``lower``: the
    metric must be lower for ``row`` (memory); otherwise the ratio is reported, to decide on."""

    name: str
    row: str
    base: str
    metric: str
    a: str
    b: str
    loss: bool = False
    lower: bool = False


@dataclass(frozen=True)
class Summary:
    """A row computed from several finished rows (``rows``; those selected) by ``function``
    (a name in ``SUMMARIES``), once the last of them is recorded."""

    name: str
    rows: tuple[str, ...]
    function: str
    what: str = ""


@dataclass
class Plan:
    processes: dict[str, Process]
    rows: list[Row]
    comparisons: list[Comparison]
    precision: str
    summaries: list[Summary] = field(default_factory=list)


SHORT_STEPS = (
    "trainer.max_steps=30",
    "trainer.log_every_n_steps=10",  # the last window (steps 21-30) is timed after warm-up
    "trainer.eval_at_start=false",
    "trainer.save_final_model=false",
    "trainer.save_every_n_steps=0",
    "trainer.load_best_model_at_end=false",  # no checkpoints to choose among (bert_swag's smoke)
    "trainer.progress_bar=false",
    "logger=none",
)
# --dry-run: the same commands, two logged steps on a few examples.
DRY_STEPS = (
    "trainer.max_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.per_device_train_batch_size=4",
    "data.max_train_examples=32",
    "data.max_eval_examples=16",
)


def build_plan(precision: str, fsdp_config: str) -> Plan:
    short = (*SHORT_STEPS, f"trainer.mixed_precision={precision}")
    perf = (*short, "trainer.eval_at_end=false")
    bert = (
        "recipe=bert_squad",
        "data.path=${data.sample}",  # the bundled SQuAD slice
        "model.name_or_path={bert}",
        "task.max_seq_length=384",
        "task.doc_stride=128",
        "trainer.per_device_train_batch_size=32",
        *perf,
    )
    bert_dry = ("task.max_seq_length=128", "task.doc_stride=32")
    llama = (
        "recipe=llama_sft",
        "debug=smoke",  # the bundled conversations and chat template
        "model.name_or_path={llama}",
        "task.max_seq_length=1024",
        "task.num_generations=0",
        "trainer.per_device_train_batch_size=8",
        *perf,
    )
    llama_dry = ("task.max_seq_length=128",)
    # Issue 44: why 4 sub-batches cost 5.7x on a GPU. The same bert-large steps under the
    # step profiler (scripts/gpu_check_hydra.py), one process alternating sub_batches=4 and 1
    # twice, then length buckets of 64; the allocator's expandable segments need a process of
    # their own (read when the device starts).
    profiled = (
        *bert,
        "trainer.compile=false",  # the eager steps whose cost is in question (CUDA compiles BERT)
        PROFILER,
        "+hydra.callbacks.gpu_check_profile.warmup={profile_warmup}",
        "+hydra.callbacks.gpu_check_profile.profiled={profile_steps}",
    )
    profile_dry = (*bert_dry, "trainer.max_steps=4")  # 1 warm-up, 1 profiled, 2 timed
    from recipes import device

    # Training runs default to expandable segments: the baseline turns them off by name.
    allocator = device.ALLOC_CONF_ENV.get(
        device.installed_backend(), device.ALLOC_CONF_ENV[device.CUDA]
    )
    expandable = ((allocator, device.EXPANDABLE_SEGMENTS),)
    fixed = ((allocator, "expandable_segments:False"),)
    processes = [
        Process("profile", "train", 15, profiled, "trainer", profile_dry, models=True, env=fixed),
        Process(
            "profile_exp", "train", 15, profiled, "trainer", profile_dry, models=True,
            env=expandable,
        ),
        Process("defaults", "child", 8, models=True),
        Process("f1", "child", 8),
        Process("sft", "child", 5),
        Process("grpo", "child", 5),
        Process("continuous", "child", 10, models=True),
        Process("rollouts", "child", 15, models=True),
        Process("setup", "child", 10),
        Process("probe", "child", 8),
        Process("adamw", "child", 10),
        Process("sync", "child", 8),
        Process("generate", "child", 10, models=True),
        Process("smoke", "train", 15, ("debug=smoke", *short), sweep="recipe"),
        Process("llama", "train", 15, llama, "task.packing", llama_dry, models=True),
        Process(
            "lora",
            "train",
            15,
            (*llama, "task.packing=false", "peft=lora", "trainer.gradient_checkpointing=true"),
            dry=llama_dry,
            models=True,
        ),
        Process(
            "eager",
            "train",
            15,
            (*bert, "trainer.padding=max_length", "model.attn_implementation=eager"),
            dry=bert_dry,
            models=True,
        ),
        Process("bert", "train", 15, bert, "trainer", bert_dry, models=True),
        Process(
            "fsdp", "launch", 25, ("recipe=llama_clm", "debug=smoke", *short), dry=(),
            launch_config=fsdp_config, distributed="FSDP",
        ),
        Process(
            "fsdp_lora", "launch", 25,
            ("recipe=llama_sft", "debug=smoke", "peft=lora", "task.num_generations=0",
             *(o for o in short if not o.startswith("trainer.save_final_model")),
             "trainer.save_final_model=true"),  # the merge of sharded adapters is the point
            dry=(), launch_config=fsdp_config, distributed="FSDP",
        ),
        QWEN_LORA_PROCESS,
    ]  # fmt: skip
    # Seconds; smoke/bert_mlm and smoke/llama_sft took 5 and 6 s on the H200, smoke/llama_dpo 6.
    smoke_caps = {"bert_glue": 12, "bert_squad": 15, "bert_mlm": 7, "llama_sft": 8, "llama_kto": 8}

    def sub(count: int, multiple: int) -> str:
        return f"{{padding:longest,sub_batches:{count},pad_to_multiple_of:{multiple}}}"

    rows = [
        # Generous: every bert_large and llama135m row needs it (32 s: room for smoke/llama_grpo).
        Row("setup/models", "setup", 32, "models", "random bert-large and SmolLM2-135M shapes"),
        # Issue 44 first (about 8 minutes with the set-up); the rows after them only with --only.
        # sub_batches=4 ran 0.73 s a step on the H200, 1 ran 0.13 s: 30 steps each.
        Row("profile/sub4_a", "profile", 35, sub(4, 8), "sub-batches 4, lengths to 8: round 1"),
        Row("profile/sub1_a", "profile", 10, sub(1, 8), "whole batches, lengths to 8: round 1"),
        Row("profile/sub4_b", "profile", 28, sub(4, 8), "round 2"),
        Row("profile/sub1_b", "profile", 8, sub(1, 8), "round 2"),
        Row("profile/sub4_pad64", "profile", 15, sub(4, 64), "sub-batches 4, lengths to 64"),
        Row("profile/sub1_pad64", "profile", 8, sub(1, 64), "whole batches, lengths to 64"),
        Row(
            "profile/sub4_expandable",
            "profile_exp",
            28,
            sub(4, 8),
            f"sub-batches 4, {expandable[0][0]}={expandable[0][1]}",
        ),
        Row(
            "bert_squad/defaults",
            "defaults",
            125,
            "squad_defaults",
            "ours at the device's defaults against run_qa_no_trainer and run_qa (throughput.py qa)",
        ),
        Row("bert_squad/f1", "f1", 48, "squad_f1", "F1 after a short real-data run, both sides"),
        Row("llm/sft_vs_trl", "sft", 40, "sft", "throughput.py sft: ours packed against TRL"),
        Row("llm/grpo_vs_trl", "grpo", 50, "grpo", "throughput.py grpo: ours against TRL"),
        Row(
            "generate/batch_vs_continuous",
            "continuous",
            25,
            "continuous",
            "generation.complete against transformers' continuous batching",
        ),
        Row(
            "generate/rollouts",
            "rollouts",
            60,
            "rollouts",
            "bench_rollouts.py: batched, continuous and TRL paged engines, tokens/s",
            optional=True,
        ),
        Row("micro/sdpa_probe", "probe", 7, "sdpa_probe", "one SDPA step against eager", True),
        Row("micro/adamw_fused", "adamw", 12, "adamw_fused", "fused=null/true vs false", True),
        Row("micro/host_sync", "sync", 7, "host_sync", "the loop's per-step .tolist()", True),
        Row(
            "micro/generate",
            "generate",
            8,
            "generate",
            "batched answers against one at a time",
            optional=True,
        ),
        *(
            Row(f"smoke/{r}", "smoke", smoke_caps.get(r, 10), r, "debug=smoke, 30 steps", True)
            for r in RECIPES
        ),
        Row("llama135m/unpacked", "llama", 20, "false", "SFT, seq 1024, batch 8, full FT", True),
        Row("llama135m/packed", "llama", 12, "true", "the same, task.packing=true", True),
        Row("llama135m/lora_gc", "lora", 20, "", "peft=lora, gradient checkpointing", True),
        Row("bert_large/eager", "eager", 25, "", "padding=max_length, eager attention", True),
        # One process; compile last, its compilation the longest wait.
        Row("bert_large/max_length", "bert", 25, "{padding:max_length}", "seq 384, batch 32", True),
        Row(
            "bert_large/longest", "bert", 15, "{padding:longest,sub_batches:4}", "CPU default", True
        ),
        Row(
            "bert_large/longest_sub1", "bert", 12, "{padding:longest,sub_batches:1}", "whole", True
        ),
        Row(
            "bert_large/longest_grouped",
            "bert",
            12,
            "{padding:longest,group_by_length:true}",
            "length-grouped batches",
            True,
        ),
        Row(
            "bert_large/compile", "bert", 80, "{padding:max_length,compile:true}", "compiled", True
        ),
        Row("fsdp/llama_clm", "fsdp", 25, "", "FSDP, one process", optional=True),
        Row("fsdp/llama_sft_lora", "fsdp_lora", 25, "", "LoRA under FSDP", optional=True),
        QWEN_LORA_ROW,
    ]
    tokens, samples = "tokens_per_s", "samples_per_s"
    comparisons = [
        Comparison("compare/attention", "bert_large/eager", "bert_large/max_length", tokens,
                   "eager", "sdpa (auto)", loss=True),
        Comparison("compare/compile", "bert_large/compile", "bert_large/max_length", tokens,
                   "compiled", "not compiled", loss=True),
        Comparison("compare/padding", "bert_large/longest", "bert_large/max_length", samples,
                   "padding=longest (sub-batches)", "padding=max_length", loss=True),
        Comparison("compare/sub_batches", "bert_large/longest", "bert_large/longest_sub1",
                   samples, "sub_batches=4 (default)", "sub_batches=1", loss=True),
        Comparison("compare/group_by_length", "bert_large/longest_grouped",
                   "bert_large/longest", samples, "group_by_length=true",
                   "group_by_length=false (default)"),
        Comparison("compare/packing", "llama135m/packed", "llama135m/unpacked", tokens,
                   "packing=true", "packing=false (default)"),
        Comparison("compare/lora_memory", "llama135m/lora_gc", "llama135m/unpacked",
                   "peak_memory_gib", "LoRA + gradient checkpointing", "full fine-tuning",
                   lower=True),
    ]  # fmt: skip
    profile_rows = tuple(r.name for r in rows if r.process in ("profile", "profile_exp"))
    summaries = [
        Summary(
            "profile/sub_batches",
            profile_rows,
            "sub_batches",
            "why sub-batches cost more on this device: step time, device busy, first calls",
        )
    ]
    large_process, large_rows = large_lora_plan()
    processes.append(large_process)
    rows += large_rows
    return Plan({p.key: p for p in processes}, rows, comparisons, precision, summaries)


# ms-swift's MUSA page: Qwen3.5-4B LoRA SFT on one S5000 in about 15 GiB (2,048 tokens, batch 4,
# accumulation 4, rank 8; docs/ms-swift.md). The Qwen3-4B shape of recipes/model_shapes.py (which
# Qwen3.5-4B's language model is taken to share), random bf16 weights built at full depth on the
# device; rows packed to the full 2,048 tokens (ms-swift's rows are at most that). --dry-run: 2
# narrow layers, 128 tokens.
QWEN_LORA_PROCESS = Process("qwen_lora", "child", 30)
QWEN_LORA_ROW = Row(
    "memory/qwen3_4b_lora",
    "qwen_lora",
    240,
    "qwen3_4b_lora",
    "Qwen3-4B shape, LoRA r 8, seq 2048, batch 4 x 4: peak memory against ms-swift's 15 GiB",
    optional=True,
)


def child_qwen3_4b_lora(out: Path, dry_run: bool) -> dict:
    """Train ms-swift's LoRA setting on a random Qwen3-4B-shaped model; its peak memory."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from recipes import device
    from recipes.model_shapes import SHAPES

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    shape = {k: v for k, v in SHAPES["Qwen/Qwen3-4B"].items() if k != "architectures"}
    shape.pop("model_type")
    if dry_run:  # what a CPU trains in seconds: the same code path
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        shape.update(vocab_size=len(tokenizer))
    config = Qwen3Config(
        **shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    folder = out / "qwen3-4b-shape"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device.backend()):  # random init on the device: minutes on a CPU
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    length, batch, steps = (128, 2, 2) if dry_run else (2048, 4, 8)
    run = out / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=llama_sft", "debug=smoke"]
    cmd += [f"model.name_or_path={folder}", "model.dtype=bfloat16", "task.packing=true"]
    cmd += ["peft=lora", "peft.r=8", "peft.alpha=32", f"task.max_seq_length={length}"]
    cmd += ["task.num_generations=0", f"trainer.per_device_train_batch_size={batch}"]
    cmd += [f"trainer.gradient_accumulation_steps={1 if dry_run else 4}"]
    cmd += [o for o in SHORT_STEPS if not o.startswith(("trainer.max_steps", "trainer.log_every"))]
    cmd += [f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={steps // 2}"]
    cmd += ["trainer.eval_at_end=false", f"trainer.mixed_precision={_precision(dry_run)}"]
    cmd += [f"output_dir={run}", *(["data.max_train_examples=32"] if dry_run else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "train.log").write_text(f"$ {shlex.join(cmd)}\n{done.stdout}{done.stderr}")
    shutil.rmtree(folder, ignore_errors=True)  # 8 GB of random weights
    if done.returncode != 0:
        return {"ok": False, "error": last_error(done.stderr) or f"exit {done.returncode}"}
    found = train_metrics(run)
    peak = found.get("peak_memory_gib")
    if peak:
        found["note"] = f"peak {peak:.1f} GiB (ms-swift: about 15 GiB, S5000); {found['note']}"
    return found


def matches(name: str, patterns: list[str]) -> bool:
    """A glob (with ``*?[``) matches the whole name; anything else is a substring."""
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            if fnmatch.fnmatchcase(name, pattern):
                return True
        elif pattern in name:
            return True
    return False


def select(plan: Plan, only: list[str]) -> list[Row]:
    """The rows to run: all but the optional ones, or those ``only`` matches (the rows of a
    summary it matches, and setup/models when a chosen row needs it)."""
    if only:
        wanted = {n for s in plan.summaries if matches(s.name, only) for n in s.rows}
        chosen = [r for r in plan.rows if matches(r.name, only) or r.name in wanted]
    else:
        chosen = [r for r in plan.rows if not r.optional]
    if any(plan.processes[r.process].models for r in chosen):
        chosen = [r for r in plan.rows if r.name == "setup/models" or r in chosen]
    return chosen


def parse_overrides(values: list[str]) -> list[tuple[str | None, str]]:
    """``KEY=VALUE`` (every train.py row) or ``PATTERN:KEY=VALUE`` (the rows PATTERN matches)."""
    parsed = []
    for value in values:
        head, eq, _ = value.partition("=")
        if not eq:
            raise ValueError(f"--override {value}: expected KEY=VALUE or PATTERN:KEY=VALUE")
        pattern, colon, _ = head.partition(":")
        parsed.append((pattern, value[len(pattern) + 1 :]) if colon else (None, value))
    return parsed


def row_overrides(row: Row, overrides: list[tuple[str | None, str]]) -> tuple[str, ...]:
    return tuple(v for pattern, v in overrides if pattern is None or matches(row.name, [pattern]))


def batches(
    plan: Plan, rows: list[Row], overrides: list[tuple[str | None, str]]
) -> list[list[Row]]:
    """Consecutive rows of one train process with the same extra overrides share a process."""
    out: list[list[Row]] = []
    for row in rows:
        process = plan.processes[row.process]
        shared = process.kind == "train" and process.sweep is not None
        if (
            out
            and shared
            and out[-1][-1].process == row.process
            and row_overrides(out[-1][-1], overrides) == row_overrides(row, overrides)
        ):
            out[-1].append(row)
        else:
            out.append([row])
    return out


@dataclass
class Context:
    """What a command needs beyond the plan."""

    python: str
    work: Path
    dry_run: bool
    overrides: list[tuple[str | None, str]] = field(default_factory=list)
    data: Path | None = None  # SQuAD slices for bert_squad/f1 (gpu_check_wheels.py --data)

    @property
    def models(self) -> Path:
        return self.work / "models"


def command(plan: Plan, rows: list[Row], ctx: Context, folder: Path) -> list[str]:
    """The child process for ``rows`` (all of one process), writing under ``folder``."""
    process = plan.processes[rows[0].process]
    script = str(Path(__file__).resolve())
    if process.kind == "child":
        (row,) = rows
        cmd = [ctx.python, script, "--child", row.value, "--child-out", str(folder / "0")]
        cmd += ["--models-dir", str(ctx.models)]
        if ctx.data is not None:
            cmd += ["--data", str(ctx.data)]
        return [*cmd, "--dry-run"] if ctx.dry_run else cmd
    paths = {"bert": str(ctx.models / "bert-large-qa"), "llama": str(ctx.models / "llama-135m")}
    warmup, profiled = PROFILE_STEPS[ctx.dry_run]
    fill = {**paths, "profile_warmup": str(warmup), "profile_steps": str(profiled)}
    overrides = []
    for o in process.base:
        for key, value in fill.items():
            o = o.replace("{" + key + "}", value)
        overrides.append(o)
    if ctx.dry_run:
        overrides += [*DRY_STEPS, *process.dry]
    overrides += row_overrides(rows[0], ctx.overrides)
    if process.sweep is not None:
        overrides.append(f"{process.sweep}={','.join(r.value for r in rows)}")
    overrides.append(CALLBACK)
    if len(rows) > 1:
        head = [ctx.python, str(ROOT / "train.py"), "-m"]
        overrides.append(f"hydra.sweep.dir={folder}")
    else:
        head = [ctx.python, str(ROOT / "train.py")]
        overrides.append(f"hydra.run.dir={folder / '0'}")
    if process.kind == "launch":
        launch = [ctx.python, "-m", "accelerate.commands.launch", "--config_file"]
        head = [*launch, str(process.launch_config), "--num_processes", "1", head[1]]
    return [*head, *overrides]


def caps_of(plan: Plan, rows: list[Row], overrides: list[tuple[str | None, str]]) -> float:
    """The planned time of ``rows``: their caps and one start-up per process."""
    return sum(r.cap_s for r in rows) + sum(
        plan.processes[b[0].process].startup_s for b in batches(plan, rows, overrides)
    )


def print_plan(plan: Plan, rows: list[Row], ctx: Context, scale: float) -> None:
    groups = batches(plan, rows, ctx.overrides)
    total = caps_of(plan, rows, ctx.overrides) * scale
    out = sys.stdout
    out.write(
        f"GPU check plan ({plan.precision}): {len(rows)} rows in {len(groups)} processes; caps "
        f"sum to {total:.0f} s ({total / 60:.1f} min), start-ups included"
        f"{' (x' + format(scale, 'g') + ', --dry-run)' if ctx.dry_run else ''}\n\n"
    )
    for group in groups:
        process = plan.processes[group[0].process]
        folder = ctx.work / "runs" / process.key
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in process.env)
        out.write(
            f"process {process.key} ({process.kind}, start-up {process.startup_s * scale:.0f} s):"
            f" {env}{shlex.join(command(plan, group, ctx, folder))}\n"
        )
        for index, row in enumerate(group):
            value = f" [{process.sweep}={row.value}]" if process.sweep else ""
            out.write(
                f"  {index}. {row.name:28} cap {row.cap_s * scale:4.0f} s  {row.what}{value}\n"
            )
    optional = [r.name for r in plan.rows if r.optional and r not in rows]
    if optional:
        out.write(f"\noptional (only with --only): {', '.join(optional)}\n")
    chosen = {r.name for r in rows}
    compared = [c for c in plan.comparisons if {c.row, c.base} <= chosen]
    if compared:
        out.write("\ncomparisons:\n")
        for c in compared:
            out.write(f"  {c.name:28} {c.a} / {c.b}: {c.metric} of {c.row} / {c.base}\n")
    summed = [x for x in plan.summaries if chosen & set(x.rows)]
    if summed:
        out.write("\nsummaries:\n")
        for x in summed:
            out.write(f"  {x.name:28} {x.what} (from {', '.join(sorted(chosen & set(x.rows)))})\n")


# ----------------------------------------------------------------------- outcomes and errors


def last_error(text: str) -> str | None:
    """The error a log ends with: the exception line (type and message, its first line) of the
    last traceback or train.py's last ``error:`` line, whichever comes later; not a launcher's
    wrapper (``CalledProcessError`` after its child's own traceback), never Hydra's hint."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            after = (x for x in lines[i + 1 :] if x.strip() and not x[0].isspace())
            exception = next(after, None)
            if exception is not None:
                found.append(exception.strip())
        elif line.startswith("error: "):
            found.append(line.strip())
    real = [e for e in found if not e.split(":")[0].endswith(WRAPPERS) and HYDRA_HINT not in e]
    if real or found:
        return (real or found)[-1][:400]
    rest = [line.strip() for line in lines if line.strip() and HYDRA_HINT not in line]
    return rest[-1][:400] if rest else None


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def outcome(kind: str, job: Path) -> dict[str, Any] | None:
    """What a finished row left in its folder; None while it runs. ``fatal``: its process must
    not run more rows (an exception; a clean refusal of train.py leaves the process healthy)."""
    if kind == "child":
        path = job / "result.json"
        return {"status": "done", "fatal": False, **_read_json(path)} if path.exists() else None
    if (job / "job_error.txt").exists():
        text = (job / "job_error.txt").read_text(encoding="utf-8", errors="replace")
        return {"status": FAILED, "fatal": True, "error": last_error(text), "traceback": text}
    if (job / "failed.json").exists():
        error = _read_json(job / "failed.json").get("error", "failed")
        return {"status": FAILED, "fatal": False, "error": f"error: {error.splitlines()[0]}"}
    if (job / "profile.pending").exists():  # the step profiler still writes its summary
        return None
    if (job / "results.json").exists():
        return {"status": "done", "fatal": False, **train_metrics(job)}
    return None


def train_metrics(job: Path) -> dict[str, Any]:
    """The last logged window of a run (after warm-up) and its final evaluation."""
    from recipes.plots import read_metrics

    results = _read_json(job / "results.json")
    records = read_metrics(job) if (job / "metrics.jsonl").exists() else []
    train = [r for r in records if "train/loss" in r]
    last = train[-1] if train else {}
    found: dict[str, Any] = {
        "steps": results.get("steps"),
        "loss": last.get("train/loss"),
        "samples_per_s": last.get("train/samples_per_second"),
        "tokens_per_s": last.get("train/tokens_per_second"),
        "tflops": last.get("train/tflops"),
        "mfu": last.get("train/mfu"),
        "peak_memory_gib": last.get("train/peak_memory_gib"),
        "ok": bool(train) and all(math.isfinite(r["train/loss"]) for r in train),
    }
    notes = [] if found["ok"] else ["no finite training loss logged"]
    if results.get("main_value") is not None:
        notes.append(f"{results['main_metric']} {results['main_value']:.4g}")
    log = (job / "train.log").read_text(errors="replace") if (job / "train.log").exists() else ""
    kind = re.search(r"distributed DistributedType\.(\w+)", log)
    if kind and kind.group(1) != "NO":
        found["distributed"] = kind.group(1)
        notes.append(f"distributed {kind.group(1)}")
    trainable = re.search(r"trainable parameters: (\d+) of (\d+)", log)
    if trainable and trainable.group(1) != trainable.group(2):  # LoRA
        share = int(trainable.group(1)) / int(trainable.group(2))
        notes.append(f"{share:.2%} of the parameters train")
    if (job / "profile.json").exists():  # the step profiler's (profile rows)
        found["profile"] = profile = _read_json(job / "profile.json")
        notes.append(profile_note(profile))
    # The memory plan's estimate of the run (recipes.plan, logged at its end beside the peak).
    planned = [r["memory/plan_gib"] for r in records if "memory/plan_gib" in r]
    if planned:
        found["plan_gib"] = planned[-1]
        peak = found["peak_memory_gib"]
        notes.append(
            f"plan {planned[-1]:.2f} GiB"
            + (f" ({peak / planned[-1]:.2f}x measured / plan)" if peak else "")
        )
    if (job / "gpu_check_job.json").exists():
        allocated = _read_json(job / "gpu_check_job.json").get("allocated_at_start")
        if allocated is not None:  # not the first job of its process
            found["shared_process"] = True
            if allocated > 2**26:
                notes.append(f"{allocated / 2**30:.2f} GiB left allocated by the job before")
    found["note"] = "; ".join(notes)
    return found


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def table_text(header: list[str], records: list[dict], pending: list[str]) -> str:
    lines = [
        *header,
        "",
        "| row | status | loss | samples/s | tokens/s | TFLOP/s | MFU | peak GiB | s | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    starred = False
    for r in records:
        peak = _fmt(r.get("peak_memory_gib"), ".2f")
        if r.get("shared_process") and peak != "-":
            peak, starred = peak + "*", True
        note = r.get("note") or ""
        if r.get("error"):
            note = f"{r['error']}; {note}" if note else r["error"]
        lines.append(
            f"| {r['row']} | {r['status']} | {_fmt(r.get('loss'), '.4f')} | "
            f"{_fmt(r.get('samples_per_s'), ',.1f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('mfu'), '.1%')} | {peak} | "
            f"{_fmt(r.get('seconds'), '.0f')} | {note.replace('|', '/')} |"
        )
    lines.extend(f"| {name} | {NOT_RUN} | | | | | | | | |" for name in pending)
    lines.append("")
    if starred:
        lines.append(
            "\\* ran after another job in the same process (memory those left allocated is named "
            "in the note when there was any)."
        )
    lines.append(
        "Throughput is the last logged window (after warm-up); MFU against the device's dense "
        "peak (recipes/device.py). Logs and run files: logs.tar.gz."
    )
    return "\n".join(lines) + "\n"


def compare(c: Comparison, a: dict, b: dict) -> dict[str, Any]:
    """The comparison row of two finished rows."""
    row: dict[str, Any] = {"row": c.name, "kind": "compare", "a": c.row, "b": c.base}
    if a["status"] != OK or b["status"] != OK:
        return {**row, "status": NOT_APPLICABLE, "note": f"needs {c.row} and {c.base} ok"}
    va, vb = a.get(c.metric), b.get(c.metric)
    if va is None or vb is None or not vb:
        return {**row, "status": NOT_APPLICABLE, "note": f"no {c.metric} on this machine"}
    ratio = row["ratio"] = va / vb
    if c.lower:
        verdict = f"{c.a} {'uses less' if ratio < 1 else 'does NOT use less'}"
    else:
        verdict = f"{c.a if ratio >= 1 else c.b} is faster here"
    notes = [f"{c.a} / {c.b}: {ratio:.2f}x {c.metric} ({va:,.4g} vs {vb:,.4g}); {verdict}"]
    ok = ratio < 1 if c.lower else True
    if c.loss:
        la, lb = a.get("loss"), b.get("loss")
        close = la is not None and lb is not None and abs(la - lb) <= 0.05 * abs(lb)
        notes.append(f"loss {_fmt(la, '.4f')} vs {_fmt(lb, '.4f')}{'' if close else ' DIFFER'}")
        ok = ok and close
    return {**row, "status": OK if ok else FAILED, "note": "; ".join(notes)}


# ------------------------------------------------------------------- the profile rows' summary


def timed_steps(profile: dict) -> list[dict]:
    """A profiled job's steps after warm-up, without the profiled ones (the profiler slows
    them) and the one after them (which waited for the profiler to stop)."""
    skip = profile["warmup"] + profile["profiled"] + (1 if profile["profiled"] else 0)
    return profile["steps"][skip:]


def profile_note(profile: dict) -> str:
    """One job's profile in a few words (its table row's note)."""
    steps = timed_steps(profile)
    parts = []
    if steps:
        median = statistics.median(s["s"] for s in steps)
        new = sum(s["new"] for s in steps) / len(steps)
        mean = statistics.fmean(s["s"] for s in steps)
        parts.append(
            f"{mean * 1e3:.0f} ms/step (mean of {len(steps)}; median {median * 1e3:.0f}), "
            f"{new:.2f} new shapes a step"
        )
    wall, busy = profile.get("wall_s_per_step"), profile.get("device_busy_s_per_step")
    if wall and busy is not None:
        parts.append(f"device busy {busy / wall:.0%} of the profiled steps")
    return "; ".join(parts)


def summarise_sub_batches(records: list[dict]) -> dict:
    """Why ``sub_batches=4`` costs more than 1 here, from the profile rows: step times (means,
    and medians, over the rounds' unprofiled steps), the first-call cost of a new input shape (steps that saw
    new shapes against steps that saw none, per new shape), and per step in the profiled window
    the device's busy share, allocator calls, host syncs, device-to-host copies and launches."""
    variants: dict[str, list[dict]] = {}  # sub4 and sub1: both rounds; each row on its own
    for rec in records:
        if rec.get("status") == OK and rec.get("profile"):
            name = rec["row"].split("/", 1)[1]
            variants.setdefault(name, []).append(rec["profile"])
            if re.search(r"_[ab]$", name):
                variants.setdefault(name[:-2], []).append(rec["profile"])
    if "sub4" not in variants or "sub1" not in variants:
        return {"ok": False, "error": "needs profile/sub4_* and profile/sub1_* ok"}
    details: dict[str, dict] = {}
    for name, profiles in variants.items():
        steps = [s for p in profiles for s in timed_steps(p)]
        if not steps:
            continue
        window = [p for p in profiles if p.get("wall_s_per_step")]
        counts = {}
        for key in window[0]["per_step"] if window else {}:
            counts[key] = statistics.median(p["per_step"][key] for p in window)
        busy = [p["device_busy_s_per_step"] / p["wall_s_per_step"] for p in window
                if p.get("device_busy_s_per_step") is not None]  # fmt: skip
        old = [s["s"] for s in steps if not s["new"]]
        fresh = [s for s in steps if s["new"]]
        details[name] = {
            "rounds": len(profiles),
            "timed_steps": len(steps),
            # The mean: first calls are rare slow steps, and throughput pays for them all.
            "step_s": statistics.fmean(s["s"] for s in steps),
            "median_step_s": statistics.median(s["s"] for s in steps),
            "sub_batches_per_step": statistics.median(s["sub"] for s in steps),
            "new_shapes_per_step": sum(s["new"] for s in steps) / len(steps),
            "steps_with_new_shapes": len(fresh),
            "step_s_no_new_shape": statistics.median(old) if old else None,
            "step_s_new_shapes": statistics.median(s["s"] for s in fresh) if fresh else None,
            "new_shapes_in_those": sum(s["new"] for s in fresh) / len(fresh) if fresh else None,
            "device_busy_share": statistics.median(busy) if busy else None,
            "per_step": counts,
            "top_kernels": window[0].get("top_kernels", [])[:8] if window else [],
            "attention_ops": window[0].get("attention_ops") if window else None,
            "allocator": [p.get("allocator") for p in profiles],
        }
    four, one = details["sub4"], details["sub1"]
    ratio = four["step_s"] / one["step_s"]
    notes = [
        f"sub_batches=4 {four['step_s'] * 1e3:.0f} ms/step against 1 {one['step_s'] * 1e3:.0f} "
        f"ms ({ratio:.2f}x; means of {four['timed_steps']} and {one['timed_steps']} steps; "
        f"medians {four['median_step_s'] * 1e3:.0f} and {one['median_step_s'] * 1e3:.0f} ms)"
    ]
    # First calls: what a step with new shapes costs over one without, per new shape.
    cost = None
    if four["step_s_new_shapes"] is not None and four["step_s_no_new_shape"] is not None:
        cost = (four["step_s_new_shapes"] - four["step_s_no_new_shape"]) / four[
            "new_shapes_in_those"
        ]
    gap = four["step_s"] - one["step_s"]
    causes = []
    if cost is not None:
        per_step = four["new_shapes_per_step"]
        notes.append(
            f"first-call cost of new shapes: {cost * 1e3:.0f} ms per new shape, "
            f"{per_step:.2f} new shapes per step ({four['steps_with_new_shapes']} of "
            f"{four['timed_steps']} steps saw one)"
        )
        if cost * per_step > 0.5 * gap:
            causes.append((cost * per_step, "first calls of new shapes"))
    elif four["new_shapes_per_step"] == 0:
        notes.append("no new input shape after warm-up (every shape seen before)")
    share4, share1 = four["device_busy_share"], one["device_busy_share"]
    if share4 is not None and share1 is not None:
        notes.append(f"device busy {share4:.0%} of a step against {share1:.0%}")
        if share4 < 0.6:
            causes.append(((1 - share4) * four["step_s"], "the host (the device waits)"))
    c4, c1 = four["per_step"], one["per_step"]
    if c4 and c1:
        notes.append(
            "per step (4 against 1): "
            + ", ".join(f"{key} {c4.get(key, 0):.0f} vs {c1.get(key, 0):.0f}" for key in COUNTED)
        )
        if c4.get("cudaMalloc", 0) + c4.get("cudaFree", 0) > 10:
            causes.append((gap, "the allocator (cudaMalloc/cudaFree every step)"))
    if "sub4_a" in details and "sub4_b" in details:  # the same steps, shapes seen or not
        speed = details["sub4_a"]["step_s"] / details["sub4_b"]["step_s"]
        notes.append(f"sub_batches=4 round 2 (its shapes seen in round 1): {speed:.2f}x round 1")
    # Each variant against the sub_batches=4 job at the same place in its process: lengths to
    # 64 ran after both rounds (as round 2), expandable segments first in a process of its own.
    for variant, base, label, cause in (
        ("sub4_pad64", "sub4_b", "lengths to 64", "new shapes (length buckets help)"),
        ("sub4_expandable", "sub4_a", "expandable segments", "the allocator"),
    ):
        if variant in details:
            against = details.get(base, four)
            speed = against["step_s"] / details[variant]["step_s"]
            notes.append(f"sub_batches=4 with {label}: {speed:.2f}x the speed without")
            if speed > 1.5:
                causes.append(((1 - 1 / speed) * against["step_s"], cause))
    if "sub1_pad64" in details:
        speed = one["step_s"] / details["sub1_pad64"]["step_s"]
        notes.append(f"sub_batches=1 with lengths to 64: {speed:.2f}x lengths to 8")
    if causes:
        causes.sort(reverse=True)
        likely = f"likely cause: {causes[0][1]}"
    else:
        likely = "likely cause: more, smaller launches (no first-call, host or allocator signal)"
    return {
        "ok": True,
        "samples_per_s": None,
        "ratio": ratio,
        "note": "; ".join([likely, *notes]),
        "details": details,
    }


SUMMARIES = {"sub_batches": summarise_sub_batches}
COUNTED = ("cudaMalloc", "cudaFree", "host_syncs", "memcpy_dtoh", "kernel_launches")


# ------------------------------------------------------------------------------------ the run


class Runner:
    """Runs the rows, writing rows.jsonl, table.md and logs.tar.gz after each."""

    def __init__(
        self,
        plan: Plan,
        rows: list[Row],
        ctx: Context,
        out: Path,
        header: list[str],
        scale: float,
        caps: list[tuple[str | None, float]],
        deadline: float | None,
    ) -> None:
        self.plan, self.rows, self.ctx, self.out = plan, rows, ctx, out
        self.header, self.scale, self.caps, self.deadline = header, scale, caps, deadline
        self.records: list[dict] = []
        self.by_name: dict[str, dict] = {}
        self.bank = 0.0  # cap time earlier rows left unused
        self.started = time.monotonic()
        self.processes = 0
        self.env = {**os.environ, **CHILD_ENV}
        self.proc: subprocess.Popen | None = None
        for folder in ("logs", "files", "runs"):
            (ctx.work / folder).mkdir(parents=True, exist_ok=True)

    # -- time

    def own_cap(self, row: Row, first: bool) -> float:
        """The row's cap, with its process's start-up when it starts one; --cap replaces it."""
        cap = row.cap_s + (self.plan.processes[row.process].startup_s if first else 0.0)
        cap *= self.scale
        for pattern, seconds in self.caps:
            if pattern is None or matches(row.name, [pattern]):
                cap = seconds
        return cap

    def left(self) -> float:
        """Seconds to --deadline (infinite without one)."""
        if self.deadline is None:
            return math.inf
        return self.deadline - (time.monotonic() - self.started)

    def cap(self, row: Row, first: bool) -> tuple[float, float, float]:
        """(own cap, borrowed, effective cap), the deadline applied."""
        own = self.own_cap(row, first)
        borrowed = min(self.bank, own)
        return own, borrowed, min(own + borrowed, self.left())

    # -- records

    def record(self, rec: dict) -> None:
        """Append a row (and the comparisons it completes), then rewrite the files."""
        new = [rec]
        done = {*self.by_name, rec["row"]}
        arms = {**self.by_name, rec["row"]: rec}
        for c in self.plan.comparisons:
            if rec["row"] in (c.row, c.base) and {c.row, c.base} <= done:
                new.append(compare(c, arms[c.row], arms[c.base]))
        selected = {r.name for r in self.rows}
        for x in self.plan.summaries:
            inputs = [n for n in x.rows if n in selected]
            if rec["row"] in inputs and set(inputs) <= done:
                new.append(self.summarise(x, [arms[n] for n in inputs]))
        for item in new:
            self.records.append(item)
            self.by_name[item["row"]] = item
            with (self.out / "rows.jsonl").open("a", encoding="utf-8") as f:
                f.write(json.dumps(item) + "\n")
            extra = item.get("error") or item.get("note") or ""
            seconds = f" {item['seconds']:.0f} s" if item.get("seconds") is not None else ""
            sys.stdout.write(
                f"[{len(self.records):2}] {item['row']}: {item['status']}{seconds}  {extra}\n"
            )
        sys.stdout.flush()
        self.write_files()

    def summarise(self, x: Summary, records: list[dict]) -> dict:
        """A summary row; its whole result goes into logs.tar.gz as <row>/summary.json."""
        try:
            found = SUMMARIES[x.function](records)
        except Exception as err:  # a summary must not stop the rows after it
            found = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", x.name)
        keep = self.ctx.work / "files" / slug
        keep.mkdir(parents=True, exist_ok=True)
        atomic_write(keep / "summary.json", json.dumps(found, indent=1).encode())
        status = OK if found.get("ok") else FAILED
        brief = {k: v for k, v in found.items() if k not in ("ok", "details")}
        return {"row": x.name, "kind": "summary", "status": status, **brief,
                "files": f"logs.tar.gz:{slug}/"}  # fmt: skip

    def write_files(self) -> None:
        done = set(self.by_name)
        pending = [r.name for r in self.rows if r.name not in done]
        text = table_text(self.header, self.records, pending)
        atomic_write(self.out / "table.md", text.encode())
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for folder in ("logs", "files"):
                for path in sorted((self.ctx.work / folder).rglob("*")):
                    if path.is_file():
                        tar.add(path, arcname=str(path.relative_to(self.ctx.work / folder)))
        atomic_write(self.out / "logs.tar.gz", buffer.getvalue())

    def skip(self, rows: list[Row], why: str) -> None:
        for row in rows:
            self.record({"row": row.name, "status": SKIPPED, "ok": False, "note": why})

    # -- processes

    def run(self) -> None:
        for group in batches(self.plan, self.rows, self.ctx.overrides):
            process = self.plan.processes[group[0].process]
            setup = self.by_name.get("setup/models")
            if process.models and (setup is None or setup["status"] != OK):
                self.skip(group, "setup/models did not succeed")
                continue
            self.run_group(group)

    def run_group(self, rows: list[Row]) -> None:
        pending = list(rows)
        while pending:
            own, borrowed, cap = self.cap(pending[0], first=True)
            if self.left() < MIN_CAP_S:
                self.skip(pending, "past --deadline")
                return
            self.processes += 1
            tag = f"p{self.processes:02d}-{pending[0].process}"
            folder = self.ctx.work / "runs" / tag
            cmd = command(self.plan, pending, self.ctx, folder)
            log = self.ctx.work / "logs" / f"{tag}.log"
            process = self.plan.processes[pending[0].process]
            # A child row may shorten its own work to its cap (bert_squad/defaults' rounds).
            env = {**self.env, **dict(process.env), "GPU_CHECK_BUDGET_S": f"{cap:.0f}"}
            with log.open("w", encoding="utf-8") as f:
                f.write("".join(f"{k}={v} " for k, v in process.env) + f"$ {shlex.join(cmd)}\n")
                f.flush()
                self.proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=os.setpgrp,  # its own group: stopped with accelerate's ranks
                )
            done = self.watch(pending, tag, folder, cmd, log, (own, borrowed, cap))
            self.stop(grace=EXIT_GRACE_S if done == len(pending) else 0.0)
            pending = pending[done:]

    def watch(
        self,
        rows: list[Row],
        tag: str,
        folder: Path,
        cmd: list[str],
        log: Path,
        caps: tuple[float, float, float],
    ) -> int:
        """Record the rows of one process as they end; returns how many were recorded (the
        process must be stopped when that is fewer than all)."""
        assert self.proc is not None
        kind = self.plan.processes[rows[0].process].kind
        kind = "child" if kind == "child" else "train"
        index, began = 0, time.monotonic()
        own, borrowed, cap = caps
        while index < len(rows):
            job = folder / str(index)
            found = outcome(kind, job)
            exited = self.proc.poll() is not None
            if found is None and exited:
                found = outcome(kind, job)  # written just before it exited
                if found is None:
                    text = log.read_text(encoding="utf-8", errors="replace")
                    rc = self.proc.returncode
                    error = last_error(text) or "no output"
                    found = {"status": FAILED, "fatal": True, "error": f"{error} (exit {rc})"}
            used = time.monotonic() - began
            if found is None and used > cap:
                found = {
                    "status": TIMED_OUT,
                    "fatal": True,
                    "error": f"timed out after {cap:.0f} s (cap {own:.0f} s"
                    + (f" + {borrowed:.0f} s unused by earlier rows)" if borrowed else ")"),
                }
            if found is None:
                time.sleep(POLL_S)
                continue
            self.bank = max(self.bank + own - used, 0.0)
            if found.get("fatal"):  # the process runs no more rows: its log is complete now
                self.stop(grace=0.0)
                with log.open("a", encoding="utf-8") as f:
                    f.write(found.get("traceback", ""))  # Hydra prints it only at the sweep's end
                    f.write(
                        f"\n[gpu_check] {rows[index].name}: {found['error']}; process stopped\n"
                    )
            self.finish_row(rows[index], found, used, own, borrowed, tag, job, cmd)
            if found.get("fatal"):
                return index + 1
            index += 1
            if index < len(rows):
                began = time.monotonic()
                own, borrowed, cap = self.cap(rows[index], first=False)
                if self.left() < MIN_CAP_S:
                    return index  # past --deadline: the rest are skipped
        return index

    def finish_row(
        self,
        row: Row,
        found: dict,
        used: float,
        own: float,
        borrowed: float,
        tag: str,
        job: Path,
        cmd: list[str],
    ) -> None:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", row.name)
        keep = self.ctx.work / "files" / slug
        if job.is_dir():
            for path in job.iterdir():
                if path.is_file() and path.suffix in KEPT and path.stat().st_size < 2**22:
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, keep / path.name)
        status = found.get("status")
        if status == "done":
            status = OK if found.get("ok") else FAILED
        # On the device, a launch that fell back to one plain process did not check FSDP.
        expected = self.plan.processes[row.process].distributed
        ran = found.get("distributed") or "NO"
        if status == OK and expected and not self.ctx.dry_run and ran != expected:
            status, found["note"] = FAILED, f"ran as {ran}, not {expected}"
        rec = {
            "row": row.name,
            "kind": self.plan.processes[row.process].kind,
            "status": status,
            "ok": status == OK,
            "seconds": round(used, 1),
            "cap_s": round(own, 1),
            "borrowed_s": round(borrowed, 1),
            **{k: v for k, v in found.items() if k not in ("status", "fatal", "ok", "traceback")},
            "log": f"logs.tar.gz:{tag}.log",
            "files": f"logs.tar.gz:{slug}/" if keep.exists() else None,
            "command": shlex.join(cmd),
        }
        self.record(rec)

    def stop(self, grace: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def atomic_write(path: Path, data: bytes) -> None:
    """Whole or not at all: these files are polled while rows run (the Hydra callback writes
    its job files with it too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ------------------------------------------------------------------------ rows in a child


def child_models(folder: Path, dry_run: bool) -> dict:
    """Randomly initialised models of real shapes, saved for train.py: bert-large-uncased for
    QA (hidden 1024, 24 layers, 16 heads, FFN 4096, BERT's 30,522-token vocabulary size) with
    the bundled uncased tokenizer, and a Llama of SmolLM2-135M's shape (576 wide, 30 layers,
    9 heads, 3 KV heads, 49,152 tokens) with the bundled tiny Llama's tokenizer. --dry-run cuts
    both to 2 layers and their vocabularies to their tokenizers', and BERT to 256 wide (4 heads
    of 64, FFN 1,024): what a CPU trains quickly (at full width the bert rows' steps took 3-6 s
    each on one thread, half the CPU dry run's time, for the same code path)."""
    import torch
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForQuestionAnswering,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    bert_layers, llama_layers = (2, 2) if dry_run else (24, 30)
    bert_hidden, bert_heads = (256, 4) if dry_run else (1024, 16)
    bert_tokenizer = AutoTokenizer.from_pretrained(ASSETS / "minilm-squad")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    bert = BertForQuestionAnswering(
        BertConfig(
            vocab_size=len(bert_tokenizer) if dry_run else 30522,
            hidden_size=bert_hidden,
            num_hidden_layers=bert_layers,
            num_attention_heads=bert_heads,
            intermediate_size=4 * bert_hidden,
            max_position_embeddings=512,
        )
    )
    bert.save_pretrained(folder / "bert-large-qa")
    bert_tokenizer.save_pretrained(folder / "bert-large-qa")
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer) if dry_run else 49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=llama_layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    llama.save_pretrained(folder / "llama-135m")
    tokenizer.save_pretrained(folder / "llama-135m")
    sizes = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (bert, llama)]
    return {
        "ok": True,
        "note": f"bert-large QA, {bert_layers} layers {bert_hidden} wide, {sizes[0]:.0f}M "
        "parameters; Llama "
        f"(SmolLM2-135M shape), {llama_layers} layers, {sizes[1]:.0f}M",
    }


def child_sdpa_probe(dry_run: bool) -> dict:
    from recipes import device, env

    backend = device.backend()
    probe = env.sdpa_probe(env._probe_device(backend), env._probe_dtypes(backend))
    return {"ok": probe["ok"], "note": env._probe_text(probe)}


def child_adamw_fused(dry_run: bool) -> dict:
    """The AdamW the project builds here (``fused: null``; and ``fused: true``) against the
    foreach one (``fused: false``): the same parameters after 20 steps on the same gradients,
    and the time of one step over bert-large's encoder weights (302M parameters)."""
    import torch

    from recipes import device
    from recipes.optim import build_optimizer

    backend = device.backend()
    target = torch.device(f"{backend}:0" if backend != device.CPU else backend)
    make = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)

    def model(width: int, layers: int) -> torch.nn.Module:
        blocks = []
        for _ in range(layers):  # one BERT layer: 4 projections and the feed-forward pair
            blocks += [torch.nn.Linear(width, width) for _ in range(4)]
            blocks += [torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)]
            blocks.append(torch.nn.LayerNorm(width))
        return torch.nn.Sequential(*blocks)

    def build(fused: bool | None, net: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(functools.partial(make, fused=fused), net, target)

    def describe(opt: torch.optim.Optimizer) -> str:
        return f"{type(opt).__name__} fused={opt.param_groups[0].get('fused')}"

    # The same parameters: built on the CPU and moved, as the loop does.
    torch.manual_seed(0)
    nets = {key: model(64, 2) for key in ("null", "true", "false")}
    for net in nets.values():
        net.load_state_dict(nets["null"].state_dict())
    opts: dict[str, torch.optim.Optimizer] = {}
    notes = []
    for key, fused in (("null", None), ("true", True), ("false", False)):
        try:
            opts[key] = build(fused, nets[key])
        except (RuntimeError, ValueError) as err:
            notes.append(f"fused=true refused: {str(err).splitlines()[0][:120]}")
    for net in nets.values():
        net.to(target)
    for i in range(20):
        for key, opt in opts.items():
            net = nets[key]
            net.zero_grad()
            x = torch.full((8, 64), 0.01 * (i + 1), device=target)
            net(x).pow(2).sum().backward()
            opt.step()

    def diff(key: str) -> float:
        pairs = zip(nets[key].parameters(), nets["false"].parameters(), strict=True)
        return max(float((a - b).detach().abs().max()) for a, b in pairs)

    diffs = {key: diff(key) for key in opts if key != "false"}
    ok = all(d < 1e-4 for d in diffs.values())

    # Speed: one step over many parameters, gradients in place.
    width, layers = (256, 2) if dry_run else (1024, 24)
    timing = {}
    for key, fused in (("null", None), ("false", False)):
        torch.manual_seed(0)
        with torch.device(target):
            net = model(width, layers)
        for p in net.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = build(fused, net)
        for _ in range(3):
            opt.step()
        device.synchronize(target)
        started = time.perf_counter()
        steps = 5 if dry_run else 20
        for _ in range(steps):
            opt.step()
        device.synchronize(target)
        timing[key] = (time.perf_counter() - started) / steps * 1e3
        count = sum(p.numel() for p in net.parameters())
        del net, opt
    speed = timing["false"] / timing["null"]
    notes.insert(
        0,
        f"{describe(opts['null'])}: {timing['null']:.2f} ms/step against foreach "
        f"{timing['false']:.2f} ms ({speed:.2f}x) on {count / 1e6:.0f}M parameters; after 20 "
        "steps max parameter difference "
        + ", ".join(f"fused={k} {v:.1e}" for k, v in diffs.items()),
    )
    return {"ok": ok, "note": "; ".join(notes), "speedup": speed}


def child_host_sync(dry_run: bool) -> dict:
    """What one ``.tolist()`` per step (the loop's non-finite / stop agreement) costs."""
    import torch

    from recipes import device

    backend = device.backend()
    target = torch.device(f"{backend}:0" if backend != device.CPU else backend)
    layer = torch.nn.Linear(1024, 1024).to(target)
    x = torch.randn(64, 1024, device=target)
    count = 20 if dry_run else 200

    def steps(sync: bool) -> float:
        device.synchronize(target)
        started = time.perf_counter()
        for _ in range(count):
            loss = layer(x).square().mean()
            loss.backward()
            if sync:
                torch.stack([~torch.isfinite(loss), loss.new_zeros(())]).float().tolist()
        device.synchronize(target)
        return (time.perf_counter() - started) / count

    steps(False)  # warm-up
    plain, synced = steps(False), steps(True)
    return {
        "ok": True,
        "note": f"{(synced - plain) * 1e6:+.0f} us per step on a {plain * 1e3:.2f} ms step",
    }


def child_generate(models: Path, dry_run: bool) -> dict:
    """Batched generation (``recipes/generation.py``, batches of 16) against one prompt at a
    time on the Llama of SmolLM2-135M's shape: seconds of each, and how many greedy answers are
    the same, in fp32 (all must be) and bf16 (padding may round otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes import device, generation
    from recipes.config import GenerationConfig

    backend = device.backend()
    target = torch.device(f"{backend}:0" if backend != device.CPU else backend)
    tokenizer = AutoTokenizer.from_pretrained(models / "llama-135m")
    rows = (ASSETS / "conversations" / "squad" / "dev.jsonl").read_text().splitlines()
    count, new = (8, 8) if dry_run else (64, 64)
    texts = [json.loads(row)["messages"][0]["content"] for row in (rows * 4)[:count]]
    prompts = [tokenizer(t)["input_ids"][-512:] for t in texts]
    notes, ok, speedup = [], True, None
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(models / "llama-135m", dtype=dtype)
        model.to(target).eval()
        seconds = {}
        answers = {}
        for side, size in (("batched", 16), ("alone", 1)):
            device.synchronize(target)
            started = time.perf_counter()
            # batch_size=1 runs the same code one prompt at a time: the peer's way.
            answers[side] = generation.complete(
                model, prompts, tokenizer, GenerationConfig(batch_size=size), new
            )
            device.synchronize(target)
            seconds[side] = time.perf_counter() - started
        same = sum(a == b for a, b in zip(answers["batched"], answers["alone"], strict=True))
        name = str(dtype).removeprefix("torch.")
        speed = seconds["alone"] / seconds["batched"]
        notes.append(
            f"{name}: {seconds['batched']:.2f} s batched, {seconds['alone']:.2f} s one at a "
            f"time ({speed:.1f}x), {same}/{count} answers the same"
        )
        if dtype == torch.float32:
            ok = same == count
        else:
            speedup = speed
        del model
    return {"ok": ok, "note": "; ".join(notes), "speedup": speedup}


# ------------------------------------------------------------------------ issue 44's children


def _budget(default: float) -> float:
    """Seconds this child row may run (its cap, from the runner)."""
    return float(os.environ.get("GPU_CHECK_BUDGET_S") or default)


def _throughput() -> Any:
    """scripts/throughput.py as a module (its peers and its train.py runner are reused)."""
    import importlib

    return importlib.import_module("scripts.throughput")


def _precision(dry_run: bool) -> str:
    from recipes import device

    if dry_run:
        return "no"  # the CPU's quickest, and the Trainer refuses fp16 there
    return "bf16" if device.supports_bf16() else "fp16"


def _mfu(model_dir: Path, side: dict, precision: str) -> float | None:
    """Model-FLOPs utilisation of real tokens (recipes/flops.py's count: 6 x non-embedding
    weights + 12 x layers x width x mean length, per token) against the device's peak."""
    import torch
    from transformers import AutoConfig, AutoModelForQuestionAnswering

    from recipes import device

    backend = device.backend()
    if backend == device.CPU:
        return None
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        weights = AutoModelForQuestionAnswering.from_config(config).num_parameters(
            exclude_embeddings=True
        )
    length = side["tokens_per_second"] / side["samples_per_second"]
    per_token = 6.0 * weights + 12.0 * config.num_hidden_layers * config.hidden_size * length
    peak = device.peak_flops(torch.device(f"{backend}:0"), precision)
    return per_token * side["tokens_per_second"] / peak if peak else None


def child_squad_defaults(models: Path, out: Path, dry_run: bool) -> dict:
    """bert-large QA (random weights, setup/models) at the example's shapes (length 384, stride
    128, batch 32) in bf16: ours at the device's own ``trainer.*`` defaults (``throughput.py qa
    --project-defaults``) against run_qa_no_trainer.py's behaviour and the Trainer's (run_qa.py,
    every window padded to 384), each side a fresh process, rounds alternating ours / one peer /
    the other; samples/s, real-token MFU, peak memory, and ours over each peer (medians)."""
    tp = _throughput()
    precision = _precision(dry_run)
    model = models / "bert-large-qa"
    shape = ("128", "32", "4", "2", "2") if dry_run else ("384", "128", "32", "10", "20")
    length, stride, batch, warmup, steps = shape
    common = [
        "qa", "--model", str(model), "--block-size", length, "--doc-stride", stride,
        "--batch-size", batch, "--warmup", warmup, "--steps", steps,
        "--mixed-precision", precision,
    ]  # fmt: skip
    ours_args = tp.parse([*common, "--project-defaults"])
    peers = {p: tp.parse([*common, "--peer", p]) for p in ("run_qa_no_trainer", "run_qa")}
    cache = out / "cache"
    for a in (ours_args, *peers.values()):
        a.cache = cache  # every side trains on the same cached windows
    results: dict[str, list[dict]] = {"ours": [], **{p: [] for p in peers}}
    budget, started = _budget(120), time.monotonic()
    rounds = 1 if dry_run else 2
    for round_ in range(rounds):
        folder = out / f"ours{round_}"
        folder.mkdir(parents=True)
        results["ours"].append(tp.run_ours(ours_args, folder))
        if round_ == 0:  # what the device decided, as train.py logged it
            log = folder / "ours" / "train.log"
            if log.exists():
                shutil.copy2(log, out / "ours_train.log")
        for name, args in peers.items():
            folder = out / f"{name}{round_}"
            folder.mkdir(parents=True)
            results[name].append(tp.run_peer(args, folder))
        used = time.monotonic() - started
        if round_ + 1 < rounds and used * (round_ + 2) / (round_ + 1) > 0.95 * budget:
            break  # another round would pass the row's cap: report this one
    shutil.rmtree(cache, ignore_errors=True)
    summary = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in results.items()
    }
    for side in summary.values():
        side["mfu"] = _mfu(model, side, precision)
    ours = summary["ours"]
    notes = [f"{len(results['ours'])} rounds, {precision}"]
    for name in peers:
        peer = summary[name]
        ours[f"ratio_{name}"] = ours["samples_per_second"] / peer["samples_per_second"]
        mfu = f", MFU {peer['mfu']:.1%}" if peer["mfu"] is not None else ""
        notes.append(
            f"ours / {name}: {ours[f'ratio_{name}']:.2f}x samples/s ({name} "
            f"{peer['samples_per_second']:.1f}{mfu}, peak {peer['peak_memory_mb'] / 1024:.2f} GiB)"
        )
    decided = _defaults_logged(out / "ours_train.log")
    if decided:
        notes.append(f"ours' defaults: {decided}")
    atomic_write(
        out / "squad_defaults.json",
        json.dumps({"summary": summary, "rounds": results}, indent=1).encode(),
    )
    return {
        "ok": True,
        "samples_per_s": ours["samples_per_second"],
        "tokens_per_s": ours["tokens_per_second"],
        "mfu": ours["mfu"],
        "peak_memory_gib": ours["peak_memory_mb"] / 1024,
        "ratios": {p: ours[f"ratio_{p}"] for p in peers},
        "note": "; ".join(notes),
    }


def _defaults_logged(log: Path) -> str:
    """The trainer settings the device decided, as train.py's first lines name them."""
    if not log.exists():
        return ""
    found = {}
    keys = ("padding", "pad_to_multiple_of", "sub_batches", "pin_memory", "compile")
    for line in log.read_text(errors="replace").splitlines()[:200]:
        for key in keys:
            hit = re.search(rf"\b(?:trainer\.)?{key}\s*[=:]\s*([\w.]+)", line)
            if hit and key not in found:
                found[key] = hit.group(1)
    return ", ".join(f"{k}={found[k]}" for k in keys if k in found)


def squad_files(data: Path | None) -> tuple[Path, Path, str]:
    """(train, dev, where from): the slices gpu_check_wheels.py --data staged, the shared data
    beside the checkout, or the bundled slice."""
    for folder, train, dev in (
        (data and data / "squad", "train.json", "dev.json"),
        (data and data / "squad", "train-v1.1-subset.json", "dev-v1.1-part1.json"),
        (ROOT.parent / "shared" / "data" / "squad", "train-v1.1-subset.json",
         "dev-v1.1-part1.json"),
    ):  # fmt: skip
        if folder and (folder / train).exists() and (folder / dev).exists():
            return folder / train, folder / dev, f"SQuAD v1.1 from {folder}"
    bundled = ASSETS / "squad" / "v1"
    return bundled / "train.json", bundled / "dev.json", "the bundled SQuAD slice"


F1_STEPS, F1_LR = 300, 3e-5  # recipe=bert_squad's lr, both sides


def child_squad_f1(data: Path | None, out: Path, dry_run: bool) -> dict:
    """F1 after a short real-data run on both sides: the real 6-layer MiniLM the project bundles
    (recipes/assets/minilm-squad: all-MiniLM-L6-v2, vocabulary cut to the bundled SQuAD text; a
    pretrained bert-large cannot travel to a device machine without a hub), SQuAD v1.1 windows
    of 384 / 128, batch 32, the same steps and lr: ours is train.py recipe=bert_squad at the
    device's defaults with its final evaluation; the peer trains as run_qa_no_trainer.py
    (throughput.py's peer, weights saved) and is scored as that example scores
    (throughput.py qa-eval's peer)."""
    tp = _throughput()
    precision = _precision(dry_run)
    model = ASSETS / "minilm-squad"
    train, dev, source = squad_files(data)
    steps, warmup = (4, 2) if dry_run else (F1_STEPS, 10)
    train_q, dev_q = (64, 16) if dry_run else (6000, 1000)
    sliced = out / "data"
    counts = (
        squad_slice(train, sliced / "train.json", train_q),
        squad_slice(dev, sliced / "dev.json", dev_q),
    )
    train, dev = sliced / "train.json", sliced / "dev.json"
    cache = out / "work" / "cache"
    shape = ("128", "32") if dry_run else ("384", "128")
    run_dir = out / "work" / "ours"
    records = tp._train_records(
        [
            "recipe=bert_squad",
            f"model.name_or_path={model}",
            f"data.path={ASSETS / 'squad' / 'v1'}",
            f"data.train_file={train}",
            f"data.eval_file={dev}",
            f"data.cache_dir={cache}_ours",
            f"task.max_seq_length={shape[0]}",
            f"task.doc_stride={shape[1]}",
            f"trainer.per_device_train_batch_size={4 if dry_run else 32}",
            f"trainer.max_steps={steps}",
            f"trainer.log_every_n_steps={warmup}",
            f"trainer.mixed_precision={precision}",
            f"optimizer.lr={F1_LR}",
            "trainer.eval_at_end=true",
            "trainer.save_final_model=false",
            "trainer.save_every_n_steps=0",
            "trainer.progress_bar=false",
            "logger=none",
            f"output_dir={run_dir}",
        ],
        run_dir,
    )
    ours = next(r for r in reversed(records) if "eval/f1" in r)
    if (run_dir / "train.log").exists():
        shutil.copy2(run_dir / "train.log", out / "ours_train.log")
    common = [
        "--model", str(model), "--train-file", str(train), "--block-size", shape[0],
        "--doc-stride", shape[1], "--batch-size", "4" if dry_run else "32",
        "--mixed-precision", precision, "--lr", str(F1_LR),
    ]  # fmt: skip
    peer_args = tp.parse(
        ["qa", *common, "--warmup", str(warmup), "--steps", str(steps - warmup),
         "--save-model", str(cache.parent / "evaluated-model")]
    )  # fmt: skip
    eval_args = tp.parse(["qa-eval", *common, "--eval-file", str(dev)])
    peer_args.cache = eval_args.cache = cache
    for name, args in (("peer_train", peer_args), ("peer_eval", eval_args)):
        (out / "work" / name).mkdir(parents=True)
        result = tp.run_peer(args, out / "work" / name)
    shutil.rmtree(out / "work", ignore_errors=True)
    shutil.rmtree(sliced, ignore_errors=True)
    f1, peer_f1 = ours["eval/f1"], result["f1"]
    ok = math.isfinite(f1) and math.isfinite(peer_f1)
    note = (
        f"F1 ours {f1:.2f} (EM {ours.get('eval/exact_match', math.nan):.2f}) against "
        f"run_qa_no_trainer {peer_f1:.2f} (EM {result['exact_match']:.2f}) after {steps} steps "
        f"of batch {peer_args.batch_size}, lr {F1_LR:g}, {precision}; MiniLM-L6 (the bundled "
        f"minilm-squad: a real bert-large cannot travel); {counts[0]} train / {counts[1]} dev "
        f"questions of {source}"
    )
    return {"ok": ok, "f1": f1, "peer_f1": peer_f1, "note": note}


def child_llm_peer(kind: str, out: Path, dry_run: bool) -> dict:
    """``scripts/throughput.py sft`` / ``grpo`` (ours against TRL's trainer), read from the
    JSON it writes (``ratio``, ``note``); a throughput.py without the subcommand fails the row
    in one line."""
    from recipes import device

    target = device.backend()
    report = out / f"{kind}.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "throughput.py"), kind]
    cmd += ["--device", target, "--json", str(report)]
    if dry_run:  # its smallest setting, one alternation of 2 + 2 steps: the path, not a speed
        cmd += ["--rounds", "1", "--warmup", "2", "--steps", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / f"{kind}.log").write_text(f"$ {shlex.join(cmd)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        if f"invalid choice: '{kind}'" in done.stderr:
            error = f"scripts/throughput.py has no '{kind}' subcommand (not merged yet)"
        else:
            error = last_error(done.stdout + done.stderr) or f"exit {done.returncode}"
        return {"ok": False, "error": error}
    if not report.exists():
        return {"ok": False, "error": f"throughput.py {kind} wrote no {report.name}"}
    found = _read_json(report)
    ratio = found.get("ratio")
    return {
        "ok": ratio is not None,
        "ratio": ratio,
        "note": f"ours / TRL {ratio:.2f}x; {found.get('note', '')}" if ratio else "no ratio",
    }


def child_continuous(models: Path, out: Path, dry_run: bool) -> dict:
    """Batched generation (``recipes/generation.py``, batches of 16, length-sorted and padded)
    against transformers' continuous batching (``generate_batch``: paged KV cache, requests
    scheduled token by token) on the SmolLM2-shaped Llama (random weights), greedy, in the
    device's half precision: generated tokens/s of each (medians of alternating rounds, after
    one untimed call each) and how many answers are the same."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import GenerationConfig as HFGenerationConfig

    from recipes import device, generation
    from recipes.config import GenerationConfig

    backend = device.backend()
    target = torch.device(f"{backend}:0" if backend != device.CPU else backend)
    folder = models / "llama-135m"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dtype = torch.float32 if dry_run else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(target).eval()
    if not hasattr(model, "generate_batch"):
        return {
            "ok": True,
            "note": f"transformers {transformers.__version__} has no continuous batching "
            "(generate_batch): nothing to compare",
        }
    rows = (ASSETS / "conversations" / "squad" / "dev.jsonl").read_text().splitlines()
    count, new = (8, 8) if dry_run else (64, 64)
    texts = [json.loads(row)["messages"][0]["content"] for row in (rows * 4)[:count]]
    prompts = [tokenizer(t)["input_ids"][-512:] for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = HFGenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )  # fmt: skip
    extra: dict[str, Any] = {}
    if dry_run:  # the default paged cache is sized to the memory: far too big for a CPU
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        extra = {
            "continuous_batching_config": ContinuousBatchingConfig(
                num_blocks=64, max_batch_tokens=512
            ),
            "warmup": False,
        }

    def ours(batch: list[list[int]]) -> list[str]:
        config = GenerationConfig(batch_size=16)
        return generation.complete(model, batch, tokenizer, config, new)

    def continuous(batch: list[list[int]]) -> list[str]:
        with torch.no_grad():
            done = model.generate_batch(
                inputs=batch, generation_config=config, progress_bar=False, **extra
            )
        ordered = sorted(done.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
        return [tokenizer.decode(o.generated_tokens, skip_special_tokens=True) for o in ordered]

    sides = {"batched": ours, "continuous": continuous}
    for run in sides.values():
        run(prompts[:4])  # untimed: first calls
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    answers: dict[str, list[str]] = {}
    for _ in range(1 if dry_run else 2):
        for side, run in sides.items():
            device.synchronize(target)
            started = time.perf_counter()
            answers[side] = run(prompts)
            device.synchronize(target)
            seconds[side].append(time.perf_counter() - started)
    tokens = {
        side: sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in texts)
        for side, texts in answers.items()
    }
    speed = {side: tokens[side] / statistics.median(seconds[side]) for side in sides}
    same = sum(a == b for a, b in zip(answers["batched"], answers["continuous"], strict=True))
    ratio = speed["batched"] / speed["continuous"]
    name = str(dtype).removeprefix("torch.")
    return {
        "ok": True,
        "tokens_per_s": speed["batched"],
        "ratio": ratio,
        "note": f"generation.complete {speed['batched']:,.0f} tokens/s against continuous "
        f"batching {speed['continuous']:,.0f} ({ratio:.2f}x); {same}/{count} greedy answers "
        f"the same ({name}, {count} prompts, {new} new tokens; transformers "
        f"{transformers.__version__})",
    }


def child_rollouts(models: Path, out: Path, dry_run: bool) -> dict:
    """scripts/bench_rollouts.py on the SmolLM2-shaped Llama (random weights: every completion
    runs to its length limit) in the device's half precision: a GRPO step's sampling, 8 prompts
    x 8 generations x 32 new tokens, by the batched engine, generation.engine=continuous and
    TRL's GRPOTrainer with transformers' continuous batching; its ratio lines as the note."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_rollouts

    load = ["--prompts", "2", "--num-generations", "2", "--max-completion-length", "4"]
    argv = ["--model", str(models / "llama-135m"), "--out", str(out / "rollouts.json")]
    argv += [*load, "--rounds", "1"] if dry_run else ["--rounds", "3"]
    found = bench_rollouts.main(argv)
    speed, ratios = found["tokens_per_s"], found["ratios"]
    return {
        "ok": all(v > 0 for v in speed.values()),
        "tokens_per_s": speed.get("continuous"),
        "ratio": ratios.get("continuous/batched"),
        "note": "rollout tokens/s: "
        + ", ".join(f"{side} {v:,.0f}" for side, v in speed.items())
        + "; ratio "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
        + f" ({found['load']})",
    }


CHILDREN = {
    "sdpa_probe": child_sdpa_probe,
    "adamw_fused": child_adamw_fused,
    "host_sync": child_host_sync,
}


def run_child(name: str, out: Path, models: Path, dry_run: bool, data: Path | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    if name == "models":
        models.mkdir(parents=True, exist_ok=True)
        result = child_models(models, dry_run)
    elif name == "generate":
        result = child_generate(models, dry_run)
    elif name == "squad_defaults":
        result = child_squad_defaults(models, out, dry_run)
    elif name == "squad_f1":
        result = child_squad_f1(data, out, dry_run)
    elif name in ("sft", "grpo"):
        result = child_llm_peer(name, out, dry_run)
    elif name == "continuous":
        result = child_continuous(models, out, dry_run)
    elif name == "rollouts":
        result = child_rollouts(models, out, dry_run)
    elif name == QWEN_LORA_ROW.value:
        result = child_qwen3_4b_lora(out, dry_run)
    elif name.startswith("large:"):
        result = child_large_lora(name, models, out, dry_run)
    else:
        result = CHILDREN[name](dry_run)
    atomic_write(out / "result.json", (json.dumps(result) + "\n").encode())
    return 0


# ------------------------------------------------------------- large models, LoRA (issue 56)

# Issue 56's rows (only with --only 'large/*'): LoRA SFT of random-weight models in Qwen3's real
# shapes through train.py against TRL's SFTTrainer (scripts/memory_vs_trl.py runs both), the
# bundled tiny tokenizer's ids under Qwen3's full 151,936-entry output layer. Qwen3-4B, 36
# layers, at ms-swift's MUSA setting (2,048 tokens, batch 4, accumulation 4, rank 8); Qwen3-8B,
# 36 layers, at 4,096 and 8,192 tokens without and with trainer.fused_linear_loss. Each row
# builds its model folder once (under the setup models folder) and reports its peak device
# memory and tokens/s; --dry-run: 2 layers 64 wide, 128 tokens, batch 2, accumulation 2.
LARGE_LORA = {
    # row: (shape, tokens, batch, accumulation, rank, side, cap_s)
    "large/qwen3_4b_ours": ("Qwen/Qwen3-4B", 2048, 4, 4, 8, "ours", 110),
    "large/qwen3_4b_trl": ("Qwen/Qwen3-4B", 2048, 4, 4, 8, "trl", 90),
    "large/qwen3_8b_4096_unfused": ("Qwen/Qwen3-8B", 4096, 1, 1, 16, "unfused", 110),
    "large/qwen3_8b_4096_fused": ("Qwen/Qwen3-8B", 4096, 1, 1, 16, "fused", 40),
    "large/qwen3_8b_8192_unfused": ("Qwen/Qwen3-8B", 8192, 1, 1, 16, "unfused", 50),
    "large/qwen3_8b_8192_fused": ("Qwen/Qwen3-8B", 8192, 1, 1, 16, "fused", 50),
}


def large_lora_plan() -> tuple[Process, list[Row]]:
    """Issue 56's process and rows (optional: only with --only)."""
    rows = []
    for name, (shape, tokens, batch, accumulation, rank, side, cap) in LARGE_LORA.items():
        what = f"{shape} shape LoRA r={rank}, {tokens} tokens, batch {batch}x{accumulation}"
        rows.append(Row(name, "large", cap, f"large:{name}", f"{what}: {side}", optional=True))
    return Process("large", "child", 10), rows


def child_large_lora(value: str, models: Path, out: Path, dry_run: bool) -> dict:
    """One LARGE_LORA row: ours (train.py, fused as the row says; ``ours``: the default) or
    TRL's SFTTrainer, two optimizer steps on packed rows; loss, tokens/s of the last step
    (ours) or of both (TRL), peak device memory."""
    from scripts import memory_vs_trl as peers

    shape, tokens, batch, accumulation, rank, side, _ = LARGE_LORA[value.split(":", 1)[1]]
    changes: dict[str, Any] = {"vocab_size": 151936}  # Qwen3's output layer, whatever the ids
    layers = 36
    if dry_run:
        tokens, batch, accumulation, layers = 128, 2, 2, 2
        changes |= {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
        changes |= {"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2000}
    model_dir = models / f"large-{shape.split('/')[1]}{'-dry' if dry_run else ''}"
    if not (model_dir / "config.json").exists():
        peers.prepare_model(model_dir, shape, layers, ASSETS / "tiny-llama", **changes)
    data = out / "rows"
    peers.write_rows(data, model_dir, tokens, 4 * batch * accumulation * 2)
    steps = 2
    if side == "trl":
        found = peers.run_trl(model_dir, data, tokens, out / "trl", batch, accumulation, rank, 2)
        return {
            "ok": True,
            "loss": found["loss"],
            "tokens_per_s": found["tokens_per_s"],
            "peak_memory_gib": found["peak_gib"],
            "note": f"TRL SFTTrainer (packing, its fused LM head), train() {found['seconds']:.0f} s",
        }
    from recipes import device

    precision = "no" if device.backend() == device.CPU else "bf16"
    cmd = peers.ours_command(
        model_dir,
        data,
        tokens,
        out / "ours",
        side == "fused",
        batch,
        accumulation,
        rank,
        steps,
        precision,
    )
    if side == "ours":  # the run's default for trainer.fused_linear_loss
        cmd = [c for c in cmd if not c.startswith("trainer.fused_linear_loss=")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "train.log").write_text(f"$ {shlex.join(cmd)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        return {"ok": False, "error": last_error(done.stdout + done.stderr) or "train.py failed"}
    found = train_metrics(out / "ours")
    log = (out / "ours" / "train.log").read_text(errors="replace")
    fused = re.search(r"trainer\.fused_linear_loss[:=] ?(\w+)", log)
    found["note"] = f"fused_linear_loss {fused.group(1) if fused else '?'}; {found['note']}"
    return found


# ---------------------------------------------------------------------------------- wheels


def install_wheels(folder: Path, target: Path) -> list[str]:
    """Install the wheels of ``folder`` into ``target`` (nothing else is touched: no
    dependencies, no index) and put it first on the path of this process and its children.
    Returns the carried wheels' requirements this environment does not meet."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there")
    subprocess.run(
        [*PIP_INSTALL, "--target", str(target), *map(str, wheels)],
        check=True,
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(target), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.path.insert(0, str(target))
    import importlib

    importlib.invalidate_caches()
    return unmet_requirements(wheels)


def unmet_requirements(wheels: list[Path]) -> list[str]:
    import importlib.metadata

    from scripts.gpu_check_wheels import metadata

    problems = []
    for wheel in wheels:
        project = wheel.name.split("-")[0]
        for req in metadata(wheel):
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{project} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{project} needs {req}: {req.name} {have} is installed")
    return problems


def missing_imports() -> str | None:
    """The first of train.py's libraries that does not import here (before any row runs)."""
    import importlib

    for name in ("omegaconf", "hydra", "datasets", "transformers", "accelerate", "peft"):
        try:
            importlib.import_module(name)
        except Exception as err:  # an ImportError, or a library too old for its dependencies
            return f"import {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    # The callback train.py loads by this name (ROOT is first on its path, as here).
    hook = importlib.import_module(CALLBACK.split("=")[1].rsplit(".", 1)[0])
    if Path(str(hook.__file__)).resolve().parent != Path(__file__).resolve().parent:
        return f"another 'scripts' package shadows this checkout's: {hook.__file__}"
    return None


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the rows and caps; run nothing")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every row here (the CPU stands in for the device), shrunk to 2 steps",
    )
    parser.add_argument("--out", type=Path, help="folder for rows.jsonl, table.md, logs.tar.gz")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="rows whose name matches (a glob, or a substring); repeatable",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="[PATTERN:]KEY=VALUE",
        help="a train.py override for every train row (or those PATTERN matches); repeatable",
    )
    parser.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="[PATTERN=]SECONDS",
        help="set the time cap of every row (or those PATTERN matches); repeatable",
    )
    parser.add_argument(
        "--cap-scale",
        type=float,
        help=f"multiply every cap (default 1, {DRY_CAP_SCALE:g} with --dry-run)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds from the start after which no row starts (default 540 on a device)",
    )
    parser.add_argument(
        "--wheels", type=Path, help="install these wheels into --site first (no index, no deps)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        help="SQuAD slices for bert_squad/f1 (default: <--wheels>/gpu_check_data, staged by "
        "gpu_check_wheels.py, else ../shared/data, else the bundled slice)",
    )
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "gpu_check_site")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--models-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.data is None and args.wheels and (args.wheels / DATA_FOLDER).is_dir():
        args.data = args.wheels / DATA_FOLDER
    if args.data is None and (ROOT.parent / "shared" / "data").is_dir():
        args.data = ROOT.parent / "shared" / "data"
    if args.child:
        return run_child(args.child, args.child_out, args.models_dir, args.dry_run, args.data)

    unmet: list[str] = []
    if args.wheels:
        unmet = install_wheels(args.wheels, args.site)
        for line in unmet:
            sys.stderr.write(f"warning: {line}\n")

    try:
        overrides = parse_overrides(args.override)
        caps = []
        for value in args.cap:
            pattern, eq, seconds = value.rpartition("=")
            caps.append((pattern if eq else None, float(seconds)))
    except ValueError as err:
        parser.error(str(err))

    import torch

    from recipes import device, env

    backend = device.backend()
    precision = "bf16" if device.supports_bf16() else "fp16"
    versions = {"torch": torch.__version__, "accelerate": env._dist_version("accelerate")}
    fsdp = "fsdp2" if "(FSDP2)" in env._fsdp_config({"versions": versions}) else "fsdp"
    plan = build_plan(precision, str(ROOT / "conf" / "accelerate" / f"{fsdp}.yaml"))
    rows = select(plan, args.only)
    if not rows:
        sys.stderr.write(f"no row matches --only {' '.join(args.only)}\n")
        return 2
    scale = args.cap_scale or (DRY_CAP_SCALE if args.dry_run else 1.0)
    if args.plan:
        print_plan(
            plan,
            rows,
            Context("python", args.work or Path("<work>"), args.dry_run, overrides, args.data),
            scale,
        )
        return 0
    if backend == device.CPU and not args.dry_run:
        sys.stderr.write(
            "gpu_check needs a MUSA or CUDA device; this machine has none (--dry-run runs every "
            "row here on the CPU, --plan lists them).\n"
        )
        return 2

    missing = missing_imports()
    if missing:
        fix = (
            "the carried wheels do not fit this machine's packages (the warnings above name "
            "them): fetch other releases with scripts/gpu_check_wheels.py"
            if args.wheels
            else "on a machine without hydra-core, omegaconf or datasets, fetch their wheels "
            "with scripts/gpu_check_wheels.py and add --wheels .whl"
        )
        sys.stderr.write(f"gpu_check: train.py cannot run here ({missing}); {fix}.\n")
        return 2
    out = args.out or ROOT / "outputs" / "gpu_check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}"
    if out.exists() and any(out.iterdir()):
        sys.stderr.write(f"--out {out}: not empty; name a new folder\n")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(sys.executable, work, args.dry_run, overrides, args.data)
    names = ", ".join(device.device_names()) or "CPU"
    stack = ", ".join(
        f"{name} {env._dist_version(name) or 'MISSING'}"
        for name in ("accelerate", "transformers", "datasets", "peft", "hydra-core")
    )
    header = [
        f"# GPU check, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {names} ({backend})",
        "",
        f"torch {torch.__version__}, {stack}; precision {precision}; attention auto = "
        f"{device.default_attn_implementation()}; python {sys.version.split()[0]}",
    ]
    if args.dry_run:
        header.append(
            "DRY RUN: every row's code path on this machine, shrunk (2 steps, 2-layer models, "
            "short sequences); its numbers say nothing about a device."
        )
    header += [f"wheels: {line}" for line in unmet]
    total = caps_of(plan, rows, overrides) * scale
    header.append(f"{len(rows)} rows planned, caps {total:.0f} s in all.")
    # A device run must end inside the device tool's 600 s per command, with the start-ups,
    # exit graces and restarts the caps leave out: no row starts after 540 s unless asked.
    deadline = args.deadline if args.deadline is not None else (None if args.dry_run else 540.0)
    runner = Runner(plan, rows, ctx, out, header, scale, caps, deadline)

    def stopped(signum: int, frame: Any) -> None:
        runner.stop(grace=0.0)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    sys.stdout.write(f"GPU check: {len(rows)} rows, caps {total:.0f} s; writing to {out}\n")
    sys.stdout.flush()
    runner.write_files()
    try:
        runner.run()
    finally:
        runner.stop(grace=0.0)
        runner.write_files()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write((out / "table.md").read_text(encoding="utf-8"))
    failed = [r["row"] for r in runner.records if r["status"] in (FAILED, TIMED_OUT, SKIPPED)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
