"""Tasks built from ``conf/task/<name>.yaml``, the one place their defaults are written.

Its own module, free of conftest's side effects (the offline hub settings), so that scripts
(benchmarks) build their tasks the same way as the tests, which import it through conftest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from recipes.config import instantiate

TASK_CONF = Path(__file__).resolve().parents[1] / "conf" / "task"


def make_task(name: str, **overrides: Any) -> Any:
    """The task ``conf/task/<name>.yaml`` builds, with ``overrides`` on top, as train.py builds it
    (a key the YAML lacks is refused, as on the command line)."""
    task_cfg = OmegaConf.load(TASK_CONF / f"{name}.yaml")
    OmegaConf.set_struct(task_cfg, True)
    # A task that reads the run's generation.* (``generation: ${generation}``) gets its defaults.
    root = {"task": OmegaConf.merge(task_cfg, overrides), "generation": {}}
    return instantiate(OmegaConf.create(root), "task")
