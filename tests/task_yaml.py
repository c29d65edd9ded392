"""Tasks built from their typed config (``recipes/tasks/configs``), where their defaults are
written, as train.py builds them from ``conf/task/<name>.yaml`` (which extends that config).

Its own module, free of conftest's side effects (the offline hub settings), so that scripts
(benchmarks) build their tasks the same way as the tests, which import it through conftest.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

import recipes.config  # noqa: F401  (registers the task configs)
from recipes.tasks.configs import config_classes


def task_config(name: str, **overrides: Any) -> Any:
    """The checked config of ``task=<name>`` with ``overrides`` on top (a key the config lacks
    is refused, as on the command line)."""
    merged = OmegaConf.merge(OmegaConf.structured(config_classes()[name]), overrides)
    config = OmegaConf.to_object(merged)
    config.validate()
    return config


def make_task(name: str, **overrides: Any) -> Any:
    """The task ``task=<name>`` builds, with ``overrides`` on top."""
    from recipes.modes import build_task

    return build_task(task_config(name, **overrides))
