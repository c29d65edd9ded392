""".ci/run's own shell: its exit trap must keep the run's exit status.

The trap stops the environments built in the background when a pass fails. Under ``set -e`` a
failing command inside a trap ends the shell with that failure: a plain ``pkill`` that finds
nothing to stop (every normal end) turned a passing run into exit 1 once (CI, 2026-12-07).
The trap line is taken from the script itself and run around a background job, as there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CI_RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"


def _trap_line() -> str:
    lines = [line for line in CI_RUN.read_text().splitlines() if re.match(r"\s*trap\s", line)]
    assert len(lines) == 1, f".ci/run has {len(lines)} trap lines; this test reads one"
    return lines[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize(("last", "status"), [("true", 0), ("false", 1), ("exit 2", 2)])
def test_the_exit_trap_keeps_the_runs_status_and_stops_the_background_job(last, status, tmp_path):
    marker = tmp_path / "still-running"
    script = "\n".join(
        [
            "set -euo pipefail",
            # Its output away from the test's pipes: a `sleep` forked after the trap's pkill
            # would keep them open (the test waits for the shell, not for it).
            f"(sleep 30; touch {marker}) >/dev/null 2>&1 &",
            "later_pid=$!",
            _trap_line(),
            last,
        ]
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=20)
    assert done.returncode == status, done.stderr
    # the background job was stopped with its children: nothing is left to write the marker
    left = subprocess.run(["pgrep", "-f", f"touch {marker}"], capture_output=True, text=True)
    assert left.stdout.strip() == ""
