"""LoRA, gradient checkpointing and early stopping through the real loop (``train.py``).

The tiny Llama of ``recipe=llama_sft debug=smoke`` keeps LoRA dropout (0.1), so a killed and
resumed run repeating the uninterrupted one also proves the adapters' randomness follows the
run's position. fp32 on CPU: losses must be exactly equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import kill_at_checkpoint, read_metrics, run_torchrun, run_train, start_train
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow

STEPS = 12


def _lora(cache_dir: Path) -> tuple[str, ...]:
    return (
        "recipe=llama_sft",
        "debug=smoke",
        "peft=lora",
        "peft.dropout=0.1",
        "optimizer.lr=1e-3",
        "trainer.gradient_checkpointing=true",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=4",
        "trainer.eval_every_n_steps=6",
        "trainer.eval_at_start=false",
        "trainer.progress_bar=false",
        "task.num_generations=2",
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> Path:
    run = tmp_path_factory.mktemp("lora-reference") / "run"
    done = run_train(*_lora(cache_dir), f"output_dir={run}")
    assert "trainable parameters: 73984 of 693120 (10.67%)" in done.stderr
    return run


def _numbers(run: Path) -> list[tuple[int, str, float]]:
    keys = ("train/loss", "train/lr", "eval/loss")
    return [(m["step"], k, m[k]) for m in read_metrics(run) for k in keys if k in m]


def test_lora_checkpoints_hold_the_trainable_weights_only(reference):
    saved = load_file(reference / "checkpoints" / "step-00000012" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:5]
    assert (reference / "checkpoints" / "step-00000012" / "adapter").is_dir()
    losses = [v for _, k, v in _numbers(reference) if k == "train/loss"]
    assert losses[-1] < losses[0]


def test_lora_run_killed_and_resumed_equals_the_uninterrupted_one(reference, tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = start_train(*_lora(cache_dir), f"output_dir={run}")
    kill_at_checkpoint(proc, run, 8)
    done = run_train(*_lora(cache_dir), f"output_dir={run}", "resume=auto")
    assert "resumed from" in done.stderr
    assert _numbers(run) == _numbers(reference)  # every step, exactly
    ours, theirs = (load_file(r / "final" / "model.safetensors") for r in (run, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_merged_final_loads_without_peft_and_equals_base_plus_adapter(reference):
    from peft import PeftModel

    base_path = json.loads((reference / "final" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(reference / "final").eval()
    assert not any("lora" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(base_path)
    adapted = PeftModel.from_pretrained(base, reference / "final" / "adapter").eval()
    with torch.no_grad():
        got, want = merged(ids).logits, adapted(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_early_stopping_builds_final_from_the_best_checkpoint(tmp_path, cache_dir):
    run = tmp_path / "run"
    done = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        "optimizer.lr=0.05",  # too high on purpose: the evaluation loss soon gets worse
        "trainer.max_steps=60",
        "trainer.eval_every_n_steps=3",
        "trainer.early_stopping_patience=2",
        "trainer.save_every_n_steps=100",
        "trainer.progress_bar=false",
        "task.num_generations=0",
        f"output_dir={run}",
    )
    results = json.loads((run / "results.json").read_text())
    best = results["best"]
    assert results["steps"] < 60 and results["steps"] == best["step"] + 2 * 3
    assert "early stopping at step" in done.stderr and "from the best checkpoint" in done.stderr
    assert results["main_value"] == best["value"]
    final = load_file(run / "final" / "model.safetensors")
    kept = load_file(run / "checkpoints" / f"step-{best['step']:08d}" / "model.safetensors")
    assert all(torch.equal(final[k], kept[k]) for k in final)


def test_early_stopping_without_evaluations_is_refused(tmp_path):
    done = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "trainer.early_stopping_patience=2",
        "trainer.eval_every_n_steps=0",
        f"output_dir={tmp_path / 'run'}",
        check=False,
    )
    assert done.returncode == 2
    assert (
        "trainer.early_stopping_patience=2" in done.stderr and "eval_every_n_steps" in done.stderr
    )
    assert not (tmp_path / "run").exists()


def test_lora_sft_packed_in_two_processes_trains_like_one(tmp_path, cache_dir):
    """torchrun with two CPU processes (gloo) against one process, same global batch: LoRA
    (dropout off, so no per-process randomness), packed rows, fp32."""
    common = (
        "recipe=llama_sft",
        "debug=smoke",
        "peft=lora",
        "peft.dropout=0.0",
        "task.packing=true",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.progress_bar=false",
        "task.num_generations=0",
    )
    single = tmp_path / "single"
    run_train(*common, "trainer.per_device_train_batch_size=8", f"output_dir={single}")
    pair = tmp_path / "pair"
    proc = run_torchrun(*common, "trainer.per_device_train_batch_size=4", f"output_dir={pair}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(4 per device x 2 processes x 1 accumulation)" in (pair / "train.log").read_text()

    def losses(run: Path, key: str) -> list[float]:
        return [m[key] for m in read_metrics(run) if key in m]

    assert losses(pair, "train/loss") == pytest.approx(losses(single, "train/loss"), rel=1e-5)
    assert losses(pair, "eval/loss") == pytest.approx(losses(single, "eval/loss"), rel=1e-5)
    assert (pair / "final" / "adapter").is_dir()
