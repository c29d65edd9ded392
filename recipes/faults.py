"""What stops a run early: a preemption signal, a non-finite loss, and how each is reported.

* SIGTERM (a scheduler's preemption, ``torchrun`` shutting down) or SIGINT (Ctrl-C) is noted by
  :class:`StopRequest`; the loop finishes the step in flight, saves a checkpoint and raises
  :class:`Interrupted`, which ``train.py`` turns into a message saying how to resume. A second
  Ctrl-C stops at once. During an evaluation or the task's last words (minutes of generation or
  answer search, longer than a launcher's grace period) the request stops them at once
  (:meth:`StopRequest.at_once`): the checkpoint is saved at the last trained step instead.
* A non-finite loss or gradient raises :class:`TrainingError` (``trainer.on_nonfinite=stop``)
  before the optimizer touches the weights, or drops that update (``skip``).
* A full disk met by a write of the main process alone (``metrics.jsonl``, ``results.json``,
  ``checkpoints/best.json``, a task's predictions, ...) becomes one :class:`TrainingError` line
  (:func:`disk_full_stop`): what is saved and how to go on. Those writes leave no half-written
  file that matters (temporary files and renames; a torn last line of ``metrics.jsonl`` is
  dropped on resume); checkpoints and ``final/`` have their own checks
  (:func:`recipes.checkpoint.write_together`), since every process writes them.
* A rank that dies makes the others fail in their next collective (gloo notices the closed
  connection; NCCL / MCCL wait ``trainer.distributed_timeout_s``), and the launcher
  (``accelerate launch``, ``torchrun``) ends the survivors. Each survivor says so at once
  (:func:`peer_failures_reported`), while its SIGTERM handler is still the loop's: the launcher's
  SIGTERM can arrive at any moment after the death, and once the default handler is back it
  ends the process before a later message is written.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

# Defined in recipes.errors, which the checkpoints share without importing this module.
from recipes.errors import TrainingError as TrainingError
from recipes.log import get_logger

log = get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """A signal stopped the run after a checkpoint was saved."""

    def __init__(self, signum: int, step: int, checkpoint: str, main_process: bool) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.main_process = main_process
        super().__init__(f"{signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by that signal


class StopNow(BaseException):
    """A stop request that ends an evaluation in its middle (raised by the signal handler within
    :meth:`StopRequest.at_once`, or between evaluation batches when several processes agree). A
    BaseException, as KeyboardInterrupt is, so that no task's ``except Exception`` swallows it."""


class PeerFailed(Exception):
    """Another process of the run died or stopped answering; this one already said so."""


def peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another process of the run died or hung
    (gloo: a closed connection; NCCL / MCCL: the timeout)."""
    import torch.distributed as dist

    backend_error = getattr(dist, "DistBackendError", None)  # torch >= 2.1
    if backend_error is not None and isinstance(err, backend_error):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        marker in text
        for marker in ("Connection reset by peer", "Connection closed by peer", "Timed out")
    )


@contextmanager
def peer_failures_reported(output_dir: str) -> Iterator[None]:
    """Turn a collective that fails because of another rank into :class:`PeerFailed`, written to
    stderr here and now, with how to continue from the last checkpoint of ``output_dir``."""
    try:
        yield
    except RuntimeError as err:
        if not peer_failure(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        sys.stderr.write(
            f"error: another process of this run failed or stopped answering ({first[:300]}). "
            "Look for the first error in the other ranks' output; once fixed, continue from the "
            f"last checkpoint with the same command plus output_dir={output_dir} resume=auto.\n"
        )
        sys.stderr.flush()
        raise PeerFailed(first) from err


def disk_full_stop(err: OSError, output_dir: str | Path, mode: str) -> TrainingError | None:
    """The one-line :class:`TrainingError` for a write that found the disk full (None for any
    other error): the file, what the run folder holds, and how to go on. The other processes
    of a multi-process run learn it as a peer failure (:func:`peer_failures_reported`) at
    their next collective, and the launcher ends them."""
    from recipes import checkpoint

    if not checkpoint.disk_full(err):
        return None
    run = Path(output_dir)
    name = Path(str(err.filename)) if err.filename else None
    if name is not None and name.suffix == ".tmp":  # written whole, then renamed
        name = name.with_suffix("")
    what = f"{name.name} in {name.parent}" if name is not None else f"a file in {run}"
    kept = checkpoint.finished_checkpoints(checkpoint.checkpoints_dir(run))
    if mode != "train":
        saved, then = "nothing else was written", f"run the same command again (mode={mode})"
    elif checkpoint.final_complete(run):
        saved = f"the trained model is whole in {run / checkpoint.FINAL}"
        then = (
            "score it with the same command plus mode=eval "
            f"model.name_or_path={run / checkpoint.FINAL} output_dir=<a new folder>"
        )
    elif kept:
        saved = f"every checkpoint is kept (latest: {kept[-1].name})"
        then = f"continue with the same command plus output_dir={run} resume=auto"
    else:
        saved, then = "no checkpoint was saved yet", "run the same command again"
    return TrainingError(
        f"no space left on device: could not write {what}; {saved}. Free space (or move "
        f"output_dir), then {then}."
    )


class StopRequest:
    """Notes SIGTERM / SIGINT instead of dying, so the loop can checkpoint first."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._at_once = False

    @contextmanager
    def at_once(self, enabled: bool = True) -> Iterator[None]:
        """Within this block a stop request raises :class:`StopNow` where the code is (one
        process: nothing to agree with), and one that came before raises on entry."""
        if enabled and self.signum is not None:
            raise StopNow()
        before, self._at_once = self._at_once, enabled
        try:
            yield
        finally:
            self._at_once = before

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; nothing to catch here
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def installed(self) -> bool:
        """Whether signals are caught (training; not mode=eval / predict, nor off the main
        thread)."""
        return bool(self._previous)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        if self.signum is None:
            log.warning(
                "%s received: %s, then stopping (Ctrl-C again stops at once, without one)",
                signal.Signals(signum).name,
                "stopping what runs now (an evaluation, the last words) and saving a checkpoint"
                if self._at_once
                else "saving a checkpoint after this step",
            )
        self.signum = signum
        if self._at_once:
            self._at_once = False  # raised once: the checkpoint that follows is not interrupted
            raise StopNow()
