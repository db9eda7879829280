"""Atomic files and directories: temp names beside the final one, fsync, rename, fsync of the directory."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from .fault import fault_point
from ..errors import FormatError
from .files import open_regular, plain_tree
from .stream import StreamWriter

_COPY_CHUNK = 1 << 20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: Path) -> Path:
    """A fresh temp name beside `final`, which `remove_stale_temps` recognises. It ends with the final name, so
    libraries that insist on an extension (mx.save_safetensors) keep it."""
    return final.with_name(f".tmp-{os.getpid()}-{time.monotonic_ns()}-{final.name}")


def raise_naming(e: BaseException, path: Path):
    """Re-raise `e`; an OSError that names no file (disk full, file too large, I/O error) gets `path` added, so
    the message says which file could not be written."""
    if isinstance(e, OSError) and e.filename is None and e.errno is not None:
        raise OSError(e.errno, f"{e.strerror or e}", str(path)) from e
    raise e


def publish_file(tmp: Path, final: Path) -> None:
    """fsync a fully written file, rename it to `final` (replacing what is there) and fsync the directory."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    fault_point(f"before-rename:{final.name}")
    os.replace(tmp, final)
    fault_point(f"renamed:{final.name}")
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path beside `final` for a library to write; on success publish it as `final`.

    On any failure (an exception, Ctrl-C) the temp file is removed and `final` is untouched.
    """
    final = Path(final)
    tmp = temp_name(final)
    try:
        yield tmp
        publish_file(tmp, final)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise_naming(e, final)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[StreamWriter]:
    """Yield a StreamWriter on a temp name beside `final`, published as `final` once the block has run; the
    writer's record() (size, checksum) is valid then."""
    final = Path(final)
    with atomic_path(final) as tmp:
        writer = StreamWriter(tmp, label=f"write:{final.name}")
        try:
            yield writer
            writer.close()
        except BaseException:
            writer.abort()
            raise


@contextlib.contextmanager
def stream_file(path: Path) -> Iterator[StreamWriter]:
    """A StreamWriter on `path` itself, for files inside a temp directory (or under a temp name) that is published
    as a whole afterwards: no temp name, fsync and directory fsync of its own. Removed on failure."""
    path = Path(path)
    writer = StreamWriter(path, label=f"write:{path.name}")
    try:
        yield writer
        writer.close()
    except BaseException as e:
        writer.abort()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise_naming(e, path)


def write_bytes(final: Path, data: bytes) -> dict:
    """Atomically write `data`; return its file record (size, checksum)."""
    with atomic_file(final) as w:
        w.write(data)
    return w.record()


def write_json(final: Path, obj: Any, indent: int | None = 1) -> dict:
    """Atomically write JSON; return its file record (size, checksum). `indent=None`: on one line, for files only
    squishlike reads and rewrites often (a compress's journal and resume state, after every block): the json
    module's C encoder writes those, an indented file takes its Python one, 4x slower (SmolLM2's journal: 15 ms)."""
    return write_bytes(final, json.dumps(obj, indent=indent, sort_keys=True).encode())


def copy_file(src: Path, final: Path) -> dict:
    """Atomically copy the regular file `src` (inside its own directory, see files.regular_file) to `final`;
    return the copy's file record (size, checksum)."""
    with open_regular(src, Path(src).parent) as f, atomic_file(final) as w:
        shutil.copyfileobj(f, w, _COPY_CHUNK)
    return w.record()


# ---------------------------------------------------------------------------------------------- directories


def make_temp_dir(final: Path) -> Path:
    """A fresh, empty temp directory beside `final` (same filesystem, so it can be renamed into place)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(1000):
        # like tempfile.mkdtemp, but with the umask's permissions rather than 0o700: the directory is published
        # as the model (or a tier of it), which other users of a shared model directory must be able to read
        tmp = final.parent / f".{final.name}.tmp-{os.urandom(6).hex()}"
        try:
            os.mkdir(tmp, 0o777)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(final.parent))
    # The directory exists and the caller does not own it yet: an interrupt here (or anywhere before the caller's
    # `try`) escapes every local cleanup. `sweeping_temps`, around the whole locked write, is what removes it.
    fault_point(f"mkdtemp:{final.name}")
    return tmp


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE, macOS renamex_np RENAME_SWAP).

    False where the OS or the filesystem cannot; the caller then falls back to two renames.
    """
    try:
        if sys.platform.startswith("linux"):
            rc = _libc().renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2)  # AT_FDCWD, RENAME_EXCHANGE
        elif sys.platform == "darwin":
            rc = _libc().renamex_np(os.fsencode(a), os.fsencode(b), 2)  # RENAME_SWAP
        else:
            return False
    except (AttributeError, OSError):  # no such libc function (glibc < 2.28)
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a fully written directory into place, replacing an older one (which is then deleted).

    Replacing is one atomic exchange where the OS offers it (Linux, macOS), so a crash at any moment leaves the
    old directory or the new one at `final`, never neither: `compress --force` cannot lose the model it replaces.
    Elsewhere it takes two renames, between which `final` is briefly absent, never partial.

    `tmp` must be a directory holding only directories and regular files: a link in it (or `tmp` itself a link)
    is a FormatError naming it, and nothing is published, so no link is ever published in or as `final`.
    """
    odd = tmp if not stat.S_ISDIR(os.lstat(tmp).st_mode) else plain_tree(tmp)
    if odd is not None:
        raise FormatError(odd, "is not a regular file or directory; not published")
    for here, _, files in os.walk(tmp):
        for name in files:
            with open_regular(Path(here) / name, tmp) as f:
                os.fsync(f.fileno())
    fsync_dir(tmp)
    fault_point(f"before-publish:{final.name}")
    if (final.exists() or final.is_symlink()) and _exchange(tmp, final):
        fault_point(f"publish:{final.name}")  # `final` is the new directory, `tmp` the old one
        fsync_dir(final.parent)
        fault_point(f"published:{final.name}")
        _remove_replaced(tmp)
        return
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    fault_point(f"publish:{final.name}")
    os.replace(tmp, final)
    fault_point(f"published:{final.name}")
    fsync_dir(final.parent)
    if old is not None:
        _remove_replaced(old)


def _remove_replaced(old: Path) -> None:
    """Delete what publish_dir replaced: a directory, or a link that stood at its place (the link itself, never
    what it leads to, nor left behind as a temporary)."""
    if old.is_symlink():
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def sweeping_temps(directory: Path, name: str | None = None) -> Iterator[None]:
    """Around a write that makes temps in `directory` while holding the lock of their names: first remove the
    temps of `name` (of any name when None) a killed writer left, and if the block stops with an exception
    (Ctrl-C included), the ones it leaves, before the lock is let go. A KeyboardInterrupt can land between a temp's
    creation and its writer's `try`, where no local cleanup sees it; this catches it wherever it lands."""
    remove_stale_temps(directory, name)
    try:
        yield
    except BaseException:
        remove_stale_temps(directory, name)
        raise


def remove_stale_temps(directory: Path, name: str | None = None) -> None:
    """Delete temp files/dirs left by a crashed writer (names we create: .NAME.tmp-*, .NAME.old-*, and atomic
    files' .tmp-PID-NS-NAME); with `name`, only those of that one NAME. Call it only while holding the lock that
    every writer of those names holds, when none of them can be alive."""
    stem = glob.escape(name) if name is not None else "*"
    patterns = [f".{stem}.tmp-*", f".{stem}.old-*"] + ([".tmp-*"] if name is None else [f".tmp-*-{stem}"])
    for pattern in patterns:
        for p in directory.glob(pattern):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
