"""StreamWriter: the one writer of squishlike's files, hashed as written, with O_DIRECT where it can."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..environment import switch
from .checksum import Digests
from .fault import fault_point

_DIRECT_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the logical block size
_STREAM_BUFFER = 8 << 20

_spare_buffers: list = []  # bounce buffers of finished writers: page-aligned, already faulted in, reused


def _take_buffer() -> mmap.mmap:
    try:
        return _spare_buffers.pop()  # list.pop is atomic under the GIL
    except IndexError:
        return mmap.mmap(-1, _STREAM_BUFFER)


class StreamWriter:
    """A sequential writer, hashed as it goes (every hash of the file's record) without re-reading the file.

    The hashing runs on a second thread (both hashers release the GIL), so it overlaps the writing. Where the
    filesystem takes it, data goes out with O_DIRECT through two page-aligned bounce buffers, one filling while
    the other is written: no page-cache pages to allocate (fresh pages, page cache included, are the slow part of
    writing big files) and nothing dirty left for the fsync. Anywhere else (tmpfs, no O_DIRECT,
    SQUISHLIKE_DIRECT_IO=0) it falls back to plain buffered writes. Either way the bytes on disk and the record are
    the same. Use it through `atomic.atomic_file`, which adds the temp name, fsync and rename.

    `label` names the fault point passed once the first bytes have reached the file (see `fault`).
    """

    def __init__(self, path: Path, label: str = ""):
        self._label = label
        self._hash = Digests()
        self.size = 0
        self._error: BaseException | None = None
        # Always a new file (a fresh temp name, or a name in a directory being built): a link or a hard link planted
        # at its name is never written through or truncated
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self.direct = hasattr(os, "O_DIRECT") and switch("SQUISHLIKE_DIRECT_IO")
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ELOOP):
                    raise
                self.direct = False  # a filesystem refusing O_DIRECT may have created the file first: ours
                flags = (flags & ~os.O_EXCL) | os.O_TRUNC
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
            self._write_all(mv)
        self.size += n
        return n

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            view = view[os.write(self._fd, view):]
        if self._label:  # crash tests: a fault here leaves a partly written temp file
            label, self._label = self._label, ""
            fault_point(label)

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
            self._write_all(view)
        finally:
            view.release()

    def close(self) -> None:
        """Write what is buffered, wait for the hashes, close the file. Raises what any thread hit."""
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
        """Stop without finishing (the caller removes the file). The hashing thread is told to stop, not waited
        for: a Ctrl-C that lands between a `with self._cond:`'s acquire and its body leaves this thread holding
        the lock (CPython does not promise `__exit__` against such an interrupt), and a hashing thread woken to
        finish would wait for it forever. Seen in CI: a first load interrupted inside a tier write, hung."""
        with contextlib.suppress(BaseException):
            self._stop(wait_for_hashing=False)

    def _stop(self, wait_for_hashing: bool = True) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if wait_for_hashing:
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
        """{size, sha256, xxh3}, as checksum.file_record would compute it from the finished file."""
        return {"size": self.size, **self._hash.hexdigests()}
