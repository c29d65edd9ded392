"""The task contract of recipes/tasks/base.py, read from the tasks' source: a task keeps no state
beyond its declared parts, and the chat family is used through its front door only."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from recipes.tasks import chat
from recipes.tasks.base import Layout, Task

ROOT = Path(__file__).resolve().parents[1]
TASKS = sorted((ROOT / "recipes" / "tasks").glob("*.py"))


def _task_classes() -> list[tuple[Path, ast.ClassDef, type]]:
    found = []
    for path in TASKS:
        module = importlib.import_module(f"recipes.tasks.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            cls = getattr(module, getattr(node, "name", ""), None)
            if isinstance(node, ast.ClassDef) and isinstance(cls, type) and issubclass(cls, Task):
                found.append((path, node, cls))
    return found


def _set_on_self(function: ast.FunctionDef) -> list[tuple[int, str]]:
    """(line, attribute) of every ``self.<attribute>...`` a function assigns to."""
    out = []
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            while isinstance(target, ast.Attribute | ast.Subscript):
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", "") == "self":
                    out.append((node.lineno, target.attr))
                    break
                target = target.value
    return out


def test_every_task_module_is_found():
    names = {cls.__name__ for _, _, cls in _task_classes()}
    assert {"SupervisedFineTuning", "DirectPreference", "KahnemanTversky"} <= names
    assert {"GroupRelativePolicy", "KnowledgeDistillation", "RewardModel"} <= names


@pytest.mark.parametrize("path,node,cls", _task_classes(), ids=lambda v: getattr(v, "name", ""))
def test_a_task_sets_no_attribute_after_init_but_its_declared_parts(path, node, cls):
    """Only ``__init__`` sets attributes; ``before_training`` builds the declared ``parts``
    (a reference, a teacher, rollouts); ``build_data`` may settle ``main_metric`` (base.py)."""
    wrong = []
    for function in node.body:
        if not isinstance(function, ast.FunctionDef) or function.name == "__init__":
            continue
        for line, attribute in _set_on_self(function):
            declared = attribute in cls.parts or (
                attribute == "main_metric" and function.name == "build_data"
            )
            if not declared:
                wrong.append(f"{path.name}:{line} {function.name} sets self.{attribute}")
    assert not wrong, "\n".join(wrong)


def test_the_layout_is_decided_once():
    layout = Layout()
    layout.decide(True)
    layout.decide(True)
    assert layout.flat
    with pytest.raises(RuntimeError, match="decided as flat=True already"):
        layout.decide(False)


def test_only_the_chat_package_reaches_into_its_modules():
    """Outside recipes/tasks/chat/, the chat family is imported as ``recipes.tasks.chat`` and
    used through its public names (``__all__``), never ``recipes.tasks.chat.<module>``."""
    inside = ROOT / "recipes" / "tasks" / "chat"
    wrong = []
    for path in [*(ROOT / "recipes").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        if inside in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "recipes.tasks.chat."
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
            if isinstance(node, ast.ImportFrom) and node.module == "recipes.tasks.chat":
                names = {alias.name for alias in node.names}
                wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names - set(chat.__all__)]
            private = isinstance(node, ast.Attribute) and (
                node.attr.startswith("_")
                or (node.attr not in chat.__all__ and hasattr(chat, node.attr))
            )
            if private and getattr(node.value, "id", "") == "chat":
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} chat.{node.attr}")
    assert not wrong, "\n".join(wrong)
