"""The run folder's bookkeeping, in process: its lock, a whole final/, and what interrupted
writes leave (tests/test_nothing_lost.py kills and signals real runs)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from recipes import checkpoint, runs
from recipes.config import ConfigError


def _hold_in_another_process(folder: Path) -> subprocess.CompletedProcess:
    """runs.hold in a forked child (another process, as a second run is: fcntl's locks are per
    process; forked, it needs no interpreter start-up): its exit status and refusal."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold, say why not, and leave without Python's clean-up
        os.close(read)
        try:
            runs.hold(folder)
            status = 0
        except ConfigError as refused:
            os.write(write, str(refused).encode())
            status = 2
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as said:
        message = said.read()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return subprocess.CompletedProcess(["fork", "runs.hold"], status, "", message)


def test_a_held_folder_is_refused_to_another_process_and_free_once_released(tmp_path):
    runs.hold(tmp_path)
    try:
        other = _hold_in_another_process(tmp_path)
        assert other.returncode != 0
        assert "is in use by another run (pid" in other.stderr
        assert json.loads((tmp_path / runs.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        runs.release(tmp_path)
    assert not (tmp_path / runs.LOCK_FILE).exists()  # removed on release
    again = _hold_in_another_process(tmp_path)
    assert again.returncode == 0, again.stderr


def _checkpoint(folder, step: int, *, complete: bool = True):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"0" * 10)
    if complete:
        state = checkpoint.TrainerState(step=step)
        (folder / checkpoint.STATE_FILE).write_text(json.dumps(state.__dict__))


def test_interrupted_writes_are_tidied_and_a_complete_one_gets_its_name(tmp_path):
    folder = checkpoint.checkpoints_dir(tmp_path)
    _checkpoint(folder / "step-00000002", 2)
    # Killed between renaming the old step-4 away and giving the new one its name.
    _checkpoint(folder / ".del-step-00000004", 4)
    _checkpoint(folder / ".tmp-step-00000004", 4)
    _checkpoint(folder / ".tmp-step-00000006", 6, complete=False)  # killed while writing
    _checkpoint(tmp_path / ".tmp-final", 0, complete=False)
    done = checkpoint.remove_leftovers(tmp_path)
    assert "restored step-00000004 (complete, stopped before its rename)" in done
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step-00000002", "step-00000004"]
    assert not (tmp_path / ".tmp-final").exists()
    assert checkpoint.resolve("auto", tmp_path).name == "step-00000004"


def test_final_counts_only_when_whole(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert not checkpoint.final_complete(tmp_path)
    # Without checkpoints to continue from, it is some finished run's: never touched.
    with pytest.raises(ConfigError, match="already holds a finished run"):
        runs.check_run_folder(tmp_path, "auto")
    # Beside them, an earlier release's save that was interrupted.
    _checkpoint(checkpoint.checkpoints_dir(tmp_path) / "step-00000002", 2)
    with pytest.raises(ConfigError, match="final/ is incomplete"):
        runs.check_run_folder(tmp_path, None)
    (tmp_path / "final" / "model.safetensors").write_bytes(b"0")
    assert checkpoint.final_complete(tmp_path)
    with pytest.raises(ConfigError, match="already holds a finished run"):
        runs.check_run_folder(tmp_path, "auto")
