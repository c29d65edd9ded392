"""Every task's typed settings (``task.*``): one dataclass per task, in one module per task family
beside this file, light to import (no torch): the config is checked before anything heavy loads.

A task's dataclass subclasses :class:`TaskConfig` and names itself (``NAME``, the option of
``conf/task/``): it is registered with Hydra's ConfigStore as ``task/base_<NAME>``, and
``conf/task/<NAME>.yaml`` lists it first in its defaults, so a misspelt key or a value of the
wrong type fails when the config is composed, naming the key. The dataclass is the one place a
default is written, with a comment on its trade-off, as :class:`recipes.config.TrainerConfig`
does for ``trainer.*``. What a type cannot say goes in ``RANGES`` (one row per key: a test and
what a good value is) and in ``check`` (settings that contradict each other); both run in
:func:`recipes.config.validate`, before any data or model is read. Fields that shape the
features are marked with :func:`feature`: they, and only they, are the features' cache key.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from recipes.errors import ConfigError

FEATURES = "features"


def feature(default: Any = MISSING, **kwargs: Any) -> Any:
    """A field that shapes the task's features (part of their cache key)."""
    if isinstance(default, list | dict):
        kwargs["default_factory"] = lambda default=default: type(default)(default)
        return field(metadata={FEATURES: True}, **kwargs)
    return field(default=default, metadata={FEATURES: True}, **kwargs)


def at_least(low: float) -> Callable[[Any], bool]:
    return lambda value: value is not None and value >= low


def null_or_at_least(low: float) -> Callable[[Any], bool]:
    return lambda value: value is None or value >= low


def within(low: float, high: float) -> Callable[[Any], bool]:
    """``low <= value <= high``."""
    return lambda value: value is not None and low <= value <= high


@dataclass
class TaskConfig:
    """The settings every task config has: the Task class it builds (``_target_``)."""

    NAME: ClassVar[str] = ""  # the option of conf/task/ (task=NAME)
    # (key, test, what a good value is), checked in order: the first that fails is refused as
    # "task.<key>=<value>: <rule>."
    RANGES: ClassVar[tuple[tuple[str, Callable[[Any], bool], str], ...]] = ()

    _target_: str = MISSING

    def check(self) -> None:
        """Settings that contradict each other: raise ConfigError naming the keys."""

    def choose(self, key: str, choices: Collection[Any], how: str | None = None) -> None:
        """Refuse ``task.<key>`` outside ``choices`` in one line: "task.<key>=<value>: choose
        <how>." (``how`` says what each choice does; by default the choices, joined)."""
        value = getattr(self, key)
        if value not in choices:
            raise ConfigError(f"task.{key}={value!r}: choose {how or ', '.join(choices)}.")

    def validate(self) -> None:
        for key, ok, rule in self.RANGES:
            value = getattr(self, key)
            if not ok(value):
                raise ConfigError(f"task.{key}={value}: {rule}.")
        self.check()

    def features_key(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get(FEATURES)}


def config_classes() -> dict[str, type[TaskConfig]]:
    """Every task config of this package, by ``NAME``."""
    found: dict[str, type[TaskConfig]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, TaskConfig) and value.NAME:
                found[value.NAME] = value
    return found


def register() -> None:
    """Store every task config as ``task/base_<NAME>`` (what conf/task/<NAME>.yaml extends)."""
    store = ConfigStore.instance()
    for name, cls in config_classes().items():
        store.store(group="task", name=f"base_{name}", node=cls)
