"""Directory locks: one writer at a time per model directory, released by the kernel when the holder dies."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Iterator

from ..errors import DirectoryBusyError, FormatError
from .fault import fault_point

LOCK_NAME = ".squishlike.lock"


class DirectoryLock:
    """An exclusive flock on DIR/.squishlike.lock. The kernel drops it when the process dies, so no stale locks."""

    def __init__(self, directory: Path, name: str = LOCK_NAME, *, leave_no_file: bool = False):
        self.path = Path(directory) / name
        self.leave_no_file = leave_no_file  # remove the lock file on release (a lock in someone else's directory)
        self._fd: int | None = None

    def acquire(self, blocking: bool = True) -> bool:
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return False
                raise
            if self._is_current(fd):
                break
            os.close(fd)  # the holder we waited for removed the file (leave_no_file): lock the one now at the path
        self._fd = fd
        try:
            fault_point(f"lock:{self.path.parent.name}")
        except BaseException:  # interrupted before the caller could own the lock: do not leak it
            self.release()
            raise
        return True

    def _open(self) -> int:
        """The lock file, created if absent; never through a link (a planted one would make us create or write its
        target, outside the directory) and never a FIFO or device."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:  # a read-only directory stays an OSError: its callers load without building
            if e.errno != errno.ELOOP:
                raise
            raise FormatError(self.path, "is a symbolic link; refusing to lock through it") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FormatError(self.path, "is not a regular file; refusing to lock through it")
        return fd

    def _is_current(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            if self.leave_no_file:
                # Deleted while still held: a process that opened it and waits on it sees, once it has the lock,
                # that the path no longer leads to its file (_is_current) and locks afresh.
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def exclusive(directory: Path, what: str, name: str = LOCK_NAME) -> Iterator[None]:
    """Hold the directory's lock or fail at once with DirectoryBusyError (two compress runs aimed at one OUT).
    The lock file is removed on the way out, interrupted or not: it lives in a directory that is not ours (a
    killed process leaves it, and the next run into that OUT removes it)."""
    lock = DirectoryLock(directory, name, leave_no_file=True)
    if not lock.acquire(blocking=False):
        raise DirectoryBusyError(f"{directory}: another process is {what}; try again when it has finished")
    try:
        yield
    finally:
        lock.release()
