"""Plot loss, learning rate and evaluation metrics of one or more runs (overlaid) to a PNG.

python scripts/plot_run.py RUN_DIR                  # -> RUN_DIR/curves.png
python scripts/plot_run.py RUN_A RUN_B RUN_C        # -> RUN_A/compare.png, runs overlaid
python scripts/plot_run.py multirun/2026-11-30_12-00-00/*  --out sweep.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes.plots import plot_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="the PNG to write")
    parser.add_argument("--labels", default=None, help="comma-separated legend labels")
    args = parser.parse_args(argv)
    runs = [p for p in args.runs if (p / "metrics.jsonl").exists()]
    skipped = [p for p in args.runs if p not in runs]
    for path in skipped:
        print(f"skipped {path}: no metrics.jsonl", file=sys.stderr)
    if not runs:
        parser.error("none of the folders is a run folder (no metrics.jsonl)")
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(runs):
        parser.error(f"--labels has {len(labels)} names for {len(runs)} runs")
    out = args.out or runs[0] / ("curves.png" if len(runs) == 1 else "compare.png")
    print(plot_runs(runs, out, labels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
