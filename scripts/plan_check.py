"""The memory plan against measured peaks, over a grid of settings (issue 56).

    python scripts/plan_check.py                          # the grid, on the emulated MUSA card
    python scripts/plan_check.py --cpu                    # measured as peak RSS instead
    python scripts/plan_check.py --points full-ckpt-512 lora-2048

Each point is one ``train.py`` run (its own process, one at a time: the larger points need a
few GiB) of SFT on a real-shaped, reduced-depth model (``recipes.model_shapes.reduced``:
Qwen3-0.6B cut to 2 layers, random weights, built once into a temporary folder), packed rows of
``task.max_seq_length`` tokens with every token labelled (``task.train_on_prompt=true``), two
optimizer steps. The run logs its plan next to its measured peak (recipes/memory.py); this
script prints them side by side with the error. On the emulated card (scripts/emulated_musa.py)
the peak is the card allocator's ``max_memory_allocated``, what a real card reports; with
``--cpu`` it is the process's peak resident memory (which counts Python, torch and the data).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "Qwen/Qwen3-0.6B"
TOKENIZER = ROOT / "recipes" / "assets" / "tiny-llama"

# name -> overrides; the grid of issue 56 (full / LoRA, checkpointing on / off, 512 / 2048
# tokens, 8192 once).
GRID: dict[str, list[str]] = {}
for _method in ("full", "lora"):
    for _ckpt in ("ckpt", "nockpt"):
        for _length in (512, 2048):
            GRID[f"{_method}-{_ckpt}-{_length}"] = [
                f"peft={'lora' if _method == 'lora' else 'none'}",
                f"trainer.gradient_checkpointing={'true' if _ckpt == 'ckpt' else 'false'}",
                f"task.max_seq_length={_length}",
            ]
GRID["lora-ckpt-8192"] = ["peft=lora", "trainer.gradient_checkpointing=true"]
GRID["lora-ckpt-8192"].append("task.max_seq_length=8192")
GRID["lora-ckpt-2048-offload"] = [*GRID["lora-ckpt-2048"], "trainer.activation_offload=true"]
GRID["full-nockpt-2048-offload"] = [
    *GRID["full-nockpt-2048"],
    "trainer.activation_offload=true",
]
# Under accelerate's FSDP2 (conf/accelerate/fsdp2.yaml) on one and on two cards (the emulated
# card only: accelerate refuses FSDP on CPU processes), each card's peak against the plan of its
# share: the weights, gradients and optimizer state sharded, the activations whole.
FSDP_POINTS: dict[str, int] = {}  # name -> processes
for _base, _cards in (
    ("full-ckpt-512", (1, 2)),
    ("full-ckpt-2048", (1, 2)),
    ("lora-ckpt-2048", (2,)),
):
    for _n in _cards:
        FSDP_POINTS[f"{_base}-fsdp2x{_n}"] = _n
        GRID[f"{_base}-fsdp2x{_n}"] = GRID[_base]
# Evaluation after training, 2 packed rows at once: its logits are the run's peak.
GRID["lora-ckpt-2048-eval"] = [
    *GRID["lora-ckpt-2048"],
    "trainer.eval_at_end=true",
    "trainer.per_device_eval_batch_size=2",
    "data.max_eval_examples=16",
]


def build_model(folder: Path, layers: int = 2) -> Path:
    """The reduced model with random weights and a small tokenizer (ids below its vocabulary)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipes.model_shapes import reduced

    shape = reduced(MODEL, layers)
    config = AutoConfig.for_model(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    from transformers import AutoTokenizer

    # ChatML's turn markers already in the tokenizer, as in Qwen3's own: a run that had to add
    # them would train their embedding rows, and with them the tied output layer (the unfused
    # loss under LoRA), which no real Qwen3 run does.
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.save_pretrained(folder)
    return folder


def overrides_of(name: str, model: Path, out: Path) -> list[str]:
    return [
        "recipe=llama_sft",
        f"model.name_or_path={model}",
        "model.gguf_file=null",
        "task.packing=true",
        "task.train_on_prompt=true",
        "task.num_generations=0",
        "task.chat_template=chatml",
        "trainer.per_device_train_batch_size=1",
        "trainer.max_steps=2",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        "trainer.save_every_n_steps=0",
        "trainer.progress_bar=false",
        "logger=none",
        f"output_dir={out / name}",
        *GRID[name],
    ]


def run_point(name: str, model: Path, out: Path, cpu: bool, reuse: bool) -> dict[str, float]:
    """The point's measured peak (and its run's seconds), from its run folder when ``reuse``
    finds one there already."""
    metrics = out / name / "metrics.jsonl"
    if reuse and metrics.is_file():
        return _memory_metrics(metrics, 0.0)
    if (out / name).exists():
        shutil.rmtree(out / name)
    command = [sys.executable, "train.py", *overrides_of(name, model, out)]
    processes = FSDP_POINTS.get(name)
    if processes and cpu:
        raise SystemExit(f"{name}: FSDP points run on the emulated card only (drop --cpu)")
    if processes:
        launch = ["-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/fsdp2.yaml"]
        launch += ["--num_processes", str(processes), "--main_process_port", str(_free_port())]
        command = [sys.executable, *launch, *command[1:]]
    if not cpu:
        cards = f"--cards={processes or 1}"
        command = [sys.executable, "scripts/emulated_musa.py", cards, "--", *command]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return _memory_metrics(metrics, time.monotonic() - start)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _memory_metrics(metrics: Path, seconds: float) -> dict[str, float]:
    found: dict[str, float] = {"seconds": seconds}
    for line in metrics.read_text().splitlines():
        found.update({k: v for k, v in json.loads(line).items() if k.startswith("memory/")})
    return found


def planned(name: str, model: Path, out: Path, cpu: bool) -> tuple[float, str]:
    """The plan of a point from this checkout's recipes/plan.py (GiB, and its peak phase)."""
    from recipes import plan

    settings = plan.compose(overrides_of(name, model, out))
    processes = FSDP_POINTS.get(name, 1)
    found = plan.plan_settings(
        settings,
        card=None if cpu else "S4000",
        on_cpu=cpu,
        mixed_precision="bf16",
        labelled=1.0,
        processes=processes,
        shard=processes if name in FSDP_POINTS else 1,
        fsdp=name in FSDP_POINTS,
    )
    return found.peak_bytes / plan.GIB, found.peak.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--points", nargs="*", choices=list(GRID), help="default: the grid (no FSDP with --cpu)"
    )
    parser.add_argument("--cpu", action="store_true", help="measure peak RSS on this CPU")
    parser.add_argument("--work", type=Path, default=None, help="folder for the model and runs")
    parser.add_argument(
        "--reuse", action="store_true", help="read the measured peaks of runs already there"
    )
    args = parser.parse_args(argv)
    points = args.points or [p for p in GRID if not (args.cpu and p in FSDP_POINTS)]
    work = args.work or Path(tempfile.gettempdir()) / "plan_check"
    model = build_model(work / "qwen3-0.6b-2-layers")
    where = "peak RSS, CPU" if args.cpu else "max_memory_allocated, emulated MUSA S4000"
    runs = work / ("runs-cpu" if args.cpu else "runs")
    print(f"| point | plan (GiB) | its peak phase | measured (GiB, {where}) | plan error |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for name in points:
        measured = run_point(name, model, runs, args.cpu, args.reuse)["memory/peak_gib"]
        estimate, phase = planned(name, model, runs, args.cpu)
        error = 100 * (estimate - measured) / measured
        worst = max(worst, abs(error))
        print(f"| {name} | {estimate:.2f} | {phase} | {measured:.2f} | {error:+.1f} % |")
        sys.stdout.flush()
    print(f"largest error: {worst:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
