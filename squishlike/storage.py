"""Every write squishlike makes goes through here: atomic files, atomic directories, locks, sentinels, checksums.

The rules (docs/format.md §8): write to a temporary name in the same directory, fsync, rename into place, fsync the
directory. A crash at any moment leaves the old state or nothing, never a half-written file under its final name.
Sentinels are written last and carry the size and checksum of every file of their tier, so a sentinel can only
ever describe complete data.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

from .errors import DirectoryBusyError, FormatError

CHECKSUM = "sha256"
_CHUNK = 16 << 20


_fault_hits = 0  # how many boundaries matching SQUISHLIKE_FAULT_AT this process has passed


def _fault_point(label: str) -> None:
    """Test-only hook at every write/rename boundary (crash tests, fuzz/crash_sweep.py). Off unless the env asks:

    SQUISHLIKE_FAULT_AT=<glob>      act at a boundary whose label matches (labels: "kind:file name", e.g.
                                    "before-rename:manifest.json", "publish:finalized", "lock:out").
    SQUISHLIKE_FAULT_NTH=<n>        ... at the n-th matching boundary this process reaches (default 1).
    SQUISHLIKE_FAULT_ACTION=<what>  kill (default: SIGKILL, a real kill -9), exit (os._exit(137)),
                                    sigint (a real SIGINT, as Ctrl-C), enospc (raise OSError ENOSPC, as disk full),
                                    pause:<seconds> (sleep there, then go on: holds a lock open for race tests).
    SQUISHLIKE_FAULT_LOG=<file>     append "pid label" for every boundary reached (to enumerate them).
    """
    log = os.environ.get("SQUISHLIKE_FAULT_LOG")
    target = os.environ.get("SQUISHLIKE_FAULT_AT")
    if not (log or target):
        return
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {label}\n".encode())  # one small O_APPEND write: lines never interleave
        finally:
            os.close(fd)
    if not target or not fnmatch.fnmatchcase(label, target):
        return
    global _fault_hits
    _fault_hits += 1
    if _fault_hits != int(os.environ.get("SQUISHLIKE_FAULT_NTH", "1")):
        return
    action = os.environ.get("SQUISHLIKE_FAULT_ACTION", "kill")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sigint":
        os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt at the next bytecode
        time.sleep(0.01)
        return  # SIGINT ignored by this process: carry on, as it would
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (fault injected at {label})")
    elif action.startswith("pause:"):
        time.sleep(float(action.split(":", 1)[1]))
        return
    os._exit(137)  # "exit", or anything unknown: die without cleanup


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

    def __init__(self, f: IO[bytes], label: str = ""):
        self._f = f
        self._label = label
        self.hash = hashlib.new(CHECKSUM)
        self.size = 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(memoryview(data).cast("B"))
        n = self._f.write(data)
        if self._label:  # crash tests: a kill here leaves a partly written temp file
            label, self._label = self._label, ""
            if os.environ.get("SQUISHLIKE_FAULT_AT") or os.environ.get("SQUISHLIKE_FAULT_LOG"):
                self._f.flush()
            _fault_point(label)
        return n

    def flush(self) -> None:
        self._f.flush()

    def record(self) -> dict:
        return {"size": self.size, CHECKSUM: self.hash.hexdigest()}


def _temp_name(final: Path) -> Path:
    # The temp name ends with the final name, so libraries that insist on an extension (mx.save_safetensors) keep it.
    return final.with_name(f".tmp-{os.getpid()}-{time.monotonic_ns()}-{final.name}")


def _raise_naming(e: BaseException, path: Path):
    """Re-raise `e`; an OSError that names no file (disk full, file too large, I/O error) gets `path` added, so
    the message says which file could not be written."""
    if isinstance(e, OSError) and e.filename is None and e.errno is not None:
        raise OSError(e.errno, f"{e.strerror or e}", str(path)) from e
    raise e


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
        _fault_point(f"renamed:{final.name}")
        fsync_dir(final.parent)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        _raise_naming(e, final)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[_HashingWriter]:
    """Like atomic_path, but yields a writer that hashes and counts the bytes as they are written."""
    with atomic_path(final) as tmp, open(tmp, "wb") as f:
        writer = _HashingWriter(f, label=f"write:{Path(final).name}")
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
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
        raise FormatError(path, f"not readable as JSON: {e}") from None


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
    try:
        _fault_point(f"mkdtemp:{final.name}")
    except BaseException:  # interrupted before the caller could own it
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    """
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(tmp)
    _fault_point(f"before-publish:{final.name}")
    if (final.exists() or final.is_symlink()) and _exchange(tmp, final):
        _fault_point(f"publish:{final.name}")  # `final` is the new directory, `tmp` the old one
        fsync_dir(final.parent)
        _fault_point(f"published:{final.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    _fault_point(f"publish:{final.name}")
    os.replace(tmp, final)
    _fault_point(f"published:{final.name}")
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(directory: Path, name: str | None = None) -> None:
    """Delete temp files/dirs left by a crashed writer (names we create: .NAME.tmp-*, .NAME.old-*, and atomic
    files' .tmp-PID-NS-NAME); with `name`, only those of that one NAME. Call it only while holding the lock that
    every writer of those names holds, when none of them can be alive."""
    import glob

    stem = glob.escape(name) if name is not None else "*"
    patterns = [f".{stem}.tmp-*", f".{stem}.old-*"] + ([".tmp-*"] if name is None else [f".tmp-*-{stem}"])
    for pattern in patterns:
        for p in directory.glob(pattern):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


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
        try:
            _fault_point(f"lock:{self.path.parent.name}")
        except BaseException:  # interrupted before the caller could own the lock: do not leak it
            self.release()
            raise
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
    if not path.is_file():  # never open a FIFO or a device: reading it could block forever
        return None, "absent" if not (path.exists() or path.is_symlink()) else "not a regular file"
    try:
        payload = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
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
        try:
            target = (root / rel).resolve()
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
            return None, f"names an unusable file name: {rel!r}"
        if not isinstance(rel, str) or root not in target.parents:
            return None, f"names a file outside its directory: {rel!r}"
        if not isinstance(record, dict) or not isinstance(record.get("size"), int) or isinstance(
                record.get("size"), bool):
            return None, f"malformed record for {rel}"
        try:
            if not target.is_file():
                return None, f"{rel}: missing"
            if target.stat().st_size != record["size"]:
                return None, f"{rel}: size differs from the sentinel"
        except OSError:
            return None, f"{rel}: missing"
    return payload, ""


def sentinel_says_damaged(why: str) -> bool:
    """Whether read_sentinel's reason means a valid sentinel over damaged files (missing, wrong size), as opposed
    to no sentinel, a stale one, or one that is itself unreadable."""
    return why.endswith((": missing", ": size differs from the sentinel"))


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


# ---------------------------------------------------------------------------------------------- big files

_DIRECT_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the logical block size
_STREAM_BUFFER = 8 << 20


_spare_buffers: list = []  # bounce buffers of finished writers: page-aligned, already faulted in, reused


def _take_buffer():
    try:
        return _spare_buffers.pop()  # list.pop is atomic under the GIL
    except IndexError:
        import mmap

        return mmap.mmap(-1, _STREAM_BUFFER)


class StreamWriter:
    """A sequential writer for big files (the tier caches), checksummed as it goes without re-reading the file.

    The checksum runs on a second thread (hashlib releases the GIL), so hashing overlaps the writing. Where the
    filesystem takes it, data goes out with O_DIRECT through two page-aligned bounce buffers, one filling while
    the other is written: no page-cache pages to allocate (fresh pages are the slow part of writing,
    docs/design.md §4.1) and nothing dirty left for the fsync. Anywhere else (tmpfs, no
    O_DIRECT, a crash test watching write boundaries) it falls back to plain buffered writes. Either way the bytes
    on disk and the record are the same. Use it through `atomic_stream`, which adds the temp name, fsync, rename.
    """

    def __init__(self, path: Path, label: str = ""):
        import threading

        self._label = label
        self._hash = hashlib.new(CHECKSUM)
        self.size = 0
        self._error: BaseException | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        watched = bool(os.environ.get("SQUISHLIKE_FAULT_AT") or os.environ.get("SQUISHLIKE_FAULT_LOG"))
        self.direct = (hasattr(os, "O_DIRECT") and not watched
                       and os.environ.get("SQUISHLIKE_DIRECT_IO", "1") != "0")
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                self.direct = False
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o644)
        self._pending: list = []  # hash queue: buffers not hashed yet, in order
        self._cond = threading.Condition()
        self._closing = False
        self._hasher = threading.Thread(target=self._hash_loop, name="squishlike-hash", daemon=True)
        self._hasher.start()
        if self.direct:
            self._buffers = [_take_buffer(), _take_buffer()]
            self._views = [np.frombuffer(b, np.uint8) for b in self._buffers]
            self._in_flight: list = [None, None]  # the write of each buffer, running on the writer thread
            self._current, self._fill = 0, 0
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(1, thread_name_prefix="squishlike-write")

    # -- hashing thread

    def _hash_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                data = self._pending[0]
            try:
                self._hash.update(data)
            except BaseException as e:  # noqa: BLE001 - reported by close()
                self._error = e
            with self._cond:
                self._pending.pop(0)
                self._cond.notify_all()

    def _to_hash(self, data: memoryview) -> None:
        with self._cond:
            while len(self._pending) >= 64:  # bound what is queued (the buffers stay referenced until hashed)
                self._cond.wait()
            self._pending.append(data)
            self._cond.notify_all()

    # -- writing

    def write(self, data) -> int:
        """Append `data` (bytes, a C-contiguous NumPy array, any buffer). The caller must not change it afterwards."""
        if self._error is not None:
            raise self._error
        if isinstance(data, np.ndarray):
            if not data.flags.c_contiguous:
                raise ValueError("StreamWriter.write needs C-contiguous data")
            data = data.reshape(-1).view(np.uint8)
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError("StreamWriter.write needs contiguous data")
        mv = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
        n = len(mv)
        if n == 0:
            return 0
        self._to_hash(mv)
        if self.direct:
            src = np.frombuffer(mv, np.uint8)
            done = 0
            while done < n:
                take = min(n - done, _STREAM_BUFFER - self._fill)
                np.copyto(self._views[self._current][self._fill:self._fill + take], src[done:done + take])
                self._fill += take
                done += take
                if self._fill == _STREAM_BUFFER:
                    self._submit(_STREAM_BUFFER)
        else:
            view = mv
            while len(view):
                view = view[os.write(self._fd, view):]
        self.size += n
        if self._label:  # crash tests: a kill here leaves a partly written temp file
            label, self._label = self._label, ""
            _fault_point(label)
        return n

    def _submit(self, length: int) -> None:
        i = self._current
        self._in_flight[i] = self._writer.submit(self._write_block, i, length)
        self._current = 1 - i
        self._fill = 0
        previous = self._in_flight[self._current]
        if previous is not None:  # the other buffer must be on disk before it is filled again
            previous.result()
            self._in_flight[self._current] = None

    def _write_block(self, i: int, length: int) -> None:
        view = memoryview(self._buffers[i])[:length]
        try:
            while len(view):
                view = view[os.write(self._fd, view):]
        finally:
            view.release()

    def close(self) -> None:
        """Write what is buffered, wait for the checksum, close the file. Raises what any thread hit."""
        try:
            if self.direct:
                tail = self._fill
                if tail:
                    padded = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN
                    self._views[self._current][tail:padded] = 0
                    self._submit(padded)
                for f in self._in_flight:
                    if f is not None:
                        f.result()
                os.ftruncate(self._fd, self.size)  # drop the padding of the last block
        finally:
            self._stop()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Stop without finishing (the caller removes the file)."""
        with contextlib.suppress(BaseException):
            self._stop()

    def _stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._hasher.join()
        if self.direct:
            self._writer.shutdown(wait=True)
            if self._buffers:
                del self._views
                _spare_buffers.extend(self._buffers)
                self._buffers = []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def record(self) -> dict:
        """{size, checksum}, as file_record would compute it from the finished file."""
        return {"size": self.size, CHECKSUM: self._hash.hexdigest()}


@contextlib.contextmanager
def atomic_stream(final: Path) -> Iterator[StreamWriter]:
    """Like atomic_file, for big files: yields a StreamWriter; its record() is valid once the block has run."""
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
    """A StreamWriter on `path` itself, for files inside a temp directory that publish_dir (which fsyncs every
    file) will rename into place as a whole: no per-file temp name, fsync and directory fsync."""
    path = Path(path)
    writer = StreamWriter(path, label=f"write:{path.name}")
    try:
        yield writer
        writer.close()
    except BaseException as e:
        writer.abort()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        _raise_naming(e, path)


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy header np.save writes for a C-ordered array of `dtype` and `shape` (format 1.0)."""
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    )
    return buffer.getvalue()


def write_npy_stream(final: Path, array: np.ndarray, atomic: bool = True) -> dict:
    """write_npy for big arrays: the same .npy bytes, written by a StreamWriter. Returns the file record.
    `atomic=False`: straight to `final`, for a file inside a temp directory published by publish_dir."""
    array = np.ascontiguousarray(array)
    with (atomic_stream(final) if atomic else stream_file(final)) as w:
        w.write(npy_header(array.dtype, array.shape))
        w.write(array.reshape(-1).view(np.uint8) if array.size else b"")
    return w.record()
