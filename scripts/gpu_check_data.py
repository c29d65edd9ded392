"""What ``scripts/gpu_check.py`` and ``scripts/gpu_check_wheels.py`` share about the data a
device check trains on: the folder the wheels script stages it into (inside ``--wheels``, where
gpu_check.py looks for it) and the SQuAD slices both cut. Standard library only (the device
machine has no hydra or datasets)."""

from __future__ import annotations

import json
from pathlib import Path

DATA_FOLDER = "gpu_check_data"  # inside the --wheels folder: what gpu_check_wheels.py --data stages


def squad_slice(source: Path, target: Path, questions: int) -> int:
    """The first articles of a SQuAD file holding ``questions`` questions (whole paragraphs)."""
    data = json.loads(source.read_text(encoding="utf-8"))
    kept, count = [], 0
    for article in data["data"]:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            if count >= questions:
                break
            paragraphs.append(paragraph)
            count += len(paragraph["qas"])
        if paragraphs:
            kept.append({**article, "paragraphs": paragraphs})
        if count >= questions:
            break
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**data, "data": kept}), encoding="utf-8")
    return count
