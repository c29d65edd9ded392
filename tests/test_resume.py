"""Checkpoints survive kills and resumed runs repeat the uninterrupted one, step for step.

The tiny GPT-2 keeps its dropout, so equality also proves that randomness follows the run's
position (not the process's history). fp32 on CPU: losses must be exactly equal.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_train, start_train
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 40


def _common(cache_dir: Path) -> tuple[str, ...]:
    return (
        "recipe=gpt2_clm",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=5",
        "trainer.eval_every_n_steps=20",
        "trainer.eval_at_start=false",
        "trainer.progress_bar=false",
        "task.sample_prompt=null",
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> Path:
    """The uninterrupted run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    run_train(*_common(cache_dir), f"output_dir={run}")
    return run


def _numbers(run: Path) -> list[tuple[int, str, float]]:
    keys = ("train/loss", "train/lr", "eval/loss", "eval/perplexity")
    return [(m["step"], k, m[k]) for m in read_metrics(run) for k in keys if k in m]


def _assert_same_run(run: Path, reference: Path) -> None:
    assert _numbers(run) == _numbers(reference)  # every step, exactly
    ours = load_file(run / "final" / "model.safetensors")
    theirs = load_file(reference / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def _wait_for_step(proc, run: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        path = run / "metrics.jsonl"
        if path.exists() and any(m.get("step", 0) >= step for m in read_metrics(run)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def test_kill_9_mid_training_then_resume_auto(reference, tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = start_train(*_common(cache_dir), f"output_dir={run}")
    _wait_for_step(proc, run, 12)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (run / "final").exists()
    done = run_train(*_common(cache_dir), f"output_dir={run}", "resume=auto")
    assert "resumed from" in done.stderr
    _assert_same_run(run, reference)
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    # keep_last_n_checkpoints=2, plus the best evaluation (step 40 is both)
    assert kept == ["best.json", "step-00000035", "step-00000040"]


def test_kill_9_while_writing_a_checkpoint(reference, tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = run_train(
        *_common(cache_dir),
        f"output_dir={run}",
        script=(str(Path(__file__).with_name("kill_during_checkpoint.py")), "10"),
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL
    folder = run / "checkpoints"
    assert (folder / ".tmp-step-00000010").is_dir()  # half written, and does not look complete
    assert not (folder / ".tmp-step-00000010" / "trainer_state.json").exists()
    assert not (folder / "step-00000010").exists()
    done = run_train(*_common(cache_dir), f"output_dir={run}", "resume=auto")
    assert "resumed from" in done.stderr and "step-00000005: step 5" in done.stderr
    _assert_same_run(run, reference)


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(reference, tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = start_train(*_common(cache_dir), f"output_dir={run}")
    _wait_for_step(proc, run, 7)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in stderr
    assert "stopped by SIGTERM" in stderr and f"output_dir={run} resume=auto" in stderr
    saved = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert int(saved.name.removeprefix("step-")) >= 7  # the step in flight, not an older one
    run_train(*_common(cache_dir), f"output_dir={run}", "resume=auto")
    _assert_same_run(run, reference)


def test_a_checkpoint_loads_with_from_pretrained_and_best_is_kept(reference):
    from transformers import AutoModelForCausalLM

    best = (reference / "checkpoints" / "best.json").read_text()
    assert '"metric": "perplexity"' in best and '"step": 40' in best
    model = AutoModelForCausalLM.from_pretrained(reference / "checkpoints" / "step-00000040")
    final = AutoModelForCausalLM.from_pretrained(reference / "final")
    for (name, a), (_, b) in zip(
        model.state_dict().items(), final.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resume_refuses_a_different_batch_and_keeps_the_run(reference, tmp_path, cache_dir):
    before = (reference / "metrics.jsonl").read_text()
    proc = run_train(
        *_common(cache_dir),
        f"output_dir={tmp_path / 'other'}",
        f"resume={reference / 'checkpoints' / 'step-00000035'}",
        "trainer.per_device_train_batch_size=8",
        check=False,
    )
    assert proc.returncode == 2
    assert "global_batch: 16 then, 8 now" in proc.stderr.splitlines()[-1]
    assert (reference / "metrics.jsonl").read_text() == before

    # Packed blocks all have one length, so trainer.group_by_length changes no batch there: a
    # checkpoint continues with it off, and ends with the reference's weights.
    ungrouped = tmp_path / "ungrouped"
    run_train(
        *_common(cache_dir),
        f"output_dir={ungrouped}",
        f"resume={reference / 'checkpoints' / 'step-00000035'}",
        "trainer.group_by_length=false",
    )
    ours = load_file(ungrouped / "final" / "model.safetensors")
    theirs = load_file(reference / "final" / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)

    unfinished = tmp_path / "unfinished"  # the reference run as a kill before final/ leaves it
    shutil.copytree(reference, unfinished, ignore=shutil.ignore_patterns("final"))
    older = run_train(  # an older checkpoint continued in its own folder would mix two runs
        *_common(cache_dir),
        f"output_dir={unfinished}",
        f"resume={unfinished / 'checkpoints' / 'step-00000035'}",
        check=False,
    )
    assert older.returncode == 2
    assert "has newer checkpoints (step-00000040)" in older.stderr.splitlines()[-1]
    assert (unfinished / "metrics.jsonl").read_text() == before
    assert (unfinished / "checkpoints" / "step-00000040").is_dir()


def test_nonfinite_loss_stops_or_skips_without_corrupting_weights(tmp_path, cache_dir):
    blow_up = (  # an absurd learning rate: the weights overflow within a few steps
        "optimizer.lr=1e30",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=1",
        "trainer.keep_last_n_checkpoints=null",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "task.sample_prompt=null",
    )
    common = (*_common(cache_dir)[:4], "trainer.progress_bar=false")
    # The finite check is read when a window closes (every 4 steps here) and before every
    # checkpoint (every step): no checkpoint may hold the overflowed weights.
    stopped = run_train(
        *common,
        *blow_up,
        "trainer.log_every_n_steps=4",
        f"output_dir={tmp_path / 'stop'}",
        check=False,
    )
    assert stopped.returncode == 1
    last = stopped.stderr.splitlines()[-1]
    assert last.startswith("error: step ") and "trainer.on_nonfinite=skip" in last
    for ckpt in (tmp_path / "stop" / "checkpoints").glob("step-*"):
        weights = load_file(ckpt / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), ckpt

    skipped = tmp_path / "skip"
    run_train(*common, *blow_up, "trainer.on_nonfinite=skip", f"output_dir={skipped}")
    logged = [m for m in read_metrics(skipped) if "train/loss" in m]
    assert logged[-1]["train/skipped_steps"] >= 1
    weights = load_file(skipped / "final" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_checkpoint_at_an_epochs_last_step_resumes_into_the_next_epoch(tmp_path, cache_dir):
    common = (
        *_common(cache_dir)[:4],
        "trainer.progress_bar=false",
        # 21 batches of 32 per epoch, 2 per step: 11 steps, the last one of a single batch
        "trainer.per_device_train_batch_size=32",
        "trainer.gradient_accumulation_steps=2",
        "trainer.max_steps=14",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=11",  # the epoch's last step ...
        "trainer.save_at_epoch_end=true",  # ... which the epoch's end does not write again
        "trainer.eval_at_start=false",
        "trainer.save_final_model=false",
        "task.sample_prompt=null",
    )
    whole = tmp_path / "whole"
    run_train(*common, f"output_dir={whole}")
    saved = sorted(p.name for p in (whole / "checkpoints").glob("step-*"))
    assert saved == ["step-00000011", "step-00000014"]  # the epoch's end; the best evaluation
    resumed = tmp_path / "resumed"
    proc = run_train(
        *common,
        f"output_dir={resumed}",
        f"resume={whole / 'checkpoints' / 'step-00000011'}",
        "trainer.keep_last_n_checkpoints=3",
    )
    assert "step 11, epoch 0" in proc.stderr
    assert "resuming with changed settings: trainer.keep_last_n_checkpoints" in proc.stderr
    losses = [(s, k, v) for s, k, v in _numbers(whole) if s > 11]
    assert _numbers(resumed) == losses
