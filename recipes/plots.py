"""Pictures of runs: loss, learning rate and evaluation metrics over optimizer steps.

Read from each run folder's ``metrics.jsonl`` (written whatever the logger), so they exist where
wandb is not allowed. Several runs are overlaid on the same axes, one colour each::

    python scripts/plot_run.py outputs/bert_squad/2026-11-30_10-00-00 outputs/bert_squad/...

matplotlib's object API draws without touching the global backend, so importing this module
never changes how the caller's own plots behave.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Training panels first, in this order; then every evaluation metric that varies.
_TRAIN_PANELS = ("train/loss", "train/lr", "train/grad_norm")
# Evaluation numbers that describe the evaluation, not the model.
_NOT_METRICS = ("runtime_s", "tokens", "samples")


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (a line torn by a crash is skipped)."""
    records = []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not a run folder (no metrics.jsonl)")
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [
        (r["step"], r[key])
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [p[0] for p in points], [p[1] for p in points]


def _panels(runs: dict[str, list[dict]]) -> list[str]:
    keys = {k for records in runs.values() for r in records for k in r}
    evals = sorted(k for k in keys if k.startswith("eval/") and not k.endswith(_NOT_METRICS))
    return [k for k in _TRAIN_PANELS if k in keys] + evals


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's folder name, with its parent's where names collide (sweep jobs 0, 1, ...)."""
    names = [p.name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.parent.name}/{p.name}" for p in run_dirs]


def plot_runs(run_dirs: Sequence[Path], out: Path, labels: Sequence[str] | None = None) -> Path:
    """Draw the curves of ``run_dirs`` (overlaid) into the PNG ``out``; returns ``out``."""
    run_dirs = [Path(p) for p in run_dirs]
    labels = list(labels) if labels else _labels(run_dirs)
    runs = {label: read_metrics(p) for label, p in zip(labels, run_dirs, strict=True)}
    panels = _panels(runs)
    if not panels:
        raise ValueError(f"nothing to plot in {', '.join(map(str, run_dirs))} (no metrics yet)")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    figure = Figure(figsize=(5 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False).ravel()
    for ax, key in zip(axes, panels, strict=False):
        for index, (label, records) in enumerate(runs.items()):
            steps, values = _series(records, key)
            if not steps:
                continue
            sparse = len(steps) <= 20  # evaluations: a few points, so mark them
            ax.plot(
                steps,
                values,
                marker="o" if sparse else None,
                markersize=3,
                linewidth=1.2,
                color=f"C{index % 10}",
                label=label,
            )
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(left=0)  # every panel from the start of training
        ax.grid(alpha=0.3)
        if key == "train/lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if len(runs) > 1:
        handles, names = axes[0].get_legend_handles_labels()
        figure.legend(handles, names, loc="outside lower center", ncols=min(len(runs), 4))
    figure.suptitle(labels[0] if len(runs) == 1 else f"{len(runs)} runs")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out
