"""scripts/gpu_check.py: its plan, every row run for real on the CPU (--dry-run), a failed and a
timed-out row that leave the others running, and the refusal where there is no GPU."""

from __future__ import annotations

import fnmatch
import json
import math
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import GPU_CHECK_ALSO_ON_THE_CPU, GPU_CHECK_DRY_RUN_REPEATS, GPU_CHECK_ON_THE_CARD
from in_process import run_here

from recipes import device

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
RECIPES = sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml"))
# Issue 44's rows: planned first, in one device command (about 9 minutes).
ISSUE_44 = (
    "profile/sub4_a",
    "profile/sub1_a",
    "profile/sub4_b",
    "profile/sub1_b",
    "profile/sub4_pad64",
    "profile/sub1_pad64",
    "profile/sub4_expandable",
    "bert_squad/defaults",
    "bert_squad/f1",
    "llm/sft_vs_trl",
    "llm/grpo_vs_trl",
    "generate/batch_vs_continuous",
)
ROW_KINDS = (
    "setup/models",
    "micro/sdpa_probe",
    "micro/adamw_fused",
    "micro/host_sync",
    "llama135m/unpacked",
    "llama135m/packed",
    "llama135m/lora_gc",
    "bert_large/eager",
    "bert_large/max_length",
    "bert_large/longest",
    "bert_large/longest_sub1",
    "bert_large/longest_grouped",
    "bert_large/compile",
)
COMPARISONS = (
    "compare/attention",
    "compare/compile",
    "compare/padding",
    "compare/sub_batches",
    "compare/group_by_length",
    "compare/packing",
    "compare/lora_memory",
)


def _check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The script with ``args``; a ``--plan`` (it only prints) in this process."""
    if "--plan" in args:
        return run_here([str(SCRIPT), *args], cwd=ROOT)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def _archive(out: Path) -> dict[str, str]:
    with tarfile.open(out / "logs.tar.gz") as tar:
        return {
            m.name: tar.extractfile(m).read().decode("utf-8", "replace")
            for m in tar.getmembers()
            if m.isfile()
        }


def _listed(plan: str) -> list[str]:
    return re.findall(r"^  \d+\. (\S+)", plan, flags=re.MULTILINE)


def test_plan_puts_issue_44_first_within_one_device_command() -> None:
    done = _check("--plan")
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert _listed(plan) == ["setup/models", *ISSUE_44], plan
    caps = float(re.search(r"caps sum to (\d+) s", plan).group(1))
    assert 6 * 60 <= caps <= 540, caps  # --deadline's default: one 600 s command
    for setting in (
        "{padding:longest,sub_batches:4,pad_to_multiple_of:8}",
        "{padding:longest,sub_batches:1,pad_to_multiple_of:64}",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "scripts.gpu_check_hydra.StepProfiler",
        "gpu_check_profile.warmup=5",
        "--child squad_defaults",
        "--child squad_f1",
    ):
        assert setting in plan, setting
    assert "profile/sub_batches" in plan.split("summaries:")[1]
    # The earlier rows stay, behind --only.
    optional = re.search(r"optional \(only with --only\): (.*)", plan).group(1).split(", ")
    assert {*ROW_KINDS[1:], "smoke/bert_squad", "fsdp/llama_clm"} <= set(optional)


def test_plan_lists_every_recipe_and_row_kind_with_only_star() -> None:
    done = _check("--plan", "--only", "*")
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    smoke = re.search(r"recipe=(\w+,[\w,]+) ", plan)
    assert smoke is not None and sorted(smoke.group(1).split(",")) == RECIPES, plan
    for name in (*(f"smoke/{r}" for r in RECIPES), *ROW_KINDS, *COMPARISONS):
        assert f"{name} " in plan, name
    for setting in (
        "task.max_seq_length=384",
        "task.doc_stride=128",
        "trainer.per_device_train_batch_size=32",
        "trainer.padding=max_length",
        "model.attn_implementation=eager",
        "{padding:longest,sub_batches:1}",
        "{padding:longest,group_by_length:true}",
        "{padding:max_length,compile:true}",
        "task.packing=false,true",
        "peft=lora trainer.gradient_checkpointing=true",
        "trainer.mixed_precision=bf16",
    ):
        assert setting in plan, setting
    assert "accelerate.commands.launch" in plan
    fsdp = _check("--plan", "--only", "fsdp")
    assert "accelerate.commands.launch" in fsdp.stdout and "fsdp" in fsdp.stdout


def test_only_takes_globs_and_substrings_and_adds_the_models_a_row_needs() -> None:
    done = _check("--plan", "--only", "smoke/gpt2*", "--only", "compile")
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^  \d+\. (\S+)", done.stdout, flags=re.MULTILINE)
    assert listed == ["setup/models", "smoke/gpt2_clm", "bert_large/compile"]
    issue = _check("--plan", "--only", "profile/*", "--only", "bert_squad/*")
    assert _listed(issue.stdout) == ["setup/models", *ISSUE_44[:9]], issue.stdout
    # A summary's name selects the rows it is made of.
    summary = _check("--plan", "--only", "profile/sub_batches")
    assert _listed(summary.stdout) == ["setup/models", *ISSUE_44[:7]], summary.stdout
    nothing = _check("--plan", "--only", "no-such-row")
    assert nothing.returncode == 2 and "no row matches" in nothing.stderr


def test_wheels_are_what_the_device_lacks_pinned_to_this_environment() -> None:
    import importlib.metadata

    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_wheels.py"), "--list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    fetched = dict(
        pin.split("==") for pin in done.stdout.split("fetch: ", 1)[1].strip().split(", ")
    )
    for name in ("hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "dill", "trl"):
        assert fetched[name] == importlib.metadata.version(name), name
    for name in ("torch", "numpy", "transformers", "accelerate", "peft", "pyarrow", "wandb"):
        assert name not in fetched, name
    assert "not fetched: wandb" in done.stdout


@pytest.mark.slow  # two rows of the dry run, each in a process of its own
def test_a_row_past_its_cap_is_stopped_and_the_next_one_runs(tmp_path) -> None:
    out = tmp_path / "out"
    done = _check(
        "--dry-run",
        "--only",
        "micro/sdpa_probe",
        "--only",
        "micro/host_sync",
        "--cap",
        "micro/sdpa_probe=0.5",
        "--out",
        str(out),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    probe, sync = _rows(out)
    assert probe["row"] == "micro/sdpa_probe" and probe["status"] == "TIMED OUT"
    assert "timed out after 0 s" in probe["error"] and probe["seconds"] < 10
    assert sync["row"] == "micro/host_sync" and sync["status"] == "ok", sync
    assert "us per step" in sync["note"]
    table = (out / "table.md").read_text()
    assert "| micro/sdpa_probe | TIMED OUT |" in table and "| micro/host_sync | ok |" in table


@pytest.mark.slow
def test_failed_and_timed_out_jobs_of_a_shared_process_leave_the_rest_running(
    tmp_path, cache_dir
) -> None:
    """Three smoke rows share one process: the first passes its cap (the process is stopped and
    the others start afresh), the second raises (a GPT-2 with fewer positions than its
    checkpoint), the third trains."""
    out = tmp_path / "out"
    done = _check(
        "--dry-run",
        *("--only", "smoke/bert_glue", "--only", "smoke/gpt2_clm", "--only", "smoke/llama_clm"),
        *("--cap", "smoke/bert_glue=1"),
        *("--override", "+model.config_overrides.max_position_embeddings=128"),
        *("--override", f"data.cache_dir={cache_dir}"),
        *("--out", str(out)),
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    glue, gpt2, llama = _rows(out)
    assert (glue["row"], glue["status"]) == ("smoke/bert_glue", "TIMED OUT")
    assert gpt2["row"] == "smoke/gpt2_clm" and gpt2["status"] == "FAILED"
    # The real exception, not Hydra's hint (transformers refuses the mismatched weights).
    assert re.match(r"\w+Error: ", gpt2["error"]), gpt2["error"]
    assert "HYDRA_FULL_ERROR" not in gpt2["error"]
    assert (llama["row"], llama["status"]) == ("smoke/llama_clm", "ok")
    assert llama["loss"] > 0 and llama["tokens_per_s"] > 0
    # Three processes: the timed-out one, the failing one and a fresh one for the last row.
    assert len({glue["log"], gpt2["log"], llama["log"]}) == 3
    files = _archive(out)
    log = files[gpt2["log"].split(":", 1)[1]]
    assert "Traceback (most recent call last)" in log and gpt2["error"] in log
    assert gpt2["error"] in files["smoke-gpt2_clm/job_error.txt"]
    assert "| smoke/gpt2_clm | FAILED |" in (out / "table.md").read_text()


def _every_row() -> set[str]:
    """Every row, comparison and summary of ``--only '*'``."""
    plan = _check("--plan", "--only", "*").stdout
    planned = re.findall(r"^  \d+\. (\S+)", plan, flags=re.MULTILINE)
    return set(planned) | set(COMPARISONS) | {"profile/sub_batches"}


def _matches(row: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(row, p) for p in patterns)


def dry_run_repeats(rows: set[str]) -> set[str]:
    """Of ``rows``, those no dry run runs: another row's job in a dry run (conftest)."""
    return {r for r in rows if _matches(r, GPU_CHECK_DRY_RUN_REPEATS)}


def rows_on_the_cpu(rows: set[str]) -> set[str]:
    """Of ``rows``, those the CPU dry run runs: all but the emulated card's and the repeats
    (conftest)."""
    card = [p for p in GPU_CHECK_ON_THE_CARD if p not in GPU_CHECK_ALSO_ON_THE_CPU]
    return {
        r
        for r in rows - dry_run_repeats(rows)
        if not _matches(r, card) or _matches(r, GPU_CHECK_ALSO_ON_THE_CPU)
    }


@pytest.mark.slow
def test_dry_run_runs_every_row_and_writes_each_as_it_ends(tmp_path, cache_dir) -> None:
    """Every row but those the emulated card's dry run runs (tests/test_emulated_runs.py) and
    the repeats (another row's job once shrunk): each row runs once in CI, on the device path
    where the card can run it."""
    out = tmp_path / "out"
    every_row = _every_row()
    on_cpu = rows_on_the_cpu(every_row)
    assert every_row - on_cpu and {"fsdp/llama_clm", "micro/sdpa_probe"}.isdisjoint(on_cpu)
    started = time.monotonic()
    only = [arg for row in sorted(on_cpu) for arg in ("--only", row)]
    every = ("--dry-run", *only, "--override", f"data.cache_dir={cache_dir}")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *every, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen_while_running = set()
    while proc.poll() is None and time.monotonic() - started < 900:
        rows = out / "rows.jsonl"
        if rows.exists():
            count = len(rows.read_text().splitlines())
            table = (out / "table.md").read_text()
            seen_while_running.add((count, table.count("| not run |")))
        time.sleep(0.5)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    rows = {r["row"]: r for r in _rows(out)}
    assert set(rows) == on_cpu | {"setup/models"}, set(rows) ^ on_cpu
    assert {f"smoke/{r}" for r in RECIPES} <= set(rows)
    # The memory plan's estimate beside a causal LM's row (recipes.plan, logged by the run).
    assert rows["smoke/llama_sft"]["plan_gib"] > 0 and "plan " in rows["smoke/llama_sft"]["note"]
    for name, row in rows.items():
        assert row["status"] == "ok", row
        if row.get("kind") in ("train", "launch"):
            # GRPO's policy loss is a sum of advantages (zero-mean per group): any sign, 0 when
            # every completion of a group scores alike, as a tiny model's mostly do.
            grpo = name == "smoke/llama_grpo"
            assert row["loss"] > 0 or (grpo and math.isfinite(row["loss"])), row
            steps = 4 if name.startswith("profile/") else 2  # 1 warm-up, 1 profiled, 2 timed
            assert row["tokens_per_s"] > 0 and row["steps"] == steps, row
            assert row["mfu"] is None and row["peak_memory_gib"] is None, row
    # Rows were written one by one: rows.jsonl and table.md grew while the check ran.
    partial = [(n, left) for n, left in seen_while_running if 0 < n < len(rows)]
    assert partial and all(left > 0 for _, left in partial), seen_while_running
    table = (out / "table.md").read_text()
    assert "DRY RUN" in table and "| not run |" not in table
    for name in rows:
        assert f"| {name} |" in table, name
    # Issue 44's rows: the profiled jobs leave their profile and the summary is made of them;
    # the QA rows run throughput.py's peers; the generation row compares with continuous
    # batching where transformers has it.
    profile = rows["profile/sub4_a"]["profile"]
    assert profile["profiled"] == 1 and len(profile["steps"]) == 4, profile
    assert profile["steps"][0]["sub"] >= 1 and profile["top_cpu_ops"], profile
    assert rows["profile/sub_batches"]["note"].startswith("likely cause: "), rows
    assert set(rows["bert_squad/defaults"]["ratios"]) == {"run_qa_no_trainer", "run_qa"}
    # throughput.py sft / grpo against TRL's trainers, in their smallest setting (1 round of
    # 2 warm-up and 2 timed steps a side): a ratio, and the report beside the row's log.
    for kind in ("sft", "grpo"):
        row = rows[f"llm/{kind}_vs_trl"]
        assert row["ratio"] > 0 and row["note"].startswith("ours / TRL "), row
    assert "F1 ours" in rows["bert_squad/f1"]["note"]
    files = _archive(out)
    assert "profile-sub4_a/profile_ops.txt" in files and "profile-sub_batches/summary.json" in files
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "rows.jsonl", "table.md"]
    files = _archive(out)
    for row in rows.values():
        if "log" in row:
            assert row["log"].split(":", 1)[1] in files, row["log"]
    assert "bert_large-compile/metrics.jsonl" in files


@pytest.mark.slow  # gpu_check.py in a Python of its own
@pytest.mark.skipif(device.backend() != device.CPU, reason="a device is present")
def test_refuses_without_a_device(tmp_path) -> None:
    done = _check("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "needs a MUSA or CUDA device" in done.stderr
    assert not (tmp_path / "out").exists()


def _profile(step_s: float, new_every: int, first_cost: float, busy: float) -> dict:
    """A profile.json as the step profiler writes it: 5 warm-up, 3 profiled, 22 timed steps; a
    step that meets a new shape pays ``first_cost`` more."""
    steps = []
    for i in range(30):
        new = 1 if new_every and i % new_every == 0 else 0
        steps.append({"s": step_s + new * first_cost, "sub": 4, "new": new, "len": 200})
    counts = {"cudaMalloc": 0.0, "cudaFree": 0.0, "host_syncs": 1.0, "memcpy_dtoh": 1.0,
              "kernel_launches": 3000.0}  # fmt: skip
    return {"warmup": 5, "profiled": 3, "steps": steps, "wall_s_per_step": step_s,
            "device_busy_s_per_step": busy * step_s, "per_step": counts}  # fmt: skip


def test_the_sub_batches_summary_names_first_call_costs_from_the_numbers() -> None:
    sys.path.insert(0, str(ROOT))
    from scripts.gpu_check import summarise_sub_batches

    def row(name: str, profile: dict) -> dict:
        return {"row": f"profile/{name}", "status": "ok", "profile": profile}

    records = [
        row("sub4_a", _profile(0.2, 2, 1.0, 0.3)),  # every other step a new shape, +1 s
        row("sub1_a", _profile(0.13, 0, 0.0, 0.9)),
        row("sub4_pad64", _profile(0.2, 0, 0.0, 0.8)),
    ]
    found = summarise_sub_batches(records)
    assert found["ok"] and found["ratio"] > 3, found
    note = found["note"]
    assert note.startswith("likely cause: first calls of new shapes"), note
    assert "first-call cost of new shapes: 1000 ms per new shape, 0.48 new shapes per step" in note
    assert "device busy" in note and "with lengths to 64" in note
    missing = summarise_sub_batches(records[:1])
    assert not missing["ok"] and "sub1" in missing["error"]


@pytest.mark.slow  # throughput.py in a Python of its own
def test_a_throughput_subcommand_not_merged_fails_its_row_in_one_line(tmp_path) -> None:
    sys.path.insert(0, str(ROOT))
    from scripts.gpu_check import child_llm_peer

    found = child_llm_peer("no-such-subcommand", tmp_path, dry_run=True)
    assert found == {
        "ok": False,
        "error": "scripts/throughput.py has no 'no-such-subcommand' subcommand (not merged yet)",
    }
