"""scripts/gpu_check.py plans every recipe, and refuses clearly where there is no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recipes import device

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def test_dry_run_plans_every_recipe_and_check() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    planned = done.stdout
    for recipe in sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml")):
        assert f"recipe={recipe} " in planned, recipe
    for check in ("model.attn_implementation=sdpa", "model.attn_implementation=eager"):
        assert check in planned
    assert "trainer.compile=true" in planned and "accelerate.commands.launch" in planned


@pytest.mark.skipif(device.backend() != device.CPU, reason="a device is present")
def test_refuses_without_a_device() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "needs a MUSA or CUDA device" in done.stderr
