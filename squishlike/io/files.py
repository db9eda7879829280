"""The one way squishlike opens a file it reads: regular files only, never blocking, never outside the model.

- `regular_file(path, root)` stats `path` and refuses anything that is not a regular file (a FIFO, a device, a
  socket, a directory) and anything that resolves outside `root`, with a FormatError naming the path.
- `open_regular(path, root)` opens it with O_NONBLOCK (opening a FIFO that slipped in between the stat and the open
  returns at once instead of waiting for a writer) and checks the opened descriptor once more.
- `read_bytes` and `read_json` read small files (configs, manifests, headers) through it.

A symbolic link is followed only where a format calls for one: a Hugging Face cache snapshot
(`<repo>/snapshots/<revision>/<file>`) links into the same repo's `blobs/`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from os import PathLike
from pathlib import Path
from typing import IO, Any

from ..errors import FormatError

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}
MAX_JSON_BYTES = 256 << 20  # a config, manifest or index bigger than this is not one squishlike wrote or reads


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _allowed_root(path: Path, root: Path) -> Path:
    """The directory `path` must resolve inside: `root`, or the whole repo of a Hugging Face cache snapshot."""
    parts = root.parts
    if "snapshots" in parts[:-1]:
        return Path(*parts[:len(parts) - 1 - parts[::-1].index("snapshots")])
    return root


def regular_file(path: str | PathLike, root: str | PathLike | None = None) -> Path:
    """`path`, checked to be a regular file (stat, never open) that stays inside `root` once links are followed.

    Only a link at `path` itself is resolved: the directories between `root` and `path` are the model's own, and
    their readers refuse a linked one (a tier directory, `tensors/`)."""
    path = Path(path)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            st = os.stat(path)
            if root is not None:
                inside = _allowed_root(path, Path(root)).resolve()
                if inside not in path.resolve().parents:
                    raise FormatError(path, f"leads outside {root} (to {path.resolve()})")
    except FileNotFoundError:
        raise FormatError(path, "missing") from None
    except (OSError, ValueError, RuntimeError) as e:  # a name too long, a NUL byte, a symlink loop
        raise FormatError(path, f"unusable file name ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(path, f"is {_kind(st.st_mode)}, not a regular file")
    return path


def _open_fd(path: Path, flags: int = 0) -> int:
    """A read-only descriptor on the regular file `path`, opened with O_NONBLOCK (a FIFO that slipped in since a
    stat returns at once instead of waiting for a writer), checked once more on the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | flags)
    except OSError as e:
        problem = "is a symbolic link" if e.errno == errno.ELOOP and flags else f"cannot open ({e.strerror})"
        raise FormatError(path, problem) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FormatError(path, f"is {_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_regular(path: str | PathLike, root: str | PathLike | None = None) -> IO[bytes]:
    """An unbuffered binary file object on the regular file `path` (see regular_file), opened without blocking."""
    return os.fdopen(_open_fd(regular_file(path, root)), "rb", buffering=0)


def open_written(path: str | PathLike) -> IO[bytes]:
    """open_regular for a file squishlike wrote itself in a directory it checked: never through a link (O_NOFOLLOW),
    one open and one fstat, for loads that open thousands of files."""
    return os.fdopen(_open_fd(Path(path), os.O_NOFOLLOW), "rb", buffering=0)


def read_bytes(path: str | PathLike, root: str | PathLike | None = None, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a small regular file; FormatError naming it when it is bigger than `limit` or unreadable."""
    with open_regular(path, root) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FormatError(path, f"is {size} bytes; more than the {limit} this kind of file may hold")
        try:
            return f.read(limit + 1)[:limit]
        except OSError as e:
            raise FormatError(path, f"unreadable ({e.strerror})") from None


def read_json(path: str | PathLike, root: str | PathLike | None = None) -> Any:
    """JSON from a regular file; FormatError naming the file when it is unreadable or not JSON."""
    raw = read_bytes(path, root)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
        raise FormatError(path, f"not readable as JSON: {e}") from None


def read_json_object(path: str | PathLike, root: str | PathLike | None = None) -> dict:
    """read_json, refusing anything but a JSON object (every config, manifest and index squishlike reads is one)."""
    value = read_json(path, root)
    if not isinstance(value, dict):
        raise FormatError(path, f"is a JSON {type(value).__name__}, not an object")
    return value
