"""The run folder Hydra makes for a run: ``${run_folder:...}`` (``hydra.run.dir``) names it, and a
run refused before it started removes it again. Light to import (no torch): the resolver is
registered with the typed settings (:func:`recipes.config.register_resolvers`), and ``train.py``
removes the folder while reporting a refused setting."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Folders Hydra was asked to make for this process's run: path -> the highest of it and its
# parents that did not exist yet (None: it existed). :func:`run_folder` notes it,
# :func:`remove_unused_run_folder` reads it.
_run_folders: dict[str, str | None] = {}


def run_folder(default: str, *, _root_: Any) -> str:
    """``${run_folder:default}``, Hydra's run (or sweep) folder: the run's ``output_dir`` when
    one is set (command line, recipe, ``conf/local``), else ``default``.

    ``output_dir`` defaults to Hydra's runtime folder, which is this one: reading it then would
    be a cycle, so the raw value says whether it was set. Without this, every run given
    ``output_dir=`` also left an empty ``outputs/<recipe>/<date_time>/``.
    """
    node = _root_._get_node("output_dir") if "output_dir" in _root_ else None
    raw = "" if node is None else str(node._value())
    chosen = default if not raw or "hydra:runtime.output_dir" in raw else str(_root_.output_dir)
    path = os.path.abspath(chosen)
    if path not in _run_folders:
        new = None
        for folder in [path, *map(str, Path(path).parents)]:
            if os.path.exists(folder):
                break
            new = folder
        _run_folders[path] = new
    return chosen


def remove_unused_run_folder(output_dir: str) -> None:
    """Remove ``output_dir`` (and the parents made with it, ``outputs/<recipe>``) when Hydra made
    it for this run and nothing was written to it (a run refused before it started): a refused
    command leaves nothing behind."""
    path = os.path.abspath(output_dir)
    top = _run_folders.get(path)
    if top is None:
        return
    for folder in [path, *map(str, Path(path).parents)]:
        try:
            os.rmdir(folder)  # only an empty folder
        except OSError:
            return
        if folder == top:
            return
