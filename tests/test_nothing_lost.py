"""Nothing on disk is lost and nothing silently wrong is written when a run meets a kill in the
middle of ``final/``, SIGTERM in the final evaluation, a second run in its folder, a full disk,
another task's model, or a changed learning rate on resume."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, kill_at_checkpoint, read_metrics, run_train, start_train

pytestmark = pytest.mark.slow

FAULTS = str(Path(__file__).with_name("faults_during_run.py"))


def _gpt2(cache_dir: Path, *extra: str) -> tuple[str, ...]:
    """The tiny GPT-2's smoke run (about 10 s), 4 steps, a checkpoint every 2."""
    return (
        "recipe=gpt2_clm",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=2",
        "trainer.eval_at_start=false",
        "trainer.progress_bar=false",
        "task.sample_prompt=null",
        *extra,
    )


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["train/loss"]) for m in read_metrics(run) if "train/loss" in m]


def test_a_kill_while_final_is_written_leaves_a_run_that_resumes(tmp_path, cache_dir):
    run = tmp_path / "run"
    killed = run_train(
        *_gpt2(cache_dir), f"output_dir={run}", script=(FAULTS, "kill-in-final"), check=False
    )
    assert killed.returncode == -signal.SIGKILL
    assert (run / ".tmp-final" / "model.safetensors").is_file()  # written, never published
    assert not (run / "final").exists() and not (run / "results.json").exists()

    # An earlier release wrote final/ in place: a kill left it with a config and no weights.
    (run / "final").mkdir()
    shutil.copy(run / ".tmp-final" / "config.json", run / "final")
    refused = run_train(*_gpt2(cache_dir), f"output_dir={run}", check=False)
    assert refused.returncode == 2
    assert "final/ is incomplete" in refused.stderr and "resume=auto" in refused.stderr

    done = run_train(*_gpt2(cache_dir), f"output_dir={run}", "resume=auto")
    assert "resumed from" in done.stderr and "step-00000004: step 4" in done.stderr
    assert not list(run.glob(".tmp-*")) and not list(run.glob(".del-*"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "final")  # whole
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    again = run_train(*_gpt2(cache_dir), f"output_dir={run}", "resume=auto", check=False)
    assert again.returncode == 2 and "already holds a finished run" in again.stderr


def test_sigterm_in_the_last_words_resumes_with_the_final_evaluation(tmp_path, cache_dir):
    """Stopped after its final evaluation (in the samples a causal LM writes after training),
    the resumed run does not evaluate again and still reports that evaluation."""
    run = tmp_path / "run"
    stopped = run_train(
        *_gpt2(cache_dir),
        f"output_dir={run}",
        script=(FAULTS, "term-in-last-words"),
        check=False,
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert not (run / "final").exists() and not (run / "results.json").exists()
    evaluated = [m for m in read_metrics(run) if "eval/perplexity" in m]
    assert [m["step"] for m in evaluated] == [4]
    run_train(*_gpt2(cache_dir), f"output_dir={run}", "resume=auto")
    assert [m["step"] for m in read_metrics(run) if "eval/perplexity" in m] == [4]
    results = json.loads((run / "results.json").read_text())
    assert results["main_value"] == evaluated[0]["eval/perplexity"]
    assert (run / "final" / "model.safetensors").is_file()


def _wait_for(proc: subprocess.Popen, done, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{what} not reached"
        time.sleep(0.05)


def _trained(run: Path, step: int):
    def done() -> bool:
        try:
            return any(m["step"] == step and "train/loss" in m for m in read_metrics(run))
        except (FileNotFoundError, json.JSONDecodeError):  # not yet written, or mid-line
            return False

    return done


QA = (
    "recipe=bert_squad",
    "debug=smoke",
    "logger=none",
    "trainer.max_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.save_every_n_steps=0",  # no checkpoint but the one the stop saves
    "trainer.save_at_epoch_end=false",
    "trainer.eval_at_start=false",
    "trainer.progress_bar=false",
)


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_in_the_final_evaluation_stops_at_once_and_resumes(tmp_path, cache_dir, processes):
    """The QA smoke run's final evaluation takes about 25 s on 2 cores, a launcher's grace
    period 30 s: the stop must not wait for it, nor write final/."""
    run = tmp_path / "run"
    common = (*QA, f"data.cache_dir={cache_dir}", f"output_dir={run}")
    if processes == 1:
        proc = start_train(*common)
    else:
        from conftest import cpu_launch_command, free_port

        proc = subprocess.Popen(
            cpu_launch_command(
                "--num_processes=2",
                f"--main_process_port={free_port()}",
                str(ROOT / "train.py"),
                "trainer.mixed_precision=no",
                "trainer.per_device_train_batch_size=8",
                *common,
            ),
            cwd=ROOT,
            env={**__import__("os").environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    _wait_for(proc, _trained(run, 2), "step 2")
    time.sleep(1.0)  # into the evaluation
    signalled = time.monotonic()
    if processes == 1:
        proc.send_signal(signal.SIGTERM)
    else:  # as torchrun's agent and Slurm do: every worker gets it
        for pid in _children(proc.pid):
            subprocess.run(["kill", "-TERM", str(pid)], check=False)
    _, stderr = proc.communicate(timeout=120)
    stopped_after = time.monotonic() - signalled
    assert proc.returncode != 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr, stderr[-3000:]
    # No rank failed with a traceback (a launcher prints its own on a worker's exit code).
    assert f'File "{ROOT / "recipes"}' not in stderr and 'train.py", line' not in stderr
    assert not (run / "final").exists() and not list(run.glob(".tmp-*"))
    assert not [m for m in read_metrics(run) if "eval/f1" in m]  # the evaluation was cut short
    assert (run / "checkpoints" / "step-00000002" / "trainer_state.json").is_file()
    print(f"stopped {stopped_after:.1f} s after SIGTERM")

    # The resumed run's own final evaluation on fewer questions: what it has to show is that
    # the stop left a run that resumes and ends, not the 25 s the stop had to cut short.
    done = run_train(
        *common,
        "resume=auto",
        "trainer.per_device_train_batch_size=16",
        "data.max_eval_examples=32",
    )
    assert "resumed from" in done.stderr
    assert [m["step"] for m in read_metrics(run) if "eval/f1" in m] == [2]
    assert (run / "final" / "model.safetensors").is_file()


def _children(pid: int) -> list[int]:
    """The launcher's worker processes (the launcher itself forwards a signal too late to
    test: it waits for them)."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def test_two_runs_in_one_folder_one_is_refused_and_a_stale_lock_is_taken_over(tmp_path, cache_dir):
    run = tmp_path / "run"
    both = [start_train(*_gpt2(cache_dir), f"output_dir={run}") for _ in range(2)]
    results = [(proc.wait(timeout=300), proc.communicate()[1]) for proc in both]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, err in results]
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another run (pid" in refused and "nothing was changed" in refused
    assert "Traceback" not in refused
    steps = [step for step, _ in _losses(run)]
    assert steps == [1, 2, 3, 4]  # one run's losses only

    # A run killed with its lock: the kernel dropped the lock, the next run takes the folder.
    second = tmp_path / "second"
    proc = start_train(*_gpt2(cache_dir), f"output_dir={second}")
    kill_at_checkpoint(proc, second, 2)
    assert (second / ".lock").is_file()
    done = run_train(*_gpt2(cache_dir), f"output_dir={second}", "resume=auto")
    assert "resumed from" in done.stderr


def _tmpfs(size_mib: int, mountpoint: Path, *command: str) -> list[str]:
    """``command`` with a tmpfs of ``size_mib`` at ``mountpoint`` (a user and mount namespace:
    no root needed where unprivileged namespaces are allowed). The tmpfs goes with the
    namespace: what ``command`` left there is listed on stdout after a ``==`` line, with each
    ``train.log``."""
    script = (
        'mount -t tmpfs -o size="$1"m tmpfs "$2" || exit 99; d="$2"; shift 2; "$@"; code=$?; '
        'echo ==; find "$d" | sort; echo ==log; for f in "$d"/*/train.log; do cat "$f"; done; exit $code'
    )
    return ["unshare", "-rm", "sh", "-c", script, "sh", str(size_mib), str(mountpoint), *command]


def _tmpfs_works(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        done = subprocess.run(_tmpfs(1, probe, "true"), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.parametrize("fault", ["known size", "filled while writing"])
def test_a_full_disk_says_so_and_keeps_every_earlier_checkpoint(tmp_path, cache_dir, fault):
    if shutil.which("unshare") is None or not _tmpfs_works(tmp_path):
        pytest.skip("no tmpfs here: mounting needs root or unprivileged user namespaces")
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    # A checkpoint of the tiny GPT-2 is about 8 MiB: 14 MiB holds one and not two; with 40,
    # the second fits until another process fills the disk.
    size, script = (14, ["train.py"]) if fault == "known size" else (40, [FAULTS, "fill-disk"])
    proc = subprocess.run(
        _tmpfs(
            size,
            disk,
            sys.executable,
            *script,
            "trainer.mixed_precision=no",
            *_gpt2(cache_dir, f"output_dir={run}", "trainer.keep_last_n_checkpoints=null"),
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "inline_container" not in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("error: "))
    assert "error: no space left on device: checkpoint step-00000004 needs about" in line
    assert f"in {run / 'checkpoints'}" in line
    assert "every earlier checkpoint is kept (latest: step-00000002)" in line
    assert ("nothing was written" in line) == (fault == "known size")
    assert "resume=auto" in line
    left = proc.stdout.split("==\n", 1)[1]
    assert f"{run}/checkpoints/step-00000002/trainer_state.json" in left
    listing, log = left.split("==log\n", 1)
    assert "step-00000004" not in listing and ".tmp-" not in listing
    assert ("filler" in listing) == (fault == "filled while writing")
    assert line in log  # train.log says how the run ended


@pytest.mark.parametrize(
    "recipe,mode",
    [("bert_mlm", "eval"), ("gpt2_clm", "eval"), ("bert_glue", "predict")],
)
def test_eval_and_predict_refuse_a_model_without_the_tasks_head(tmp_path, recipe, mode):
    """The bundled MiniLM is a QA model, without a masked-LM, causal-LM or classification head:
    scores from a random head would look valid (perplexity 22,486, accuracy 0.50): refused by
    its config.json's architecture (tests/test_eval_heads.py: without one, by its weights)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "Who came?", "sentence": "A dog came."}\n')  # QNLI rows
    proc = run_train(
        f"recipe={recipe}",
        "debug=smoke",
        "logger=none",
        f"mode={mode}",
        f"model.name_or_path={ROOT / 'recipes/assets/minilm-squad'}",
        f"data.predict_file={rows}" if mode == "predict" else "trainer.progress_bar=false",
        f"output_dir={tmp_path / 'scored'}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("error: "))
    assert f"error: mode={mode}: model.name_or_path=" in line
    assert "is a BertForQuestionAnswering (AutoModelForQuestionAnswering) by its config" in line
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "scored" / "results.json").exists()


def test_a_changed_learning_rate_on_resume_is_applied(tmp_path, cache_dir):
    run = tmp_path / "run"
    constant = ("scheduler=constant", "scheduler.warmup_ratio=0", "trainer.save_final_model=false")
    run_train(
        *_gpt2(cache_dir, *constant, "trainer.max_steps=2", "optimizer.lr=1e-3"),
        f"output_dir={run}",
    )
    done = run_train(
        *_gpt2(cache_dir, *constant, "optimizer.lr=2.5e-4"), f"output_dir={run}", "resume=auto"
    )
    assert "applied from step 2 on: optimizer.lr 0.001 -> 0.00025" in done.stderr
    lrs = {m["step"]: m["train/lr"] for m in read_metrics(run) if "train/lr" in m}
    assert lrs == {1: 1e-3, 2: 1e-3, 3: 2.5e-4, 4: 2.5e-4}


@pytest.mark.parametrize(
    "fault,processes",
    [("full-after-checkpoint", 1), ("full-after-checkpoint", 2), ("full-after-final", 1)],
)
def test_a_full_disk_in_a_main_process_write_is_one_line(tmp_path, cache_dir, fault, processes):
    """The disk fills after a checkpoint (or final/): the main process's own next write
    (metrics.jsonl, results.json) stops the run in one line naming the file, what is saved and
    how to go on; train.log's failure is one warning; no rank waits; nothing saved is lost."""
    run = tmp_path / "run"
    args = (*_gpt2(cache_dir), "trainer.mixed_precision=no", f"output_dir={run}")
    if processes == 1:
        proc = run_train(*args, script=(FAULTS, fault), check=False)
    else:
        from conftest import cpu_launch_command, free_port

        proc = subprocess.run(
            cpu_launch_command(f"--main_process_port={free_port()}", FAULTS, fault, *args),
            cwd=ROOT,
            env={**__import__("os").environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 1 if processes == 1 else proc.returncode != 0, proc.stderr[-3000:]
    ours = proc.stderr.split("torch/distributed/elastic")[0]  # before the launcher's own report
    assert "Traceback" not in ours and "Logging error" not in ours, ours[-3000:]
    [line] = [x for x in ours.splitlines() if x.startswith("error: no space left")]
    assert [x for x in ours.splitlines() if x.startswith("warning: ")] == [
        f"warning: {run / 'train.log'}: No space left on device; the log goes on on the "
        "terminal only"
    ]
    steps = [step for step, _ in _losses(run)]
    assert not list(run.glob("*.tmp")) and not (run / "results.json").exists()
    if fault == "full-after-final":
        assert line.startswith(
            f"error: no space left on device: could not write results.json in {run}"
        )
        assert f"the trained model is whole in {run / 'final'}" in line and "mode=eval" in line
        assert steps == [1, 2, 3, 4]
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(run / "final")  # whole
        return
    assert line.startswith(
        f"error: no space left on device: could not write metrics.jsonl in {run}"
    )
    assert "every checkpoint is kept (latest: step-00000002)" in line
    assert f"output_dir={run} resume=auto" in line
    assert steps == [1, 2]
    if processes == 2:
        assert "another process of this run failed" in ours  # said, not waited on
        return
    done = run_train(*args, "resume=auto")
    assert "resumed from" in done.stderr
    assert [step for step, _ in _losses(run)] == [1, 2, 3, 4]
    assert json.loads((run / "results.json").read_text())["steps"] == 4
