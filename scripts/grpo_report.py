"""``python scripts/grpo_report.py <run folder>``: what a GRPO run (task=grpo) did, from its
metrics.jsonl: the held-out reward before and after training (greedy completions, eval/*), the
training reward at its start and end, and the speed of its two halves, measured apart because
sampling dominates a GRPO step:

* generation: completion tokens sampled per second (``train/generation/tokens_per_second``);
* training: tokens of prompts and completions through the forward and backward passes per second
  of the rest of the step (the step's time less its generation's).

Run with ``trainer.log_every_n_steps=1`` so that each record is one step."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def report(run: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/reward" in r]
    steps = [r for r in records if "train/reward" in r]
    if not steps:
        raise SystemExit(f"{run}: no GRPO training records (train/reward) in metrics.jsonl")
    config = (run / "config.yaml").read_text()
    group = _setting(config, "num_generations")
    prompts = _setting(config, "per_device_train_batch_size")
    train_speed = []
    for r in steps[1:]:  # the first step holds start-up work
        step_s = prompts / r["train/samples_per_second"]
        prompt_tokens = r["train/tokens_per_second"] * step_s  # the batch's prompt tokens
        completion_tokens = r["train/completions/mean_length"] * prompts * group
        trained = prompt_tokens * group + completion_tokens
        train_speed.append(trained / max(step_s - r["train/generation/seconds"], 1e-9))
    third = max(1, len(steps) // 3)
    out = {
        "eval_reward_before": evals[0]["eval/reward"] if evals else float("nan"),
        "eval_reward_after": evals[-1]["eval/reward"] if evals else float("nan"),
        "train_reward_first_third": statistics.mean(r["train/reward"] for r in steps[:third]),
        "train_reward_last_third": statistics.mean(r["train/reward"] for r in steps[-third:]),
        "generation_tokens_per_second": statistics.median(
            r["train/generation/tokens_per_second"] for r in steps
        ),
        "training_tokens_per_second": statistics.median(train_speed) if train_speed else 0.0,
        "generation_share_of_step": statistics.median(
            r["train/generation/seconds"] * r["train/samples_per_second"] / prompts for r in steps
        ),
        "steps": float(len(steps)),
    }
    return out


def _setting(config: str, key: str) -> int:
    for line in config.splitlines():
        name, _, value = line.strip().partition(":")
        if name == key:
            return int(value.split("#")[0])
    raise SystemExit(f"config.yaml has no {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    for key, value in report(parser.parse_args().run).items():
        print(f"{key}: {value:.4g}")


if __name__ == "__main__":
    main()
