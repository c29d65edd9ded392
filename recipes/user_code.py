"""The user's own code that the config names by import path (``task.tools``, ``task.rewards``):
importing it, and saying where it failed.

A module that is missing is refused as before (``cannot import``); one that does not compile, or
raises while it imports (a ``KeyError`` on a missing environment variable, an import of its own
that fails, even ``sys.exit``), is refused in one line naming the file, the line and the
exception, while the task is built: before the run folder holds anything (``train.py`` exits 2).
"""

from __future__ import annotations

import importlib
import signal
import sysconfig
import traceback
from pathlib import Path
from types import ModuleType

from recipes.errors import ConfigError, first_line

# Where Python's own and installed packages live: a frame there is a library's, not the user's.
_LIBRARY_DIRS = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def split(path: str) -> tuple[str, str]:
    """``pkg.module:function`` or ``pkg.module.function`` as (module, name); either may be
    empty when ``path`` is neither."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    return module_name, attr


def import_module(module_name: str, key: str, path: str) -> ModuleType:
    """``module_name``, imported for the setting ``key`` (which named ``path``); a
    :class:`ConfigError` in one line when it is missing or fails while it imports."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name + ".").startswith(err.name + "."):  # it, or its package
            raise ConfigError(f"{key}: cannot import {path!r} ({err}).") from None
        failed: BaseException = err  # an import of its own failed: said where, below
    except KeyboardInterrupt:
        raise  # Ctrl-C while importing: the user's stop, not the module's failure
    except BaseException as err:  # SyntaxError, whatever its top level raises, SystemExit
        failed = err
    raise ConfigError(
        f"{key}: importing {path!r} failed at {where(failed)}: {type(failed).__name__}: "
        f"{_said(failed)[:200]}; fix the module (python -c 'import {module_name}' shows "
        "the whole traceback)."
    ) from None


def where(err: BaseException) -> str:
    """``my_rewards.py:12``: the line of the user's code that raised ``err`` (where it did not
    compile, for a ``SyntaxError``): the innermost frame outside Python's library and installed
    packages, else the innermost frame."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<")]
    if not frames:
        return "an unknown line"
    own = [f for f in frames if not _in_library(f.filename) and f.filename != __file__]
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


def _said(err: BaseException) -> str:
    """The error's message (a ``SyntaxError``'s without its file and line, said already)."""
    return str(err.msg) if isinstance(err, SyntaxError) and err.msg else first_line(err)


def _in_library(filename: str) -> bool:
    return str(Path(filename).resolve()).startswith(_LIBRARY_DIRS)


def from_signal(err: BaseException) -> bool:
    """Whether ``err`` (a ``KeyboardInterrupt``) came from the process's SIGINT handler (a
    Python one raises it in its own frame: :class:`recipes.faults.StopRequest`'s second
    Ctrl-C), not from the user's code raising it."""
    handler = signal.getsignal(signal.SIGINT)
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return code is not None and tb is not None and tb.tb_frame.f_code is code
