"""Several processes on CPU (gloo), launched the ways users launch them.

The tiny Llama has no dropout, so one process with a global batch of 16 and two processes with 8
each must log the same losses (to float rounding: the gradient all-reduce sums in another order).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import (
    FP32,
    ROOT,
    cpu_launch_command,
    free_port,
    read_metrics,
    run_torchrun,
    run_train,
)

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 16


def _common(cache_dir: Path) -> tuple[str, ...]:
    return (
        "recipe=llama_clm",
        "debug=smoke",
        "logger=none",
        FP32,
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=3",
        "trainer.eval_at_start=false",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
        "task.sample_prompt=null",
    )


def _per_device(processes: int) -> str:
    return f"trainer.per_device_train_batch_size={GLOBAL_BATCH // processes}"


def _env(**extra: str) -> dict:
    return {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **extra}


def _losses(run: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run) if "train/loss" in m]


def _eval_loss(run: Path) -> float:
    return [m["eval/loss"] for m in read_metrics(run) if "eval/loss" in m][-1]


def test_torchrun_two_nodes_and_one_process_train_alike(tmp_path, cache_dir):
    single = tmp_path / "single"
    run_train(*_common(cache_dir), _per_device(1), f"output_dir={single}")

    torchrun = tmp_path / "torchrun"
    proc = run_torchrun(*_common(cache_dir), _per_device(2), f"output_dir={torchrun}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Two "nodes" on this machine: two launcher invocations, one process each.
    nodes = tmp_path / "nodes"
    port = str(free_port())
    launchers = [
        subprocess.Popen(
            cpu_launch_command(
                "--num_machines=2",
                f"--machine_rank={rank}",
                "--num_processes=2",
                "--main_process_ip=127.0.0.1",
                f"--main_process_port={port}",
                str(ROOT / "train.py"),
                *_common(cache_dir),
                _per_device(2),
                f"output_dir={nodes}",
            ),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for launcher in launchers:
        _, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, stderr[-3000:]

    expected = _losses(single)
    assert len(expected) == 6
    for run in (torchrun, nodes):
        log = (run / "train.log").read_text()
        assert "global batch 16 (8 per device x 2 processes x 1 accumulation)" in log
        assert _losses(run) == pytest.approx(expected, rel=1e-5)
        # Evaluation sharded over two processes scores exactly the data one process scores.
        assert _eval_loss(run) == pytest.approx(_eval_loss(single), rel=1e-5)

    # A checkpoint written by two processes continues in one (same global batch).
    resumed = tmp_path / "resumed"
    run_train(
        *_common(cache_dir),
        _per_device(1),
        f"output_dir={resumed}",
        f"resume={torchrun / 'checkpoints' / 'step-00000003'}",
    )
    assert _losses(resumed) == pytest.approx(expected[3:], rel=1e-5)


def _pids_with(tag: str, rank: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            values = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RECIPES_TEST_TAG={tag}".encode() in values and f"RANK={rank}".encode() in values:
            found.append(int(environ.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_a_dead_rank_ends_the_run_in_bounded_time(tmp_path, cache_dir):
    run = tmp_path / "run"
    tag = uuid.uuid4().hex
    launcher = subprocess.Popen(
        cpu_launch_command(
            f"--main_process_port={free_port()}",
            str(ROOT / "train.py"),
            *_common(cache_dir),
            _per_device(2),
            "trainer.max_steps=100000",
            f"output_dir={run}",
        ),
        env=_env(RECIPES_TEST_TAG=tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or not read_metrics(run):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    victims = _pids_with(tag, "1")
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert time.monotonic() - killed < 60, "the surviving rank should not wait for the dead one"
    assert not _pids_with(tag, "0"), "rank 0 outlived the launcher"
    assert not (run / "final").exists()
    assert "error: another process of this run failed" in stderr  # rank 0's own message
