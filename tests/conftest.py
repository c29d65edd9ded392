"""Shared test setup: offline hubs, the real-data folder beside the checkout, run helpers."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Nothing may come from a hub during tests: tiny models and data are bundled or generated.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_EVALUATE_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = os.environ.get("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest -n N (pytest-xdist) each worker and the train.py processes it starts compute on
# one thread: N workers of several OpenMP threads each on N cores spin against each other, and
# a tiny model's run gets many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # already imported: its thread pool is set
        sys.modules["torch"].set_num_threads(1)

# Tests build their tasks from conf/task/*.yaml, where the defaults are written (after the
# settings above: it imports the project).
from fake_torch_musa import NEWEST
from in_process import TRAIN, needs_own_process, run_train_here
from task_yaml import make_task  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real SQuAD, text, GLUE); the test is skipped where it is absent."""
    if not (SHARED_DATA / "squad").is_dir():
        pytest.skip("../shared/data is not present on this machine")
    return SHARED_DATA


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One feature cache for the session's runs (features are reused across tests)."""
    return tmp_path_factory.mktemp("feature-cache")


# scripts/gpu_check.py's rows that its dry run on the emulated MUSA card runs
# (tests/test_emulated_runs.py: through the device path, with the card's MFU and peak memory);
# the CPU dry run (tests/test_gpu_check.py) runs every other row, so each row runs once in CI.
GPU_CHECK_ON_THE_CARD = (
    "micro/*",
    "llama135m/*",
    "compare/packing",
    "compare/lora_memory",
    "fsdp/*",
    "smoke/llama_dpo",
    "smoke/t5_squad",
)
# Of those, the ones the CPU dry run runs as well: the smoke rows share one sweep process there.
GPU_CHECK_ALSO_ON_THE_CPU = ("smoke/*",)
# Rows whose dry run is another row's to the setting, left out of both dry runs: the dry run cuts
# every large row to 128 tokens, so the 8,192-token rows would run the 4,096-token rows' jobs.
GPU_CHECK_DRY_RUN_REPEATS = ("large/qwen3_8b_8192_*",)


# The slow set's longest modules, longest first (seconds of one worker, pytest -m slow -n 2
# --durations=0 on 2 cores): pytest-xdist's loadscope hands out whole modules in collection
# order, so one of these handed out last would leave the other worker idle for its length.
LONGEST_FIRST = (
    "test_emulated_runs.py",  # ~500 s
    "test_emulated_recipes.py",  # ~350 s
    "test_gpu_check.py",  # ~200 s, its CPU dry run of every row (bert 256 wide there)
    "test_nothing_lost.py",  # ~280 s
    "test_multiple_choice.py",
    "test_device_cost.py",
    "test_readme_commands.py",
)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--deselect-slow",
        action="append",
        default=[],
        metavar="NODEID_PREFIX",
        help="deselect the slow tests of this module or test (its fast tests stay); repeatable. "
        "CI's transformers 4.x pass runs the fast and the slow set as one session with it",
    )


def pytest_collection_modifyitems(config, items) -> None:
    prefixes = tuple(config.getoption("deselect_slow"))
    if prefixes:
        slow = {i for i in items if i.nodeid.startswith(prefixes) and i.get_closest_marker("slow")}
        if slow:
            config.hook.pytest_deselected(items=[i for i in items if i in slow])
            items[:] = [i for i in items if i not in slow]
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


# Five logged fp32 steps in plain shuffled order, each micro-batch run whole, and nothing else:
# what the golden-loss tests run on each recipe.
GOLDEN_RUN = (
    "trainer.group_by_length=false",
    "trainer.sub_batches=1",
    "trainer.max_steps=5",
    "trainer.log_every_n_steps=1",
    "trainer.per_device_train_batch_size=8",
    "trainer.mixed_precision=no",
    "optimizer.lr=1e-3",
    "scheduler.warmup_ratio=0",
    "trainer.eval_at_start=false",
    "trainer.eval_at_end=false",
    "trainer.save_final_model=false",
)


# Tests train in fp32 unless they say otherwise: trainer.mixed_precision=auto
# picks bf16 on CPUs with bf16 instructions, and the exact comparisons (golden losses, resume,
# one process against two) must do the same arithmetic on every machine.
FP32 = "trainer.mixed_precision=no"


def _fp32_first(overrides: tuple[str, ...]) -> list[str]:
    """``FP32`` before the overrides (after Hydra's flags, such as ``-m``, which must lead),
    unless they choose a precision themselves."""
    if any(o.startswith("trainer.mixed_precision=") for o in overrides):
        return list(overrides)
    flags = len(list(itertools.takewhile(lambda arg: arg.startswith("-"), overrides)))
    return [*overrides[:flags], FP32, *overrides[flags:]]


# RECIPES_TEST_PROCESSES=1: every run_train in a process of its own, as before runs went
# in-process (to compare, or to rule the in-process runner out when a test fails).
OWN_PROCESSES = os.environ.get("RECIPES_TEST_PROCESSES") == "1"


def run_train(
    *overrides: str,
    cwd: Path = ROOT,
    check: bool = True,
    env: dict | None = None,
    timeout: int = 600,
    script: tuple[str, ...] | None = None,
    own_process: bool = False,
) -> subprocess.CompletedProcess:
    """``python train.py <overrides>`` as a user runs it (in fp32 unless told): in this process
    (tests/in_process.py: Python's start-up is most of a short run's time), or in a process of
    its own when ``script`` runs instead of train.py (a wrapper and its own arguments: the
    emulated MUSA card, a fault injector), when ``env`` must be set before the interpreter starts
    (``OMP_*``, ``PYTHON*``), or when ``own_process`` asks. ``timeout``: its own process only."""
    args = _fp32_first(overrides)
    if script is None and not (own_process or OWN_PROCESSES or needs_own_process(env)):
        proc = run_train_here(args, cwd=cwd, env=env)
    else:
        proc = subprocess.run(
            [sys.executable, *(script or (str(TRAIN),)), *args],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@dataclasses.dataclass
class Sweep:
    """The job folders of a :func:`sweep_train` run, by recipe, and the run's stderr."""

    jobs: dict[str, Path]
    stderr: str

    def job(self, recipe: str) -> Path:
        """``recipe``'s job folder, once its run is known to have ended well: a failed job fails
        the test that asks for it, not its neighbours'."""
        job = self.jobs[recipe]
        found = job / "results.json"
        assert found.is_file(), f"{recipe}: no results.json\n{self.stderr[-3000:]}"
        error = json.loads(found.read_text()).get("error")
        assert error is None, f"{recipe}: {error}\n{(job / 'train.log').read_text()[-3000:]}"
        return job


def sweep_train(recipes: tuple[str, ...], *overrides: str, output_dir: Path, **kwargs) -> Sweep:
    """``recipes`` as one Hydra sweep, ``train.py -m recipe=a,b,.. <overrides>`` (``kwargs`` as
    :func:`run_train` takes them): each job builds its model, data, Accelerator and seeds as a
    fresh process does, and a failed job fails only its recipe's test (:meth:`Sweep.job`); in
    a process of its own (the emulated card's ``script``), Python's start-up (about 6.5 s of a
    3-step smoke run's 8.3 s on 2 cores) is paid once, not per recipe."""
    done = run_train(
        "-m",
        f"recipe={','.join(recipes)}",
        *overrides,
        f"output_dir={output_dir}",
        check=False,
        **kwargs,
    )
    return Sweep({recipe: output_dir / str(job) for job, recipe in enumerate(recipes)}, done.stderr)


def start_train(
    *overrides: str,
    env: dict | None = None,
    script: tuple[str, ...] = (str(TRAIN),),
) -> subprocess.Popen:
    """``python train.py <overrides>`` started in the background (to be signalled or killed);
    ``script`` as for :func:`run_train`."""
    return subprocess.Popen(
        [sys.executable, *script, *_fp32_first(overrides)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# The emulated MUSA device (tests/musa_emulator): ``scripts/emulated_musa.py`` runs a command with
# a torch_musa stand-in of a release, on cards that hold tensors in host memory.
EMULATED_MUSA = ROOT / "scripts" / "emulated_musa.py"


def on_musa(
    *command: str, cards: int = 1, release: str = NEWEST, card: str = "S4000"
) -> tuple[str, ...]:
    """``command`` (train.py by default) on ``cards`` emulated MUSA cards, as the arguments of
    ``python``: a ``script`` for :func:`run_train` / :func:`start_train`."""
    command = command or (sys.executable, str(ROOT / "train.py"))
    return (
        str(EMULATED_MUSA),
        f"--cards={cards}",
        f"--release={release}",
        f"--card={card}",
        "--",
        *command,
    )


def musa_launch(processes: int = 2, *, release: str = NEWEST) -> tuple[str, ...]:
    """train.py under ``accelerate launch --config_file conf/accelerate/multi_musa.yaml`` on
    ``processes`` emulated cards (one thread each), as the arguments of ``python``."""
    return on_musa(
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "conf/accelerate/multi_musa.yaml"),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "train.py"),
        cards=processes,
        release=release,
    )


def kill_at_checkpoint(proc: subprocess.Popen, run: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL ``proc`` (a :func:`start_train` run) once ``run`` holds the checkpoint of
    ``step``: no handler runs, as when a node dies."""
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / f"step-{step:08d}").is_dir():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def squad_questions(squad_file: Path, out: Path) -> int:
    """The questions of a SQuAD file as JSON lines of ``question`` and ``context`` (no answers,
    no ids), as ``mode=predict`` reads rows; returns how many."""
    rows = [
        {"question": qa["question"], "context": paragraph["context"]}
        for article in json.loads(squad_file.read_text())["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def read_metrics(run: Path) -> list[dict]:
    """The records of ``<run>/metrics.jsonl``."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_launch_command(*args: str) -> list[str]:
    """``accelerate launch`` as conf/accelerate/cpu.yaml's header documents (run it with
    ``ACCELERATE_USE_CPU=1``), followed by ``args``."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "conf/accelerate/cpu.yaml"),
        "--multi_gpu",
        *args,
    ]


def run_torchrun(*args: str, timeout: int = 600, processes: int = 2) -> subprocess.CompletedProcess:
    """train.py in ``processes`` gloo processes started by ``torchrun`` (one thread each), fp32
    unless told; the caller asserts on the result."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            f"--master_port={free_port()}",
            str(ROOT / "train.py"),
            *_fp32_first(args),
        ],
        env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cpu_launch(
    script: Path, *args: str, cwd: Path = ROOT, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Two gloo processes, started the way conf/accelerate/cpu.yaml's header documents (train.py
    in fp32 unless told)."""
    if script.name == "train.py":
        args = tuple(_fp32_first(args))
    command = cpu_launch_command("--main_process_port", str(free_port()), str(script), *args)
    return subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
