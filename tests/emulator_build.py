"""Where the emulated MUSA device (``tests/musa_emulator``) is built and which cards it plays,
without importing torch: ``scripts/emulated_musa.py`` checks here that the build exists before
it hands over to the command, so a run on the emulated card pays torch's import once (in the
command), not twice."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "musa_emulator" / "csrc" / "emulator.cpp"
NAME = "musa_emulator_ext"


@dataclass(frozen=True)
class Card:
    """A MUSA card as its driver reports it."""

    name: str
    capability: tuple[int, int]
    memory_gib: int
    mccl: bool  # S80 / S3000 builds of torch_musa ship without MCCL


# The S5000 (MUSA 3.1, 80 GB; press figures, tests/test_device_env.py cites them) carries the
# driver's name by analogy with the S4000's; MCCL as in the S4000's builds (multi-card training
# on S5000 clusters is what Moore Threads sells it for).
CARDS = {
    "S5000": Card("MTT S5000", (3, 1), 80, True),
    "S4000": Card("MTT S4000", (2, 2), 48, True),
    "S3000": Card("MTT S3000", (2, 1), 32, False),
    "S80": Card("MTT S80", (2, 1), 16, False),
}


def cache_root() -> Path:
    found = os.environ.get("MUSA_EMULATOR_CACHE")
    if found:
        return Path(found)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "musa-recipes" / "emulated-musa"


def torch_build() -> tuple[str, str]:
    """The installed torch's version and its ``torch/version.py`` (version, commit and
    toolkit of that build: one text per build), read without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the emulated MUSA device needs torch installed")
    text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    found = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return (found.group(1) if found else "unknown"), text


def build_dir() -> Path:
    """Where this torch build's compiled extension lives: one folder per torch build, Python and
    source (a changed source or another torch builds anew, never loads a stale library)."""
    version, build = torch_build()
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(NAME.encode())
    key.update(build.encode())
    key.update(sys.version.encode())
    return cache_root() / f"torch-{version}-{key.hexdigest()[:16]}"


def built() -> bool:
    """Whether this torch build's extension is compiled (and loads without a build)."""
    return (build_dir() / "built").exists()
