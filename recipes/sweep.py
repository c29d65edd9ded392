"""Hydra sweeps: one table of every job's final metrics when a multirun ends.

    python train.py -m recipe=bert_squad optimizer.lr=1e-5,3e-5,5e-5

Each job trains in its own folder (``<sweep dir>/<job number>``) and leaves ``results.json``
there; :class:`SweepSummary`, a Hydra callback registered in ``conf/train.yaml``, then writes
``summary.csv`` and ``summary.md`` (a row per job: the overrides that differ between jobs, the
main metric, every final evaluation metric) and ``curves.png`` (all jobs overlaid) in the sweep
folder. When ``trainer.seed`` is swept, ``seeds.md`` also gives each setting's mean, standard
deviation and range over its seeds. It only reads files, so it works the same for any Hydra
launcher.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from recipes.log import get_logger

log = get_logger(__name__)


class SweepSummary(Callback):
    """Writes the sweep's summary table when Hydra's multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Under a multi-process launch the jobs shared one process group (recipes.modes.run);
        # ended here, on every rank, as a single run's end_training ends its own.
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) != 0:  # one writer under a multi-process launch
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        written = write_summary(sweep_dir)
        if not written:
            return
        log.info(
            "sweep summary: %s\n%s",
            ", ".join(str(p) for p in written),
            (sweep_dir / "summary.md").read_text(),
        )
        failed = [r["job"] for r in summarise(sweep_dir) if r["status"].startswith("failed")]
        if failed:
            log.error("sweep: job(s) %s failed (see summary.md and their failed.json)", failed)
            raise SystemExit(1)


def _job_dirs(sweep_dir: Path) -> list[Path]:
    jobs = [
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and ((p / "config.yaml").exists() or (p / "failed.json").exists())
    ]
    return sorted(
        jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    )


def _overrides(values: list[str]) -> dict[str, str]:
    pairs = (v.split("=", 1) for v in values if "=" in v)
    return {k.lstrip("+~"): v for k, v in pairs}


def summarise(sweep_dir: Path) -> list[dict[str, Any]]:
    """A row per job folder of ``sweep_dir``: job, swept overrides, status, metrics."""
    jobs = []
    for folder in _job_dirs(sweep_dir):
        path = folder / "results.json"
        if not path.exists():
            path = folder / "failed.json"
        results = json.loads(path.read_text()) if path.exists() else None
        jobs.append((folder, results))
    overrides = [_overrides(r["overrides"]) if r else {} for _, r in jobs]
    keys = sorted({k for o in overrides for k in o})
    # Only what differs between jobs is a column; the rest is the same run everywhere.
    swept = [k for k in keys if len({o.get(k) for o in overrides}) > 1] or keys
    rows = []
    for (folder, results), own in zip(jobs, overrides, strict=True):
        row: dict[str, Any] = {"job": folder.name}
        row.update({k: own.get(k, "") for k in swept})
        if results is None:
            row["status"] = "unfinished"
        elif "error" in results:
            row["status"] = "failed: " + results["error"].splitlines()[0][:120]
        else:
            row["status"] = "done"
            row[results["main_metric"]] = results["main_value"]
            for key, value in results["metrics"].items():
                if not key.endswith(("runtime_s", "tokens", "samples")):  # not the model's
                    row.setdefault(key, value)
            row["steps"] = results["steps"]
            row["train_seconds"] = round(results["train_seconds"], 1)
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value).replace("|", "\\|")


SEED = "trainer.seed"


def _markdown(columns: list[str], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
        *("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows),
    ]
    return "\n".join(lines) + "\n"


def over_seeds(
    rows: list[dict[str, Any]], swept: list[str]
) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per setting of the swept keys other than the seed: for each metric of its
    finished jobs, ``mean ± sd (min-max)``, and how many seeds finished."""
    keys = [k for k in swept if k != SEED]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    metrics = [
        c
        for c in dict.fromkeys(c for row in rows for c in row)
        if c not in (*swept, "job", "status", "steps")
        and all(isinstance(r.get(c), float | int) for r in rows if r["status"] == "done")
    ]
    table = []
    for values, members in groups.items():
        done = [r for r in members if r["status"] == "done"]
        out: dict[str, Any] = dict(zip(keys, values, strict=True))
        out["seeds"] = f"{len(done)} of {len(members)}"
        for metric in metrics:
            found = [float(r[metric]) for r in done if metric in r]
            if found:
                sd = statistics.stdev(found) if len(found) > 1 else 0.0
                out[metric] = (
                    f"{statistics.mean(found):.4g} ± {sd:.2g} ({min(found):.4g}-{max(found):.4g})"
                )
        table.append(out)
    return [*keys, "seeds", *metrics], table


def write_summary(sweep_dir: Path) -> list[Path]:
    """``summary.csv``, ``summary.md`` and ``curves.png`` in ``sweep_dir``; the paths written."""
    rows = summarise(sweep_dir)
    if not rows:
        return []
    columns = list(dict.fromkeys(k for row in rows for k in row))
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    md_path.write_text(_markdown(columns, rows))
    written = [csv_path, md_path]
    swept = columns[1 : columns.index("status")]
    if SEED in swept:
        seeds_path = sweep_dir / "seeds.md"
        seeds_path.write_text(_markdown(*over_seeds(rows, swept)))
        written.append(seeds_path)
    finished = [row for row in rows if row["status"] == "done"]
    labels = [", ".join(f"{k}={row[k]}" for k in swept) or row["job"] for row in finished]
    try:
        from recipes.plots import plot_runs

        folders = [sweep_dir / row["job"] for row in finished]
        written.append(plot_runs(folders, sweep_dir / "curves.png", labels))
    except (ImportError, ValueError) as err:
        log.warning("no sweep curves.png: %s", err)
    return written
