"""One rank-zero logger for the whole package.

Messages go to the terminal and to ``<output_dir>/train.log`` on the main process only; other
ranks log warnings and errors so that a failure on any rank is still seen.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

from tqdm.auto import tqdm

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


class _TqdmHandler(logging.StreamHandler):
    """Writes through tqdm so that log lines do not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _RunLogFile(logging.FileHandler):
    """``train.log``: a write that fails (a full disk) stops the file, said once on the terminal,
    where the log goes on; logging's default is a traceback for every line from then on."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
            return
        self.failed = True
        with contextlib.suppress(OSError):
            self.close()  # what is buffered cannot be written either
        sys.stderr.write(
            f"warning: {self.baseFilename}: {err.strerror or err}; the log goes on on the "
            "terminal only\n"
        )


def get_logger(name: str) -> logging.Logger:
    """The package logger for a module (``recipes.<module>``)."""
    return logging.getLogger(name)


def setup_logging(is_main_process: bool, log_file: Path | None = None) -> None:
    """Route ``recipes.*`` logs to the terminal (and a file), quiet libraries on other ranks, and
    keep library progress bars and expected load reports out of every run's output."""
    import datasets  # here, not at the top: train.py's refusals stay free of them
    import transformers

    root = logging.getLogger("recipes")
    root.handlers.clear()
    root.propagate = False
    root.setLevel(logging.INFO if is_main_process else logging.WARNING)
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    root.addHandler(console)
    if log_file is not None and is_main_process:
        file_handler = _RunLogFile(log_file)
        file_handler.setFormatter(logging.Formatter(FORMAT, "%Y-%m-%d %H:%M:%S"))
        root.addHandler(file_handler)
    # accelerate reports every file of a checkpoint at INFO; the loop logs one line per checkpoint.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    # ... and warns at every save that tied weights (GPT-2's lm_head) are stored once, as they
    # should be; resuming ties them again (tested).
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    if is_main_process:
        transformers.utils.logging.set_verbosity_warning()
        datasets.utils.logging.set_verbosity_warning()
    else:
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
    # Feature building, dataset saving and weight loading each draw a bar before training starts;
    # the log lines already say what is cached and loaded, and the training bar is the run's own.
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    # peft (0.21) asks transformers 5 about checkpointing by a name transformers deprecated: not
    # ours to fix, and it repeats on every LoRA run.
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )
    # matplotlib says at INFO that it built its font cache (a fresh machine's first curves.png).
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def note_in_log_file(message: str, output_dir: Path) -> None:
    """Write ``message`` (an error the terminal already shows as ``error: ...``) to the
    ``train.log`` of ``output_dir`` only (when this process writes one), so that the file says
    how the run ended."""
    for handler in logging.getLogger("recipes").handlers:
        if (
            isinstance(handler, logging.FileHandler)
            and Path(handler.baseFilename).parent == Path(output_dir).resolve()
        ):
            record = logging.LogRecord("recipes", logging.ERROR, "", 0, message, None, None)
            handler.handle(record)


def quiet_libraries() -> None:
    """No progress bars or notices from datasets and transformers: for the command-line tools
    (``recipes.answer``, ``recipes.chat``), whose output is their answers."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
