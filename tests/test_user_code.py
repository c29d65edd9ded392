"""The user's own code named by the config (``task.tools``, ``task.rewards``): a module that does
not compile or raises while it imports is refused in one line naming the file, the line and the
exception (exit 2, no run folder left); a tool or reward that calls ``sys.exit`` or raises
``KeyboardInterrupt`` fails that call, never ends the run as if it had finished."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import run_train

from recipes import rewards, tool_calling
from recipes.config import ConfigError

REWARD = "def fn(completions, **kwargs):\n    return [0.0] * len(completions)\n"

# (module source, the line that fails, the exception's name and message as said)
BROKEN = {
    "syntax": ("import os\ndef fn(completions, **kwargs)\n    return []\n", 2, "SyntaxError"),
    "key": ("import os\n\nTOKEN = os.environ['NO_SUCH_VARIABLE_58']\n" + REWARD, 3, "KeyError"),
    "own_import": ("import json\nimport no_such_package_58\n" + REWARD, 2, "ModuleNotFoundError"),
    "exits": ("import sys\n\n\nsys.exit(0)\n" + REWARD, 4, "SystemExit: 0"),
    "helper": ("from helper_58 import VALUE\n" + REWARD, 1, "ZeroDivisionError"),
}


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> tuple[str, Path]:
    """``case``'s module, written under a name of its own (Python caches modules by name)."""
    name = f"user_code_{case}_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(BROKEN[case][0])
    (tmp_path / "helper_58.py").write_text("VALUE = 1\n\n1 / 0\n")  # fails in a module it imports
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, path


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("key", ["task.rewards", "task.tools"])
def test_a_module_that_fails_to_import_is_named_with_its_line(tmp_path, monkeypatch, case, key):
    name, path = _module(tmp_path, monkeypatch, case)
    _, line, said = BROKEN[case]
    if case == "helper":  # the line is the helper's, where it raised
        path, line = tmp_path / "helper_58.py", 3
    with pytest.raises(ConfigError) as err:
        if key == "task.rewards":
            rewards.build({"name": f"{name}:fn"}, 10)
        else:
            tool_calling.load_tools([f"{name}:fn"])
    message = str(err.value)
    assert message.startswith(f"{key}: importing '{name}:fn' failed at {path}:{line}: {said}")
    assert "\n" not in message


def test_a_missing_module_is_still_cannot_import():
    with pytest.raises(ConfigError, match=r"task\.rewards: cannot import 'no_such_module_58:fn'"):
        rewards.build({"name": "no_such_module_58:fn"}, 10)


@pytest.mark.slow
def test_train_refuses_a_reward_module_that_raises_before_writing(tmp_path, monkeypatch):
    name, path = _module(tmp_path, monkeypatch, "key")
    run = tmp_path / "run"
    proc = run_train(
        "recipe=llama_grpo",
        "debug=smoke",
        "logger=none",
        f"task.rewards=[{{name: '{name}:fn'}}]",
        f"output_dir={run}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: task.rewards: importing '{name}:fn' failed at {path}:3: KeyError" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists()  # nothing written: not even the empty folder Hydra made


# ------------------------------------------------------------------------------- exits at call


def exits(x: int) -> str:
    """Exit.

    Args:
        x: anything
    """
    raise SystemExit(0)


def interrupts(x: int) -> str:
    """Interrupt.

    Args:
        x: anything
    """
    raise KeyboardInterrupt


@pytest.mark.parametrize("tool", [exits, interrupts])
def test_a_tool_that_exits_fails_its_call(tool):
    call = {"type": "function", "function": {"name": tool.__name__, "arguments": {"x": 1}}}
    name, content, failed = tool_calling.run_call(call, {tool.__name__: tool}, timeout=5.0)
    assert (name, failed) == (tool.__name__, True)
    assert content.startswith("{'error': ") and tool.__name__ in content
    assert ("SystemExit" if tool is exits else "KeyboardInterrupt") in content


def _scores(fn) -> list[float]:
    return rewards.scores(fn, "mine", ["row 3", "row 4"], ["p", "q"], ["a", "b"], [[1], [2]], {})


@pytest.mark.parametrize("stop", [SystemExit(0), KeyboardInterrupt()])
def test_a_reward_that_exits_stops_the_run_in_one_line(stop):
    def reward(completions, **kwargs):
        if "b" in completions:
            raise stop
        return [1.0] * len(completions)

    with pytest.raises(ConfigError) as err:
        _scores(reward)
    message = str(err.value)
    assert message.startswith(f"task.rewards: mine raised {type(stop).__name__}")
    assert "on completion 1 (the prompt of row 4)" in message
    assert f"{Path(__file__)}:" in message and "\n" not in message


def test_a_ctrl_c_during_a_reward_is_still_the_users_stop():
    """A KeyboardInterrupt raised by the process's SIGINT handler (the second Ctrl-C of
    recipes.faults) is not the reward's failure: it goes on up."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    def reward(completions, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return [1.0] * len(completions)

    before = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _scores(reward)
    finally:
        signal.signal(signal.SIGINT, before)
