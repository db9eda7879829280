"""What happened to a directory while a test ran, seen by the kernel (Linux inotify): every open, read, write,
listing, creation and deletion of it or of anything under it. A link out of a store or a compress's directory
must be refused before anything it leads to is opened; the files' own state (tree_state) cannot show an open
or a read, inotify does."""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from pathlib import Path

import pytest

IN_ACCESS, IN_MODIFY, IN_OPEN, IN_CREATE, IN_DELETE = 0x1, 0x2, 0x20, 0x100, 0x200
EVENTS = IN_ACCESS | IN_MODIFY | IN_OPEN | IN_CREATE | IN_DELETE
NAMES = {IN_ACCESS: "read", IN_MODIFY: "written", IN_OPEN: "opened", IN_CREATE: "created", IN_DELETE: "deleted"}

needs_inotify = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


class Watch:
    """inotify watches on `root` and every directory under it, from creation on; `events()` lists what was done
    to them since (relative path, what), and closes the watch."""

    def __init__(self, root: Path):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self._fd >= 0, os.strerror(ctypes.get_errno())
        self._dirs: dict[int, Path] = {}
        for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(d), EVENTS)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self._dirs[wd] = d.relative_to(root)

    def events(self) -> list[tuple[str, str]]:
        raw = b""
        try:
            while chunk := os.read(self._fd, 1 << 16):
                raw += chunk
        except BlockingIOError:
            pass
        os.close(self._fd)
        found, at = [], 0
        while at < len(raw):
            wd, mask, _, length = struct.unpack_from("iIII", raw, at)
            name = raw[at + 16:at + 16 + length].rstrip(b"\0").decode()
            at += 16 + length
            what = [NAMES[bit] for bit in NAMES if mask & bit]
            if what and wd in self._dirs:
                found.append((str(self._dirs[wd] / name), "+".join(what)))
        return found
