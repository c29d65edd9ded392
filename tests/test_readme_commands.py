"""Every ``train.py`` command of README.md and docs/*.md composes as written (``--cfg job``), and
the cheapest offline ones run (``-m slow``).

Commands come from the indented or fenced code blocks (backslash continuations joined, the
block's shell variables and loops expanded by bash itself) and from inline code spans. Whatever
precedes ``train.py`` (``python``, ``accelerate launch ...``, ``torchrun ...``, the emulator, a
container's entry point) is replaced by this venv's python; a sweep (``-m``) composes its first
job. Placeholders get the values in PLACEHOLDERS: composing does not read paths.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from in_process import run_train_here

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# <...> placeholders the prose explains, and the shell variables the docs set by running a
# command (values only need to compose).
PLACEHOLDERS = {
    "<run>": "2026-01-01_00-00-00",  # a run folder, or its name under outputs/<recipe>/
    "<final/>": "outputs/bert_squad/2026-01-01_00-00-00/final",
    "<rows>": "rows.jsonl",
    "<any recipe>": "bert_squad",
}
SHELL_VARIABLES = {"M": "/models/minilm", "S": "../shared/data/squad"}
# Commands that name no complete set of overrides: the prose fills them in.
INCOMPLETE = {
    "...": "its overrides are left to the reader (`train.py ...`)",
    "recipe=...": "the recipe is left to the reader (`--cfg job recipe=...`)",
}

# A command that runs train.py (not a line of prose or of the README's layout that names it).
LAUNCH = re.compile(r"\b(python3?|accelerate|torchrun|docker)\b.*\btrain\.py\b")
_SEP, _END = "\x1f", "\x1e"


def _code_blocks(text: str) -> list[list[str]]:
    """Indented (4 spaces, after a blank line) and fenced code blocks, as lists of lines."""
    blocks: list[list[str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines)
            )
            blocks.append(lines[i + 1 : end])
            i = end + 1
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            block = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                block.append(lines[i][4:])
                i += 1
            blocks.append(block)
        else:
            i += 1
    return blocks


def _to_shell(block: list[str]) -> str:
    """The block's assignments, loops and train.py commands, each train.py command (with what
    launches it) turned into a call of ``_train``; everything else is dropped."""
    joined = "\n".join(block).replace("\\\n", " ").splitlines()
    kept = []
    for line in joined:
        stripped = line.strip()
        if LAUNCH.search(stripped):
            kept.append(_call(stripped))
        elif re.match(r"^(for|do|done)\b", stripped):
            kept.append(stripped)
        elif re.match(r"^[A-Za-z_]\w*=", stripped) and not re.search(r"\$\(|`", stripped):
            kept.append(stripped)  # no command substitution runs here: SHELL_VARIABLES has those
    return "\n".join(kept) if any("_train" in line for line in kept) else ""


def _call(line: str) -> str:
    line = re.sub(r"\s+#.*$", "", line)
    if not line.startswith("for "):  # keep only the train.py part of `a && b && train.py ...`
        line = next(part for part in line.split(" && ") if "train.py" in part)
    return re.sub(r"(^|; do |\bdo |; )[^;&|]*?\btrain\.py\b", r"\1_train", line)


def _expand(script: str) -> list[list[str]]:
    """Run the kept lines in bash with ``_train`` printing its arguments."""
    for placeholder, value in PLACEHOLDERS.items():  # before bash reads `<run>` as a redirection
        script = script.replace(placeholder, value)
    variables = "".join(f"{k}={v}\n" for k, v in SHELL_VARIABLES.items())
    shim = f"set -f\n_train() {{ printf '%s{_SEP}' \"$@\"; printf '{_END}'; }}\n"
    out = subprocess.run(
        ["bash", "-c", shim + variables + script], capture_output=True, text=True, check=True
    ).stdout
    return [record.split(_SEP)[:-1] for record in out.split(_END)[:-1]]


def _inline(text: str) -> list[list[str]]:
    """`... train.py ...` code spans outside code blocks."""
    commands = []
    for span in re.findall(r"`([^`\n]*\btrain\.py [^`\n]*)`", text):
        if LAUNCH.search(span):
            commands.extend(_expand(_call(span)))
    return commands


def _sweep_first_job(args: list[str]) -> list[str]:
    """``-m key=a,b`` composes as its first job (``--cfg`` and ``-m`` exclude each other)."""
    if "-m" not in args and "--multirun" not in args:
        return args
    first = []
    for arg in args:
        if arg in ("-m", "--multirun"):
            continue
        key, eq, value = arg.partition("=")
        if eq and "," in value and not value.startswith(("[", "{", "'", '"')):
            value = value.split(",")[0]
        first.append(f"{key}{eq}{value}")
    return first


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, train.py's arguments) for every train.py command of the README and docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        commands = [c for block in _code_blocks(text) for c in _expand(_to_shell(block))]
        outside = re.sub(r"(?m)^(    .*|```[\s\S]*?```)$", "", text)
        commands += _inline(outside)
        for args in commands:
            found.append((doc.name, args))
    unique = {(where, tuple(args)): None for where, args in found}
    return [(where, list(args)) for where, args in unique]


COMMANDS = documented_commands()


def _id(where: str, args: list[str]) -> str:
    return f"{where}: train.py {' '.join(args)}"[:150]


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 40
    assert ("README.md", ["recipe=bert_squad", "debug=smoke"]) in COMMANDS


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[_id(*c) for c in COMMANDS])
def test_documented_command_composes(where, args):
    for marker, reason in INCOMPLETE.items():
        if marker in args:
            pytest.skip(reason)
    args = _sweep_first_job(args)
    if "--cfg" not in args:
        args = [*args, "--cfg", "job"]
    proc = run_train_here(args, cwd=ROOT, env=_env())  # in this process: no Python start-up
    assert proc.returncode == 0, f"{where}: train.py {' '.join(args)}\n{proc.stderr[-3000:]}"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A documented command as written, its outputs under tmp_path (run in this process, as
    conftest.run_train runs train.py)."""
    return run_train_here(
        [*args, f"hydra.sweep.dir={tmp_path}/multirun"],
        cwd=tmp_path,
        env={**_env(), "RECIPES_CACHE": str(tmp_path / "cache")},
    )


def _f1(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [m["eval/f1"] for m in map(json.loads, lines) if "eval/f1" in m]


@pytest.mark.slow
def test_readme_first_command_trains_as_it_says(tmp_path):
    """README's first command's run (about 2.5 min on 2 cores): F1 from about 10 to about 38."""
    proc = _run(tmp_path, "recipe=bert_squad", "debug=smoke", f"output_dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    f1 = _f1(tmp_path / "run")
    assert f1[0] < 20 and f1[-1] > 30, f1
    assert (tmp_path / "run" / "final" / "config.json").is_file()


@pytest.mark.slow
def test_the_readme_smoke_command_of_another_recipe_runs(tmp_path):
    """README: every recipe has a bundled smoke run (docs/runs.md's sweep runs in
    tests/test_tracking.py, and is composed above)."""
    args = ["recipe=gpt2_clm", "debug=smoke"]
    assert any(c == args for _, c in COMMANDS), f"no longer in the docs: {args}"
    proc = _run(tmp_path, *args, f"output_dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(sorted(tmp_path.rglob("results.json"))) == 1
