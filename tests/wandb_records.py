"""Read the records of an offline wandb run (``run-<id>.wandb``) without the network.

The file is a LevelDB-style log (wandb's transaction log): a 7-byte header (``:W&B``, magic,
version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: full,
first, middle, last) and a piece of a serialized ``wandb_internal_pb2.Record``. wandb no longer
ships a Python reader (its service is written in Go), so the tests carry this small one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = struct.Struct("<IHB")  # crc32, length, chunk type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every record of the run file, in order, as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, pending, offset = [], b"", 7
    while offset + _HEADER.size <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < _HEADER.size:  # the rest of a block too small for a header is padding
            offset += room
            continue
        _, length, kind = _HEADER.unpack_from(data, offset)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            offset += room
            continue
        chunk = data[offset + _HEADER.size : offset + _HEADER.size + length]
        offset += _HEADER.size + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """The logged rows: ``{"_step": ..., key: value, ...}`` per ``accelerator.log`` call."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = _values(record.history.item)
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            rows.append(row)
    return rows


def _values(items) -> dict:
    """Key/value items of a record (history, config or summary) as a dict of decoded values."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def config(path: Path) -> dict:
    """The run's config as logged (top-level keys -> values, nested dicts as dicts)."""
    found: dict = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "config":
            found.update(_values(record.config.update))
        if record.WhichOneof("record_type") == "run":
            found.update(_values(record.run.config.update))
    return found


def run_record(path: Path):
    """The ``run`` record: id, name, group, tags, project."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def summary(path: Path) -> dict:
    """The last summary values written to the run file."""
    found: dict = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            found.update(_values(record.summary.update))
    return found
