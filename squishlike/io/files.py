"""The one way squishlike opens a file inside a directory it was given: no link followed, regular files only,
never blocking.

- `regular_file(path, root)` checks (lstat, never open) that `path` is a regular file reached from `root` without
  following a link anywhere on the way (`root` itself may be one: the user named it), and refuses a FIFO, a
  device, a socket, a directory, a link, with a FormatError naming the path.
- `open_regular(path, root)` opens it the same way: each directory below `root` opened relative to the one before
  with O_NOFOLLOW (an openat walk), the file with O_NOFOLLOW | O_NONBLOCK after an lstat, and the descriptor
  checked once more with fstat before a byte is read. Without a root, a link at `path` is followed (a file the
  user named).
- `remove_inside(path, root)` deletes a file or directory under `root` without following a link: a link is
  removed itself, never what it leads to; `plain_tree(root)` names the first entry of a tree that is not a plain
  directory or regular file (what compress checks before it reuses or publishes a directory).
- `read_bytes` and `read_json` read small files (configs, manifests, headers) through it.

The one exception: a Hugging Face cache snapshot (`<repo>/snapshots/<revision>/<file>`) links into the same repo's
`blobs/`, so there a link at `path` is followed when it stays inside the repo.
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
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
MAX_JSON_BYTES = 256 << 20  # a config, manifest or index bigger than this is not one squishlike wrote or reads


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _snapshot_repo(root: Path) -> Path | None:
    """The repo of a Hugging Face cache snapshot `root` is in (where links into `blobs/` are followed), else None."""
    parts = root.parts
    if "snapshots" in parts[:-1]:
        return Path(*parts[:len(parts) - 1 - parts[::-1].index("snapshots")])
    return None


def _unusable(path: Path, e: BaseException) -> FormatError:
    return FormatError(path, f"unusable file name ({getattr(e, 'strerror', None) or e})")


def _walk(path: Path, root: Path) -> tuple[int, str]:
    """(a descriptor of the directory holding `path`, `path`'s last name): every directory from `root` down opened
    relative to the one before with O_NOFOLLOW, so no link below `root` is followed. The caller closes it."""
    try:
        rel = Path(os.path.relpath(path, root))  # lexical: "a/../b" is "b", opened from `root` all the same
    except ValueError as e:  # a NUL byte
        raise _unusable(path, e) from None
    if not rel.parts or rel.parts[0] in (".", "..") or ".." in rel.parts:
        raise FormatError(path, f"leads outside {root}")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError as e:
        raise FormatError(root, f"cannot open ({e.strerror})") from None
    here = Path(root)
    for name in rel.parts[:-1]:
        here = here / name
        try:
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            os.close(fd)
            raise FormatError(path, "missing") from None
        except OSError as e:
            os.close(fd)
            linked = e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(here)
            raise (FormatError(here, "is a symbolic link; squishlike follows none inside the directory it reads")
                   if linked else _unusable(here, e)) from None
        os.close(fd)
        fd = inner
    return fd, rel.parts[-1]


def _lstat_inside(path: Path, root: Path) -> os.stat_result:
    """lstat of `path` reached from `root` with no link followed (see _walk)."""
    fd, name = _walk(path, root)
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        raise FormatError(path, "missing") from None
    except (OSError, ValueError) as e:
        raise _unusable(path, e) from None
    finally:
        os.close(fd)


def _checked(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise FormatError(path, "is a symbolic link; squishlike follows none inside the directory it reads")
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(path, f"is {_kind(st.st_mode)}, not a regular file")


def regular_file(path: str | PathLike, root: str | PathLike | None = None) -> Path:
    """`path`, checked (stat, never open) to be a regular file; with `root`, reached from it with no link followed
    (in a Hugging Face cache snapshot, a link that stays inside the repo is followed)."""
    path = Path(path)
    if root is not None and _snapshot_repo(Path(root)) is None:
        _checked(path, _lstat_inside(path, Path(root)))
        return path
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            st = os.stat(path)
            repo = _snapshot_repo(Path(root)) if root is not None else None
            if root is not None and (repo or Path(root)).resolve() not in path.resolve().parents:
                raise FormatError(path, f"leads outside {root} (to {path.resolve()})")
    except FileNotFoundError:
        raise FormatError(path, "missing") from None
    except (OSError, ValueError, RuntimeError) as e:  # a name too long, a NUL byte, a symlink loop
        raise _unusable(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(path, f"is {_kind(st.st_mode)}, not a regular file")
    return path


def _open_fd(path: Path, flags: int = 0, dir_fd: int | None = None, name: str | None = None) -> int:
    """A read-only descriptor on the regular file `path` (or `name` in the directory `dir_fd`), opened with
    O_NONBLOCK (a FIFO that slipped in since a stat returns at once instead of waiting for a writer), checked once
    more on the descriptor."""
    try:
        fd = os.open(path if name is None else name, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | flags, dir_fd=dir_fd)
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
    """An unbuffered binary file object on the regular file `path` (see regular_file), opened without blocking;
    with `root`, by an openat walk from it that follows no link."""
    path = Path(path)
    if root is None or _snapshot_repo(Path(root)) is not None:
        return os.fdopen(_open_fd(regular_file(path, root)), "rb", buffering=0)
    fd, name = _walk(path, Path(root))
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise FormatError(path, "missing") from None
        except (OSError, ValueError) as e:
            raise _unusable(path, e) from None
        _checked(path, st)  # a device is never opened at all
        return os.fdopen(_open_fd(path, os.O_NOFOLLOW, fd, name), "rb", buffering=0)
    finally:
        os.close(fd)


def remove_inside(path: str | PathLike, root: str | PathLike) -> None:
    """Delete `path` under `root` if it is there: a directory with everything in it, anything else (a link included: never what it leads to) unlinked. The directories on the way are
    reached with no link followed; a link among them is an error naming it."""
    path = Path(path)
    fd, name = _walk(path, Path(root))
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        _remove(fd, name, stat.S_ISDIR(st.st_mode))
    finally:
        os.close(fd)


def _remove(parent: int, name: str, is_dir: bool) -> None:
    """Delete `name` in the directory `parent`: a directory through descriptors opened with O_NOFOLLOW, so that
    nothing a link leads to is touched (shutil.rmtree takes dir_fd only from Python 3.11)."""
    if not is_dir:
        os.unlink(name, dir_fd=parent)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=parent)
    try:
        for entry in os.scandir(fd):
            _remove(fd, entry.name, entry.is_dir(follow_symlinks=False))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def plain_tree(root: str | PathLike) -> Path | None:
    """The first entry under `root` that is neither a directory nor a regular file (a link, a FIFO, a device),
    links never followed; None when there is none."""
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            if not (stat.S_ISDIR(mode := os.lstat(os.path.join(here, name)).st_mode) or stat.S_ISREG(mode)):
                return Path(here) / name
    return None


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
