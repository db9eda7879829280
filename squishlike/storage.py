"""Every write squishlike makes goes through here: atomic files, atomic directories, locks, sentinels, checksums.

The rules (SPEC §2): write to a temporary name in the same directory, fsync, rename into place, fsync the
directory. A crash at any moment leaves the old state or nothing, never a half-written file under its final name.
Sentinels are written last and carry the size and checksum of every file of their tier, so a sentinel can only
ever describe complete data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

from .errors import DirectoryBusyError, FormatError

CHECKSUM = "sha256"
_CHUNK = 16 << 20


def _fault_point(label: str) -> None:
    """Test-only hook: SQUISHLIKE_FAULT_AT=<glob> kills the process at a matching write boundary (crash tests)."""
    target = os.environ.get("SQUISHLIKE_FAULT_AT")
    if target and fnmatch.fnmatchcase(label, target):
        os._exit(137)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_checksum(path: Path) -> str:
    h = hashlib.new(CHECKSUM)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class _HashingWriter:
    """A file wrapper that hashes and counts what goes through it, so a file is checksummed as it is written."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.hash = hashlib.new(CHECKSUM)
        self.size = 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def record(self) -> dict:
        return {"size": self.size, CHECKSUM: self.hash.hexdigest()}


def _temp_name(final: Path) -> Path:
    # The temp name ends with the final name, so libraries that insist on an extension (mx.save_safetensors) keep it.
    return final.with_name(f".tmp-{os.getpid()}-{time.monotonic_ns()}-{final.name}")


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path beside `final` for a library to write; on success fsync it and rename it into place.

    On any failure (an exception, Ctrl-C) the temp file is removed and `final` is untouched.
    """
    final = Path(final)
    tmp = _temp_name(final)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _fault_point(f"before-rename:{final.name}")
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[_HashingWriter]:
    """Like atomic_path, but yields a writer that hashes and counts the bytes as they are written."""
    with atomic_path(final) as tmp, open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        yield writer


def file_record(path: Path) -> dict:
    """The {size, checksum} record sentinels and manifests keep for every file."""
    return {"size": Path(path).stat().st_size, CHECKSUM: file_checksum(path)}


def write_json(final: Path, obj: Any) -> dict:
    """Atomically write JSON; return its file record (size, checksum)."""
    with atomic_file(final) as w:
        w.write(json.dumps(obj, indent=1, sort_keys=True).encode())
    return w.record()


def write_npy(final: Path, array: np.ndarray) -> dict:
    """Atomically write one .npy (never pickled); return its file record (size, checksum)."""
    with atomic_file(final) as w:
        np.lib.format.write_array(w, np.ascontiguousarray(array), allow_pickle=False)
    return w.record()


def copy_file(src: Path, final: Path) -> dict:
    with atomic_file(final) as w, open(src, "rb") as f:
        shutil.copyfileobj(f, w, _CHUNK)
    return w.record()


def read_json(path: Path) -> Any:
    """JSON from `path`; FormatError naming the file when it is unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(path, f"not readable as JSON: {e}") from None


# ---------------------------------------------------------------------------------------------- directories


def make_temp_dir(final: Path) -> Path:
    """A fresh, empty temp directory beside `final` (same filesystem, so it can be renamed into place)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a fully written directory into place, replacing an older one (which is then deleted).

    Between the two renames `final` is briefly absent, never partial: readers see old, nothing, or new.
    """
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    _fault_point(f"publish:{final.name}")
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(directory: Path) -> None:
    """Delete temp files/dirs left by a crashed writer (names we create: .NAME.tmp-*, .NAME.old-*)."""
    for p in directory.glob(".*.tmp-*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for p in directory.glob(".*.old-*"):
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- lock


class DirectoryLock:
    """An exclusive flock on DIR/.squishlike.lock. The kernel drops it when the process dies, so no stale locks."""

    def __init__(self, directory: Path, name: str = ".squishlike.lock"):
        self.path = Path(directory) / name
        self._fd: int | None = None

    def acquire(self, blocking: bool = True) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def exclusive(directory: Path, what: str, name: str = ".squishlike.lock") -> Iterator[None]:
    """Hold the directory's lock or fail at once with DirectoryBusyError (two compress runs aimed at one OUT)."""
    lock = DirectoryLock(directory, name)
    if not lock.acquire(blocking=False):
        raise DirectoryBusyError(f"{directory}: another process is {what}; try again when it has finished")
    try:
        yield
    finally:
        lock.release()


# ---------------------------------------------------------------------------------------------- sentinels

SENTINEL_VERSION = 1


def write_sentinel(path: Path, *, manifest_fingerprint: str, files: dict[str, dict], **extra: Any) -> None:
    """Mark a tier ready. `files` maps paths relative to the sentinel's directory to {size, sha256}."""
    payload = {
        "format_version": SENTINEL_VERSION,
        "manifest_fingerprint": manifest_fingerprint,
        "files": files,
        **extra,
    }
    write_json(path, payload)


def read_sentinel(path: Path, manifest_fingerprint: str) -> tuple[dict | None, str]:
    """(payload, "") for a valid sentinel, else (None, why it does not count).

    Valid means: readable JSON of our version, made for this manifest, naming files that exist with the recorded
    sizes and inside the sentinel's directory. Checksums are not re-read here (that is `verify`); sizes are cheap.
    """
    if not path.exists():
        return None, "absent"
    try:
        payload = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None, "unreadable or not JSON"
    if not isinstance(payload, dict) or payload.get("format_version") != SENTINEL_VERSION:
        return None, "unknown sentinel version"
    if payload.get("manifest_fingerprint") != manifest_fingerprint:
        return None, "stale (made for another manifest)"
    files = payload.get("files")
    if not isinstance(files, dict) or not files:
        return None, "names no files"
    root = path.parent.resolve()
    for rel, record in files.items():
        target = (root / rel).resolve()
        if not isinstance(rel, str) or root not in target.parents:
            return None, f"names a file outside its directory: {rel!r}"
        if not isinstance(record, dict) or not isinstance(record.get("size"), int):
            return None, f"malformed record for {rel}"
        try:
            if target.stat().st_size != record["size"]:
                return None, f"{rel}: size differs from the sentinel"
        except OSError:
            return None, f"{rel}: missing"
    return payload, ""


def verify_files(root: Path, files: dict[str, dict]) -> list[str]:
    """Re-read and checksum every recorded file; return one problem line per bad file."""
    problems = []
    for rel, record in files.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != record.get("size"):
            problems.append(f"{p}: size {p.stat().st_size}, expected {record.get('size')}")
        elif file_checksum(p) != record.get(CHECKSUM):
            problems.append(f"{p}: {CHECKSUM} differs from the recorded checksum")
    return problems
