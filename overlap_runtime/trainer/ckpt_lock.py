"""One run per checkpoint directory: an exclusive ``flock`` on ``<checkpoint.dir>/.lock``.

Two runs sharing a ``checkpoint.dir`` destroy each other's work: the second one's start-up clears
the first one's in-flight ``.tmp-step-*`` save, and their commits and prunes interleave. Rank 0
takes the lock before touching the directory and holds it until the run ends; a second run is
refused, naming the holder (pid, host, start time, read from the lock file). The kernel drops the
lock when the holding process exits, however it exits (a SIGKILLed run leaves no stale lock; the
file stays, holding the last holder's description, and is only read when the lock is taken).

``flock`` is advisory and local to one machine's kernel on most network filesystems (NFS emulates
it with byte-range locks since Linux 2.6.12): runs on different machines sharing a directory are
told apart only where the filesystem supports it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import weakref
from pathlib import Path

from overlap_runtime.trainer.errors import CheckpointError

LOCK_NAME = ".lock"


def _holder(fd: int) -> str:
    """The holder's description written in the lock file (``pid 12, host h, since ...``)."""
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        info = json.loads(raw)
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not described itself yet"


class DirectoryLock:
    """The exclusive lock of checkpoint directory ``directory`` (created if missing).

    Raises:
        CheckpointError: another process holds it (naming pid and host), or the lock file
            cannot be opened.
    """

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise CheckpointError(f"checkpoint.dir={str(directory)!r}: cannot open its lock file "
                                  f"{self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"checkpoint.dir={str(directory)!r} is in use by another run ({holder}): two "
                f"runs must not share a checkpoint directory; wait for it to end or choose "
                f"another checkpoint.dir") from None
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(f"checkpoint.dir={str(directory)!r}: cannot lock "
                                  f"{self.path}: {exc.strerror}") from None
        since = datetime.datetime.now().isoformat(timespec="seconds")
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self._fd: int | None = fd
        # closing the descriptor releases the lock, also when the owner is garbage-collected
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            self._fd = None
            self._finalizer()


def check_unlocked(directory: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the holder if another run holds ``directory``'s
    lock now (taken and released at once; nothing is created where no directory exists)."""
    if (Path(directory) / LOCK_NAME).is_file():
        DirectoryLock(directory).release()
