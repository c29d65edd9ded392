"""The errors a run reports in one line, and nothing else: light to import (no torch), so that
the typed settings (:mod:`recipes.config`, :mod:`recipes.tasks.configs`), the checkpoints and
``train.py`` share them without importing each other. :mod:`recipes.config` re-exports the first
three and :mod:`recipes.faults` :class:`TrainingError`, where most code imports them from."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is wrong; the message names the key and how to fix it."""


class DataError(ValueError):
    """The data cannot be used as given; the message names the file, example and field.
    (``train.py`` catches it beside :class:`ConfigError` without importing torch and datasets;
    ``recipes.data`` re-exports it.)"""


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to change."""


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none), for one-line
    messages that quote a library's error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
