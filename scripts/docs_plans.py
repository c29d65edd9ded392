"""Re-run the memory plans docs/large-models.md quotes and write their output back in place.

    python scripts/docs_plans.py            # rewrite the blocks and the table's plan figures
    python scripts/docs_plans.py --check    # exit 1 (naming them) where the docs are stale

Each ``<!-- plan:NAME -->`` block is the command's line and, below it, what it printed; in the
table after ``<!-- plan:table -->`` a row whose source is ``plan: `python -m recipes.plan ...```
gets that command's peak and verdict. Measured rows are left alone (scripts/plan_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "large-models.md"
COMMAND = re.compile(r"^    (python -m recipes\.plan .*)$")


def run(command: str) -> str:
    """What ``python -m recipes.plan ...`` prints, run in this process (it imports no torch)."""
    from recipes import plan

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan.main(shlex.split(command)[3:])
    if code:
        raise SystemExit(f"{command}: exit {code}\n{err.getvalue()[-2000:]}")
    return out.getvalue().rstrip("\n")


def blocks(lines: list[str]) -> list[str]:
    """The document with every plan block's output replaced by its command's."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not line.startswith("<!-- plan:") or line.strip() == "<!-- plan:table -->":
            continue
        while i < len(lines) and not COMMAND.match(lines[i]):  # the blank line, the command
            out.append(lines[i])
            i += 1
        command = COMMAND.match(lines[i]).group(1)
        out += [lines[i], ""]
        i += 1
        while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
            i += 1  # the old output and the blank lines around it
        out += ["    " + x if x else "" for x in run(command).splitlines()]
        out.append("")
    return out


def table(lines: list[str]) -> list[str]:
    row = re.compile(r"^(\|.*\| )([\d.]+ GiB \((?:fits|does not fit)\))( \| plan: `(.*)` \|)$")
    out = []
    for line in lines:
        found = row.match(line)
        if found:
            text = run(found.group(4))
            peak = re.findall(r"^peak: ([\d.]+ GiB)", text, flags=re.MULTILINE)[-1]
            verdict = "does not fit" if "does not fit on" in text else "fits"
            line = f"{found.group(1)}{peak} ({verdict}){found.group(3)}"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether they are stale")
    args = parser.parse_args(argv)
    old = DOC.read_text().splitlines()
    new = table(blocks(old))
    if args.check:
        stale = [b for a, b in zip(old, new, strict=False) if a != b]
        for line in stale[:20]:
            print(f"stale: {line}")
        return 1 if stale or len(old) != len(new) else 0
    DOC.write_text("\n".join(new) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
