#!/usr/bin/env python
"""Write the bundled sequence-to-sequence data slices from their upstream files.

* ``scitldr/{train,dev}.jsonl``: SciTLDR-A (allenai/scitldr, Apache-2.0), paper abstracts and
  their one-sentence summaries (TLDRs). Each row is ``{"source": abstract, "target": first TLDR,
  "targets": [every TLDR]}``; the abstract's sentences are joined by single spaces. Train keeps
  its first ``SCITLDR_TRAIN_ROWS`` rows (one TLDR each); dev is whole (619 rows, the author's
  TLDR first, then those written from peer reviews).

The upstream files are read from a folder given on the command line, holding them as the
upstream repository names them; their SHA-1 blob ids are checked so the slices are reproducible.
Fetch them with git (see ``recipes/assets/<name>/README.md`` for the repository and commit)::

    python scripts/make_seq2seq_data.py --scitldr <checkout>/SciTLDR-Data/SciTLDR-A
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SCITLDR_TRAIN_ROWS = 300
# git blob ids at allenai/scitldr@5ccad9c00a60ad75c9e04abf7f27d0f53f983b20.
SCITLDR_BLOBS = {
    "train.jsonl": "9700e723611c1ad3bbd0eed236cf3a660688423c",
    "dev.jsonl": "dd59586c811a195253149d5640e7b615201281fc",
}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_checked(path: Path, blob: str) -> bytes:
    data = path.read_bytes()
    if git_blob_id(data) != blob:
        raise SystemExit(f"error: {path} is not the upstream file (git blob {blob})")
    return data


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def scitldr_rows(data: bytes) -> list[dict]:
    rows = []
    for line in data.decode("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        source = " ".join(s.strip() for s in row["source"] if s.strip())
        targets = [t.strip() for t in row["target"] if t.strip()]
        rows.append({"source": source, "target": targets[0], "targets": targets})
    return rows


def make_scitldr(src: Path, out: Path) -> None:
    train = scitldr_rows(read_checked(src / "train.jsonl", SCITLDR_BLOBS["train.jsonl"]))
    dev = scitldr_rows(read_checked(src / "dev.jsonl", SCITLDR_BLOBS["dev.jsonl"]))
    write_jsonl(out / "scitldr" / "train.jsonl", train[:SCITLDR_TRAIN_ROWS])
    write_jsonl(out / "scitldr" / "dev.jsonl", dev)
    print(f"scitldr: {min(len(train), SCITLDR_TRAIN_ROWS)} train rows, {len(dev)} dev rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scitldr", type=Path, help="folder with SciTLDR-A's train/dev.jsonl")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "recipes" / "assets")
    args = parser.parse_args(argv)
    if args.scitldr:
        make_scitldr(args.scitldr, args.out)
    for path in sorted(args.out.glob("scitldr/*.jsonl")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"  {digest}  {path.stat().st_size:>9,}  {path.relative_to(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
