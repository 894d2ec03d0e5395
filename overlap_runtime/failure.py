"""One line per failure: what the command line prints when a command fails, and its exit code.

Every error that reaches the top of ``overlap-runtime`` (raised in this process or in a rank it
spawned) prints exactly one line on stderr, naming what failed and where, followed by the path of
a log file that holds everything else (the traceback of this process, each failed rank's
traceback, the stacks of ranks that ran past their timeout)::

    error: rank 1 raised CheckpointError: checkpoint /runs/a/step-00000004: __1_0.distcp does
    not match its sha256 in the manifest (its bytes changed after the save) (full traceback:
    /tmp/overlap-runtime-train-20250101-120000-4242.log)

(one line on the terminal; wrapped here). Exit codes: **2** for what the user fixes - a
configuration, data file or checkpoint (:data:`USER_ERRORS`, a subclass of
``trainer.errors.UserFacingError``, or the same raised inside a rank); **1** for a runtime fault
(any other exception, a rank that died or ran past its timeout); **130** for Ctrl-C.

The log goes to ``$OVERLAP_RUNTIME_LOG_DIR`` (default: the system's temporary directory), one
file per failure, never a directory. This module imports no torch: classes are recognised by
name, so a failure is reported even when the heavy imports are what failed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Sequence

LOG_DIR_ENV = "OVERLAP_RUNTIME_LOG_DIR"
#: Exception class names (anywhere in the class's MRO) that mean "fix your input": exit 2.
USER_ERRORS = frozenset({"UserFacingError", "ConfigError", "CheckpointError", "DataError",
                         "CheckpointException", "DeviceUnavailableError", "ValidationError"})


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def exit_code(exc: BaseException) -> int:
    """2 for an input the user fixes, 1 for a runtime fault, 130 for an interrupt."""
    names = _names(exc)
    if "KeyboardInterrupt" in names:
        return 130
    if "RankFailedError" in names:
        head = getattr(exc, "failures", {}).get(getattr(exc, "rank", None))
        return 2 if head is not None and head.exc_type in USER_ERRORS else 1
    if "RanksTimeoutError" in names:
        return 1
    return 2 if names & USER_ERRORS else 1


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _failure_line(exc: BaseException) -> str:
    """What failed and where, on one line (without the ``error:`` prefix and the log path)."""
    names = _names(exc)
    if "KeyboardInterrupt" in names:
        return "interrupted"
    if "RankFailedError" in names:
        head = getattr(exc, "failures", {}).get(getattr(exc, "rank", None))
        if head is not None:
            return _one_line(head.summary())
        return _one_line(str(exc).split("\n--- ", 1)[0])
    if "RanksTimeoutError" in names:
        return _one_line(str(exc).split("\n--- ", 1)[0].splitlines()[0])
    if names & USER_ERRORS or "ValueError" in names:
        return _one_line(str(exc))
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0].strip()}" if first else type(exc).__name__


def _write_failure_log(exc: BaseException, command: str,
                      argv: Sequence[str] | None = None) -> Path:
    """Write everything known about ``exc`` to a new log file and return its path."""
    directory = Path(os.environ.get(LOG_DIR_ENV) or tempfile.gettempdir())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = directory / f"overlap-runtime-{command}-{stamp}-{os.getpid()}.log"
    parts = [f"overlap-runtime {command} failed at {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"command line: {' '.join(sys.argv if argv is None else ['overlap-runtime', *argv])}",
             f"exit code: {exit_code(exc)}", "",
             "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        parts.append(f"--- rank {rank}: {failure.summary()} ---\n{failure.traceback}")
    for rank, stack in sorted(getattr(exc, "stacks", {}).items()):
        parts.append(f"--- rank {rank} stack at the deadline ---\n{stack}")
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path


def report_failure(exc: BaseException, command: str, argv: Sequence[str] | None = None,
                   stream: IO[str] | None = None) -> int:
    """Print ``exc`` as one line on ``stream`` (default stderr), its details to a log file
    named in that line; return the exit code (:func:`exit_code`)."""
    stream = sys.stderr if stream is None else stream
    try:
        where = f"full traceback: {_write_failure_log(exc, command, argv)}"
    except OSError as log_exc:
        where = f"no log written: {log_exc}"
    print(f"error: {_failure_line(exc)} ({where})", file=stream, flush=True)
    return exit_code(exc)
