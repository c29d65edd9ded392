"""No import circles in ``recipes/`` and ``scripts/``, not even behind a function-level import,
and settings checked before torch (STYLE.md item 26).

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` of a
module (at its top, in a function, under ``TYPE_CHECKING``, relative ones too) and every
``importlib.import_module("<literal>")`` that names a module of these packages. When two modules
need each other, what they share goes into a third module.
"""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("recipes", "scripts")
# Edges of a known circle, left out of the graph until the change that removes them lands.
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()
# What validating a config must not import (train.py: "Settings first, before torch").
HEAVY = ("torch", "transformers", "accelerate", "peft")

Graph = dict[str, dict[str, int]]  # module -> {module it imports: first line}


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by dotted name (a package by its own)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, package: str, known: dict[str, Path]) -> list[str]:
    """The dotted names an import statement (or ``importlib.import_module`` call) brings in."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the module's package, one level up per extra dot
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        # ``from a import b`` imports module a.b when there is one, else a name of a.
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that ``name`` is, or is a name in (None: outside them)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    known = modules(root, packages)
    graph: Graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for imported in _imported(node, package, known):
                target = _resolve(imported, known)
                if target is not None and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as the modules in
    import order with the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_cycle_in(graph, set(group), group[0]) for group in sorted(groups)]


def _cycle_in(graph: Graph, group: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself within ``group`` (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(graph[module]):
            if target == start:
                return [*paths[module], start]
            if target in group and target not in paths:
                paths[target] = [*paths[module], target]
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group has one


def _described(graph: Graph, cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


def test_no_import_circles(graph: Graph) -> None:
    pruned = {module: dict(edges) for module, edges in graph.items()}
    for source, target in KNOWN_CIRCLE_EDGES:
        pruned[source].pop(target, None)
    found = cycles(pruned)
    assert not found, "import circles (what both sides need belongs in a third module):\n" + (
        "\n".join(_described(pruned, cycle) for cycle in found)
    )


def test_known_circle_edges_still_exist(graph: Graph) -> None:
    """An exception outlives its circle unnoticed otherwise: delete it once its edge is gone."""
    gone = [edge for edge in KNOWN_CIRCLE_EDGES if edge[1] not in graph.get(edge[0], {})]
    assert not gone, f"{gone} no longer imported: remove them from KNOWN_CIRCLE_EDGES"


def test_the_graph_sees_function_level_relative_and_dynamic_imports(tmp_path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for init in (package / "__init__.py", package / "sub" / "__init__.py"):
        init.write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n"
    )
    (package / "c.py").write_text(
        textwrap.dedent(
            """
            import importlib

            def g():
                return importlib.import_module("pkg.a")
            """
        )
    )
    (package / "d.py").write_text("import pkg.sub.b\nfrom pkg import c\nimport json\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.sub.b": 2}
    assert graph["pkg.sub.b"] == {"pkg.c": 3}
    assert graph["pkg.c"] == {"pkg.a": 5}
    assert graph["pkg.d"] == {"pkg.sub.b": 1, "pkg.c": 2}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


# Run in a process of its own, where torch and the other heavy libraries cannot be imported
# (an attempt raises ImportError, and is noted even where the importer catches it): train.py run in
# turn with each command line (runpy, as `python train.py ...`), then one recipe of each task
# composed and validated with peft=lora. Prints what happened as JSON.
_WITHOUT_HEAVY = """
import contextlib, io, json, os, re, runpy, sys, traceback
from pathlib import Path

HEAVY = {heavy!r}
attempts = []


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            attempts.append(name)
            raise ImportError(f"{{name}} is not available here")
        return None


sys.meta_path.insert(0, Refuse())
refusals = []
for args in {commands!r}:
    os.environ.pop("HYDRA_FULL_ERROR", None)  # train.py's cli sets it for the run
    sys.argv = ["train.py", *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path("train.py", run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code
    except Exception as crashed:  # an ImportError of the heavy ones, say
        code, err = f"{{type(crashed).__name__}}: {{crashed}}", io.StringIO(traceback.format_exc())
    refusals.append({{"code": code, "stderr": err.getvalue()}})
refused_attempts = sorted(set(attempts))

from hydra import compose, initialize_config_dir

from recipes.config import register_resolvers, validate
from recipes.tasks.configs import config_classes

register_resolvers()
recipe_of = {{}}  # task -> the first recipe that trains it
for path in sorted(Path("conf/recipe").glob("*.yaml")):
    task = re.search(r"override /task: (\\w+)", path.read_text()).group(1)
    recipe_of.setdefault(task, path.stem)
validated, failed = [], {{}}
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    for recipe in recipe_of.values():
        overrides = [f"recipe={{recipe}}", "debug=smoke", "peft=lora", "output_dir=/unused"]
        try:
            settings = validate(compose("train", overrides=overrides))
        except Exception:
            failed[recipe] = traceback.format_exc()
            continue
        validated.append(type(settings.task).NAME if settings.peft.method == "lora" else None)
print(json.dumps({{
    "refusals": refusals,
    "refused_attempts": refused_attempts,
    "validated": validated,
    "failed": failed,
    "tasks": sorted(config_classes()),
    "attempts": sorted(set(attempts)),
    "heavy": sorted(name for name in sys.modules if name.partition(".")[0] in HEAVY),
}}))
"""

REFUSED_WITHOUT_TORCH = {
    ("peft=lora", "peft.r=-1"): "peft.r=-1",
    ("recipe=llama_dpo", "debug=smoke", "task.beta=-1"): "task.beta=-1",
    ("recipe=llama_grpo", "debug=smoke", "task.beta=-1"): "task.beta=-1",
    ("task.bogus=1",): "task.bogus=1",
}


@pytest.fixture(scope="module")
def without_heavy(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("refused")
    commands = [
        [*args, f"output_dir={out / str(i)}"] for i, args in enumerate(REFUSED_WITHOUT_TORCH)
    ]
    script = _WITHOUT_HEAVY.format(heavy=HEAVY, commands=commands)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["folders"] = sorted(p.name for p in out.iterdir())
    return report


@pytest.mark.slow  # a Python of its own, torch made unimportable
def test_bad_settings_are_refused_in_one_line_without_torch(without_heavy) -> None:
    for (args, key), result in zip(
        REFUSED_WITHOUT_TORCH.items(), without_heavy["refusals"], strict=True
    ):
        lines = result["stderr"].strip().splitlines()
        assert result["code"] == 2 and len(lines) == 1, (args, result["stderr"][-3000:])
        assert lines[0].startswith(f"error: {key}"), (args, lines[0])
    assert without_heavy["refused_attempts"] == [], "refusing a setting tried to import them"
    assert without_heavy["folders"] == []  # a refused run leaves no folder


@pytest.mark.slow  # the same Python of its own as above
def test_composing_and_validating_a_config_imports_no_torch(without_heavy) -> None:
    """One recipe of every task (its typed config checked), with LoRA's settings."""
    assert without_heavy["failed"] == {}
    assert sorted(without_heavy["validated"]) == without_heavy["tasks"]
    assert without_heavy["attempts"] == [], "validating a config tried to import them"
    assert without_heavy["heavy"] == []
