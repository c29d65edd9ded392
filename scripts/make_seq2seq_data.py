#!/usr/bin/env python
"""Write the bundled sequence-to-sequence data slices from their upstream files.

* ``scitldr/{train,dev}.jsonl``: SciTLDR-A (allenai/scitldr, Apache-2.0), paper abstracts and
  their one-sentence summaries (TLDRs). Each row is ``{"source": abstract, "target": first TLDR,
  "targets": [every TLDR]}``; the abstract's sentences are joined by single spaces. Train keeps
  its first ``SCITLDR_TRAIN_ROWS`` rows (one TLDR each); dev is whole (619 rows, the author's
  TLDR first, then those written from peer reviews).
* ``tatoeba-en-de/{train,dev}.jsonl``: English-German sentence pairs from Tatoeba (CC BY 2.0 FR,
  tatoeba.org), as manythings.org/anki's ``deu.txt`` holds them: its first 50,000 pairs (English
  up to 24 characters), in a copy at DarrenCarvalho/Language-Translation. Each row is
  ``{"translation": {"en": ..., "de": ...}}`` (run_translation's layout). Pairs are grouped by
  their English sentence and the groups shuffled with seed 0, so that every translation of one
  English sentence lands in the same split: ``TATOEBA_DEV_ROWS`` dev rows, then
  ``TATOEBA_TRAIN_ROWS`` train rows.

The upstream files are read from a folder given on the command line, holding them as the
upstream repository names them; their SHA-1 blob ids are checked so the slices are reproducible.
Fetch them with git (see ``recipes/assets/<name>/README.md`` for the repository and commit)::

    python scripts/make_seq2seq_data.py --scitldr <checkout>/SciTLDR-Data/SciTLDR-A \
        --tatoeba <checkout>/data/deu.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SCITLDR_TRAIN_ROWS = 300
# git blob ids at allenai/scitldr@5ccad9c00a60ad75c9e04abf7f27d0f53f983b20.
SCITLDR_BLOBS = {
    "train.jsonl": "9700e723611c1ad3bbd0eed236cf3a660688423c",
    "dev.jsonl": "dd59586c811a195253149d5640e7b615201281fc",
}

TATOEBA_DEV_ROWS = 500
TATOEBA_TRAIN_ROWS = 5000
TATOEBA_SEED = 0
# git blob id of data/deu.txt at DarrenCarvalho/Language-Translation@a30fc3ec31687d0ed561047a9c7d7fdb5915f89c.
TATOEBA_BLOB = "bc1a73ee2aaefc1e5622a6e803d5799e478ad49f"


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


def tatoeba_pairs(data: bytes) -> list[tuple[str, str]]:
    """(English, German) pairs of a manythings.org ``deu.txt`` (CRLF or LF, tab-separated; a
    third attribution column, when present, is dropped); lines without a letter on both sides
    (the copy's first line is "1<TAB>2") are skipped."""
    pairs = []
    for line in data.decode("utf-8").splitlines():
        fields = [f.strip() for f in line.split("\t")]
        if len(fields) >= 2 and all(re.search(r"[^\W\d_]", f) for f in fields[:2]):
            pairs.append((fields[0], fields[1]))
    return pairs


def make_tatoeba(src: Path, out: Path) -> None:
    groups: dict[str, list[str]] = {}
    for en, de in tatoeba_pairs(read_checked(src, TATOEBA_BLOB)):
        if de not in groups.setdefault(en, []):
            groups[en].append(de)
    order = list(groups)
    random.Random(TATOEBA_SEED).shuffle(order)
    rows = [{"translation": {"en": en, "de": de}} for en in order for de in groups[en]]
    # Split at a group boundary so that no English sentence is in both splits.
    cut = TATOEBA_DEV_ROWS
    while cut < len(rows) and rows[cut]["translation"]["en"] == rows[cut - 1]["translation"]["en"]:
        cut += 1
    write_jsonl(out / "tatoeba-en-de" / "dev.jsonl", rows[:cut])
    write_jsonl(out / "tatoeba-en-de" / "train.jsonl", rows[cut : cut + TATOEBA_TRAIN_ROWS])
    print(f"tatoeba-en-de: {cut} dev rows, {min(TATOEBA_TRAIN_ROWS, len(rows) - cut)} train rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scitldr", type=Path, help="folder with SciTLDR-A's train/dev.jsonl")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "recipes" / "assets")
    parser.add_argument("--tatoeba", type=Path, help="manythings.org's deu.txt (see above)")
    args = parser.parse_args(argv)
    if args.scitldr:
        make_scitldr(args.scitldr, args.out)
    if args.tatoeba:
        make_tatoeba(args.tatoeba, args.out)
    for path in sorted(
        p for d in ("scitldr", "tatoeba-en-de") for p in args.out.glob(f"{d}/*.jsonl")
    ):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"  {digest}  {path.stat().st_size:>9,}  {path.relative_to(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
