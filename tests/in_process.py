"""``python train.py <args>`` run in the test's own process, as the command line runs it.

train.py itself runs (``runpy``, as ``__main__``): Hydra's entry point composes the config,
makes the run folder and runs ``-m`` sweeps job by job with their summary, and train.py turns
refusals into one ``error: ...`` line and exit code 2, training failures into 1, exactly as in a
fresh process; nothing of it is repeated here. What is saved is Python's start-up (torch,
transformers and the project's imports: about 6.5 s of a 3-step smoke run's 8.3 s on 2 cores).

A fresh process also starts with fresh process-wide state, so the run gets it here and the test
gets its own back afterwards: the working folder, ``os.environ`` (train.py sets
``HYDRA_FULL_ERROR``), ``sys.argv``, the terminal (file descriptors 1 and 2 and ``sys.stdout`` /
``sys.stderr`` go to files read back as the result's ``stdout`` / ``stderr``, also what
libraries' log handlers print), warnings (Python's default filters, shown once per run, not
recorded by pytest), the logging tree (the run's handlers, its ``train.log`` among them, are
closed; "once" warnings are said again), accelerate's singletons, Hydra's job config, signal
handlers, the random generators and torch's global switches (default dtype, threads, grad mode,
deterministic algorithms, float32 matmul precision).

What still needs a process of its own (``tests/conftest.py`` decides): kills and signals, several
processes (torchrun, accelerate launch), the emulated MUSA card and any other wrapper script, and
environment variables read when the interpreter or torch starts (``PYTHON*``, ``OMP_*``), but
``PYTHONPATH``: its folders go first on ``sys.path`` for the run (as the interpreter puts them
before the installed packages), and the modules imported from them (a test's reward or tool
module) are forgotten afterwards, so that the next run imports its own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "train.py"

# Environment variables that take effect only when the interpreter, OpenMP or a device runtime
# starts: a run given one of these needs a process of its own.
AT_START = ("PYTHON", "OMP_", "MKL_", "CUDA_", "MUSA_", "LD_", "TORCH", "KMP_")

# Python's own warning filters (``python -W`` unset), which pytest replaces for its tests.
_PYTHON_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)


def needs_own_process(env: dict | None) -> bool:
    """Whether ``env`` (added to the environment) must be set before the interpreter starts."""
    return any(key.startswith(AT_START) and key != "PYTHONPATH" for key in env or {})


def run_train_here(
    args: list[str], *, cwd: Path, env: dict | None = None
) -> subprocess.CompletedProcess:
    """train.py with ``args`` in this process: its exit code, stdout and stderr, as
    ``subprocess.run(..., capture_output=True, text=True)`` returns them."""
    return run_here([str(TRAIN), *args], cwd=cwd, env=env)


def run_here(
    argv: list[str], *, cwd: Path, env: dict | None = None, input: str = ""
) -> subprocess.CompletedProcess:
    """``python <argv>`` (a script, or ``-m module``) in this process, ``input`` its standard
    input (not a terminal, as a pipe is); as :func:`run_train_here`."""
    # Imported (their loggers made, printing to the test's terminal) before the state is saved;
    # here, not at the top: conftest imports this module, and not every test needs them.
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="train-in-process-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        saved_stdin = sys.stdin
        with _fresh_process(cwd, env, out, err):
            sys.stdin = io.StringIO(input)
            try:
                returncode = _main(argv)
            finally:
                sys.stdin = saved_stdin
        return subprocess.CompletedProcess(
            [sys.executable, *argv],
            returncode,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )


def _main(argv: list[str]) -> int:
    """Run ``argv`` as ``python <argv>`` does; its exit status."""
    sys.argv = argv[1:] if argv[0] == "-m" else argv
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        return _exit_status(stop.code)
    except KeyboardInterrupt:
        raise
    except BaseException:  # what an uncaught exception does: its traceback, exit status 1
        traceback.print_exc(file=sys.stderr)
        return 1
    return 0


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # sys.exit("message")
    return 1


@contextlib.contextmanager
def _fresh_process(cwd: Path, env: dict | None, out: Path, err: Path) -> Iterator[None]:
    """A fresh process's state for the run (see the module's docstring), its terminal into
    ``out`` and ``err``; the caller's state afterwards."""
    import numpy as np
    import torch

    saved_cwd, saved_env, saved_argv, saved_path = (
        os.getcwd(),
        dict(os.environ),
        sys.argv,
        sys.path[:],
    )
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    saved_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    saved_torch = _torch_switches()
    saved_logging, saved_bars = _logging_state(), _progress_bars()
    from recipes import data as data_lib  # trainer.progress_bar is process-wide (show_progress)

    saved_progress = data_lib.progress_enabled()
    _forget_run_state()
    terminal: list = []
    known = {str(Path(p or ".").resolve()) for p in sys.path}
    user_paths = [
        p
        for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep)
        if p and str(Path(p).resolve()) not in known  # the project's own stays imported
    ]
    shadowed: dict = {}
    try:
        os.chdir(cwd)
        os.environ.update(env or {})
        sys.path[1:1] = user_paths  # after the script's folder, before site-packages
        shadowed.update(_set_aside_modules_named_in(user_paths))  # a fresh process has none
        with warnings.catch_warnings(), _terminal(out, err, terminal):
            warnings.resetwarnings()
            for action, category, module in reversed(_PYTHON_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = _show_warning  # pytest records them; a process prints them
            yield
    finally:
        _forget_run_state()
        _restore_logging(saved_logging, {id(file) for file in terminal})
        _restore_progress_bars(saved_bars)
        data_lib.show_progress(saved_progress)
        _restore_torch_switches(saved_torch)
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        torch.set_rng_state(saved_rng[2])
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        sys.argv, sys.path[:] = saved_argv, saved_path
        _forget_modules_from(user_paths)
        sys.modules.update(shadowed)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def _set_aside_modules_named_in(folders: list[str]) -> dict:
    """Take out of ``sys.modules`` (and return) the modules named as a module or package in
    ``folders``: imported earlier from elsewhere, they would shadow the run's own."""
    names = {
        entry.stem if entry.suffix == ".py" else entry.name
        for folder in folders
        for entry in Path(folder).glob("*")
        if entry.suffix == ".py" or (entry / "__init__.py").is_file()
    }
    return {
        name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in names
    }


def _forget_modules_from(folders: list[str]) -> None:
    """Drop the modules imported from ``folders`` (a run's ``PYTHONPATH``) from ``sys.modules``,
    as the end of its process would."""
    roots = [str(Path(folder).resolve()) + os.sep for folder in folders if folder]
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if where and any(str(Path(where).resolve()).startswith(root) for root in roots):
            del sys.modules[name]


@contextlib.contextmanager
def _terminal(out: Path, err: Path, files: list) -> Iterator[None]:
    """File descriptors 1 and 2 and ``sys.stdout`` / ``sys.stderr`` into ``out`` and ``err``
    (C++ warnings and tqdm included; ``files`` gets the two files); log handlers that print to
    the terminal (transformers' and datasets' own) print there."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    files += [open(path, "a", buffering=1, encoding="utf-8") for path in (out, err)]  # noqa: SIM115
    handlers = _terminal_handlers()
    handlers_streams = [(handler, handler.stream) for handler, _ in handlers]
    try:
        for fd, file in zip((1, 2), files, strict=True):
            os.dup2(file.fileno(), fd)
        sys.stdout, sys.stderr = files
        for handler, to_stdout in handlers:
            handler.stream = files[0] if to_stdout else files[1]  # setStream flushes the old
        yield
    finally:
        # The test's terminal back first, whatever the run did to its files: a library may
        # have closed them (then a flush raises), and a test whose sys.stderr stayed a closed
        # file would break every later test of its worker.
        sys.stdout, sys.stderr = saved_streams
        for fd, saved in zip((1, 2), saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        for handler, stream in handlers_streams:
            handler.stream = stream
        for file in files:
            if not file.closed:
                file.close()  # flushes


def _terminal_handlers() -> list[tuple[logging.Handler, bool]]:
    """The log handlers that print to the terminal, each with whether it prints to stdout:
    every live handler (``logging._handlerList``, attached to a logger or not) whose stream is
    the terminal. A handler made before the run holds the test's streams, pytest's capture files
    under pytest, and one that closes its stream when closed (absl's, which rouge_score imports)
    would close pytest's file when the run's logging set-up (Hydra's dictConfig) closes every
    handler; in a process of its own that stream is the real terminal, which it never closes."""
    stdout = {id(sys.stdout), id(sys.__stdout__)}
    terminal = stdout | {id(sys.stderr), id(sys.__stderr__)}
    live = [ref() for ref in logging._handlerList]  # type: ignore[attr-defined]
    attached = [handler for logger in _loggers() for handler in logger.handlers]
    found, seen = [], set()
    for handler in [*live, *attached]:
        stream = getattr(handler, "stream", None)
        if handler is None or id(handler) in seen or id(stream) not in terminal:
            continue
        if isinstance(getattr(type(handler), "stream", None), property):
            continue  # reads sys.stderr when it writes (logging.lastResort): follows the swap
        seen.add(id(handler))
        found.append((handler, id(stream) in stdout))
    return found


def _loggers() -> list[logging.Logger]:
    tree = logging.root.manager.loggerDict.values()
    return [logging.root, *(x for x in tree if isinstance(x, logging.Logger))]


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _forget_run_state() -> None:
    """What a run leaves in singletons: accelerate's state (recipes.modes resets it between the
    jobs of a sweep the same way), Hydra's job config, the messages said only once per process,
    torch.compile's caches, and wandb's settings (read from the environment once per process)
    and service, which a process's exit ends."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "hydra.core.hydra_config" in sys.modules:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None
    for once in ("warning_once", "info_once"):
        cached = getattr(logging.Logger, once, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    if "accelerate.logging" in sys.modules:
        sys.modules["accelerate.logging"].MultiProcessAdapter.warning_once.cache_clear()
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _torch_switches() -> dict:
    import torch

    return {
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
    }


def _restore_torch_switches(saved: dict) -> None:
    import torch

    torch.set_default_dtype(saved["dtype"])
    if torch.get_num_threads() != saved["threads"]:
        torch.set_num_threads(saved["threads"])
    torch.set_grad_enabled(saved["grad"])
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
    torch.set_float32_matmul_precision(saved["matmul"])


def _logging_state() -> dict[str, tuple]:
    # Loggers that a run configures, made now so that they are restored, not left as the run
    # set them (recipes.log's "recipes": not propagating, its train.log attached).
    for name in ("recipes", "accelerate", "hydra", "matplotlib"):
        logging.getLogger(name)
    return {
        logger.name: (logger.level, logger.propagate, logger.disabled, logger.handlers[:])
        for logger in _loggers()
    }


def _progress_bars() -> tuple[bool, bool] | None:
    """Whether transformers' and datasets' progress bars are on (recipes.log turns them off)."""
    if "transformers" not in sys.modules or "datasets" not in sys.modules:
        return None
    import datasets
    import transformers

    return (
        transformers.utils.logging.is_progress_bar_enabled(),
        not datasets.utils.are_progress_bars_disabled(),
    )


def _restore_logging(saved: dict[str, tuple], terminal: set[int]) -> None:
    """The logging tree as it was; handlers the run added are closed, save those of loggers
    made by the libraries it imported that print elsewhere than the run's ``terminal``."""
    kept = {id(handler) for *_, handlers in saved.values() for handler in handlers}
    for logger in _loggers():
        for handler in logger.handlers[:]:
            if id(handler) in kept:
                continue
            if logger.name in saved or _writes_to(handler, terminal):
                handler.close()
                logger.removeHandler(handler)
        if logger.name in saved:
            logger.level, logger.propagate, logger.disabled, handlers = saved[logger.name]
            logger.handlers[:] = handlers
    logging.root.manager._clear_cache()


def _writes_to(handler: logging.Handler, streams: set[int]) -> bool:
    return isinstance(handler, logging.FileHandler) or id(getattr(handler, "stream", None)) in (
        streams
    )


def _restore_progress_bars(bars: tuple[bool, bool] | None) -> None:
    if bars is not None:
        import datasets
        import transformers

        transformers_on, datasets_on = bars
        if transformers_on:
            transformers.utils.logging.enable_progress_bar()
        if datasets_on:
            datasets.utils.enable_progress_bars()
