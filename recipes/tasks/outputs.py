"""What tasks write into the run folder: ``mode=predict``'s ``predictions.jsonl`` (each row
named by its id), and JSON / JSON-lines files written atomically (a reader never sees half a
file). Apart from :mod:`recipes.tasks.base`, whose contract these serve, so a task's imports say
which it uses."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset

from recipes.tasks.base import Report, RunContext

# A predict file's columns that name its rows (GLUE's test files have idx), kept in the output.
ID_COLUMNS = ("id", "idx", "index")


def row_ids(examples: Dataset, columns: Sequence[str] = ID_COLUMNS) -> list[Any]:
    """Each row's id, from the first of ``columns`` the rows have; a row without one (JSON lines
    may mix rows), or rows without such a column, are named by their number."""
    column = next((c for c in columns if c in examples.column_names), None)
    if column is None:
        return list(range(len(examples)))
    return [n if v is None else v for n, v in enumerate(examples[column])]


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=_to_builtin))
    tmp.replace(path)


def _to_builtin(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


PREDICTIONS = "predictions.jsonl"


def write_predictions(
    run: RunContext, rows: int, records: Iterable[Mapping[str, Any]] | None
) -> Report:
    """mode=predict's file: ``records`` (one per row, in file order; None on the processes that
    do not write) as ``predictions.jsonl`` in the run folder, and the report of ``rows`` rows."""
    if records is not None:
        write_jsonl(run.output_dir / PREDICTIONS, records)
    return {"rows": rows, "file": PREDICTIONS}


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Write one JSON object per line, atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False, default=_to_builtin) + "\n")
    tmp.replace(path)
