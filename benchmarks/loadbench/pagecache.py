"""The page cache of benchmark files: how much of them is resident (mincore), eviction (posix_fadvise), warming, and
priming fresh memory before a run."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

from .probes import read_into


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(paths: list[Path]) -> int:
    """How many bytes of these files are in the page cache (mincore over a read-only mapping)."""
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {p}")
                total += sum(1 for v in bytes(vec) if v & 1) * page
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return total


def evict(paths: list[Path], tries: int = 5) -> int:
    """Drop the files' pages from the page cache; returns the bytes still resident after (0 is the goal)."""
    left = 0
    for _ in range(tries):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = resident_bytes(paths)
        if left == 0:
            break
        time.sleep(0.2)
    return left


def warm(paths: list[Path]) -> None:
    read_into([str(p) for p in paths], None, 2, chunk=16 << 20)


def prime_memory(nbytes: int) -> None:
    """Touch and free `nbytes` of huge-page memory, so the next process starts with recently used memory."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        m.madvise(mmap.MADV_HUGEPAGE)
    import numpy as np

    touch = np.frombuffer(m, np.uint8)
    touch[::4096] = 1
    del touch
    m.close()
