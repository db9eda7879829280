"""Getting weight bytes into MLX's memory fast: huge pages for fresh memory, and reads spread over CPU streams.

Why (docs/design.md §1.2, §2): the floor of a warm load is not the copy from the page cache but the first touch
of fresh memory. `mx.load` preads into buffers that MLX's CPU allocator takes from glibc `malloc`, and glibc
serves every large request with a fresh `mmap` in 4 KiB pages: one page fault per 4 KiB. The same bytes land
several times faster in transparent huge pages, but MLX never asks for them, and `mx.array` cannot wrap memory
we allocate.

So `huge_page_arena(n)` makes glibc's own allocator hand out huge-page memory for a while: it stops `malloc` from
using `mmap` (M_MMAP_MAX=0, so large requests come from the main heap), grows the heap by `n` bytes in one block,
marks that block MADV_HUGEPAGE and frees it again (a small guard allocation right behind it keeps glibc from
trimming it back to the kernel). Every array MLX allocates on the calling thread meanwhile is carved from that
block, and its pages fault in 2 MiB at a time. On exit M_MMAP_MAX is restored and the unused tail of the block
is returned. Nothing here changes any value: it only decides which pages the bytes land in. Where it cannot work
(not Linux/glibc, THP disabled, SQUISHLIKE_HUGEPAGES=0) it does nothing.

It is used only where it pays: where fresh memory in 4 KiB pages, what MLX gets without it, faults in slowly.
Unless SQUISHLIKE_HUGEPAGES says, a process measures that once (`small_pages_slow`, a few milliseconds).

`load_parallel` evaluates lazily loaded arrays (`mx.load` of .safetensors or .npy) spread over one CPU stream per
core, so the preads and page faults of different tensors run side by side instead of one after another.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from pathlib import Path

import mlx.core as mx

from .environment import switch
from .errors import FormatError
from .io.files import open_regular

HUGE_PAGE = 2 << 20
MIN_ARENA = 64 << 20  # below this the page-fault cost is small enough not to bother
_M_MMAP_MAX = -4  # mallopt parameter
_DEFAULT_MMAP_MAX = 65536  # glibc's default for M_MMAP_MAX
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in with one call instead of one trap per page
_GUARD = 4 << 20  # guard allocation: too big for any small-bin chunk, so it is carved right behind the block
_lock = threading.Lock()
log = logging.getLogger("squishlike")


@cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, where the arena can work here: Linux, glibc, THP not disabled, SQUISHLIKE_HUGEPAGES not 0."""
    if not sys.platform.startswith("linux") or switch("SQUISHLIKE_HUGEPAGES") is False:
        return None
    try:
        # glibc's soname on every Linux; ctypes.util.find_library would run `ldconfig -p` (2-25 ms a load)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.gnu_get_libc_version  # glibc only: musl's malloc has no mallopt knobs worth this
    except (OSError, AttributeError):
        return None
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    if "[never]" in mode:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def available() -> bool:
    """Whether huge_page_arena can work here (Linux, glibc, THP not disabled, SQUISHLIKE_HUGEPAGES not 0)."""
    return _glibc() is not None


_SMALL_PROBE = 4 << 20  # 1,024 pages: ~1.5 ms where they are fast
# Bytes per CPU second. The arena paid where 4 KiB pages came at ~0.4 GB/s (docs/design.md §1.2) and cost where
# they came at ~2.8 GB/s (§2.4): faulted in by MLX's own reading threads, they then cost less than the arena.
_SLOW_SMALL = 1.5e9


@cache
def small_pages_slow() -> bool:
    """Whether fresh memory in 4 KiB pages faults in slowly here (below _SLOW_SMALL), measured once per process on
    4 MiB of fresh anonymous memory; False where the arena cannot work."""
    libc = _glibc()
    if libc is None:
        return False
    block = libc.mmap(None, _SMALL_PROBE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      -1, 0)
    if block in (None, ctypes.c_void_p(-1).value):
        return False
    try:
        libc.madvise(block, _SMALL_PROBE, _MADV_NOHUGEPAGE)
        started = time.thread_time()  # CPU time: a thread preempted meanwhile is not slow
        if libc.madvise(block, _SMALL_PROBE, _MADV_POPULATE_WRITE) != 0:
            return False  # an older kernel: no way to tell cheaply, and the arena's own populate fails there too
        speed = _SMALL_PROBE / max(time.thread_time() - started, 1e-9)
    finally:
        libc.munmap(block, _SMALL_PROBE)
    log.debug("fresh 4 KiB pages fault in at %.2f GB per CPU second: the huge-page arena is %s", speed / 1e9,
              "used" if speed < _SLOW_SMALL else "not used")
    return speed < _SLOW_SMALL


def _arena_libc() -> ctypes.CDLL | None:
    """glibc, where the arena can work and is wanted: SQUISHLIKE_HUGEPAGES=1, or unset where small pages are
    slow."""
    libc = _glibc()
    if libc is None or (switch("SQUISHLIKE_HUGEPAGES") is None and not small_pages_slow()):
        return None
    return libc


class _Reservation:
    """`size` bytes of the main heap, malloc'd (so nobody else takes them) and being faulted in by a _Populator,
    possibly on a background thread; a guard allocation right behind keeps the block, once freed, a free chunk
    of the heap (not merged into the top chunk, which glibc trims), so the next allocations are carved from it."""

    def __init__(self, libc, nbytes: int, background: bool):
        self.libc = libc
        self.nbytes = nbytes
        self.size = nbytes + (nbytes >> 6) + 2 * HUGE_PAGE  # headers and alignment of a few hundred arrays, slack
        self.guards: list[int] = []
        self.in_place = False
        self.thread: threading.Thread | None = None
        self.populator: _Populator | None = None
        libc.mallopt(_M_MMAP_MAX, 0)  # from the heap, not a private mmap: what MLX frees later stays reusable
        try:
            self.block = libc.malloc(self.size)
            if self.block:
                chunk = ctypes.c_size_t.from_address(self.block - 8).value & ~7  # glibc's header: size | flags
                for _ in range(8):
                    self.guards.append(libc.malloc(_GUARD))
                    if self.guards[-1] == self.block + chunk:
                        self.in_place = True
                        break
        finally:
            libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        if self.in_place:
            start = (self.block + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
            end = (self.block + self.size) & ~(HUGE_PAGE - 1)
            if end > start:
                libc.madvise(start, end - start, _MADV_HUGEPAGE)
                self.populator = _Populator(libc, start, end)
                if background:  # the thread only calls madvise: it never touches MLX (see loader notes)
                    # one core fewer than a foreground populate: the caller's own work (imports) needs one
                    self.thread = threading.Thread(target=self.populator.run, args=(max(1, _cores() - 1),),
                                                   name="squishlike-populate", daemon=True)
                    self.thread.start()
                else:
                    self.populator.run(_cores())
                    self.populator.record()

    def wait(self) -> None:
        """Until the memory is faulted in; the calling thread takes a share of what is left."""
        if self.thread is not None:
            self.populator.work()
            self.thread.join()
            self.thread = None
            self.populator.record()

    def release(self) -> None:
        """Give everything back (an unused reservation)."""
        if self.populator is not None:
            self.populator.stop()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            self.populator.record()
        if self.block:
            self.libc.free(self.block)
            self.block = 0
        for guard in self.guards:
            if guard:
                self.libc.free(guard)
        self.guards = []


_pending: _Reservation | None = None


def reserve(nbytes: int) -> bool:
    """Start faulting in memory for a coming load of about `nbytes`, on a background thread, so that work runs
    beside whatever the caller does next (imports, the tokenizer). The next huge_page_arena of at most that size
    uses it. Returns whether anything was reserved. Call release() if the load does not happen."""
    global _pending
    if nbytes < MIN_ARENA or (libc := _arena_libc()) is None or not _lock.acquire(blocking=False):
        return False
    try:
        if _pending is not None:
            _pending.release()
        _pending = _Reservation(libc, nbytes, background=True)
        return _pending.in_place
    finally:
        _lock.release()


def reserved() -> bool:
    """Whether a reservation made by reserve() is waiting for its load."""
    return _pending is not None


def release() -> None:
    """Drop a reservation that no load used."""
    global _pending
    with _lock:
        if _pending is not None:
            _pending.release()
            _pending = None


@contextlib.contextmanager
def huge_page_arena(nbytes: int, wait: bool = True) -> Iterator[bool]:
    """While inside, large `malloc`s of this thread (MLX's CPU buffers) come from `nbytes` of memory that is
    already faulted in, in huge pages where the machine gives them fast (see _Populator): the reservation made by
    reserve() when there is one big enough, else one made here.

    `wait=False` (reading from disk, which is slower than faulting memory in): the faulting goes on in the
    background while the caller already reads into the arena; pages it has not reached fault in on first touch.

    Yields whether the arena is in place. Safe to nest (the inner one does nothing) and to use from any thread,
    but only allocations made by the main heap's users benefit; others behave exactly as before.
    """
    global _pending
    if nbytes < MIN_ARENA or (libc := _arena_libc()) is None or not _lock.acquire(blocking=False):
        yield False
        return
    reservation = None
    try:
        reservation, _pending = _pending, None
        if reservation is not None and not nbytes <= reservation.nbytes <= nbytes * 5 // 4:
            reservation.release()  # made for another load: too small, or so big its unused part would stay in RSS
            reservation = None
        if reservation is None:
            reservation = _Reservation(libc, nbytes, background=not wait)
        if wait:
            reservation.wait()
        libc.mallopt(_M_MMAP_MAX, 0)
        if reservation.block:
            libc.free(reservation.block)  # now a free chunk: the allocations below are carved from it, in order
            reservation.block = 0
        yield reservation.in_place
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        if reservation is not None:
            reservation.release()  # the guards: the unused tail merges into the top chunk, which glibc trims
        _lock.release()


_POPULATE_CHUNK = 32 << 20
_SLOW_HUGE = 1.5e9  # bytes per CPU second: huge pages this slow come from memory the hypervisor must back first


def _cores() -> int:
    """Threads worth giving to page faults and reads: one per core, at most 4 (more contend on one mm lock)."""
    return max(1, min(4, os.cpu_count() or 1))


class _Populator:
    """Faults [start, end) in, 32 MiB at a time, on every thread that calls work() (run() starts some), choosing
    the page size chunk by chunk.

    Huge pages are the fast way in (one fault per 2 MiB) where the kernel hands out memory that is really there.
    On a VM with free-page reporting, a free 2 MiB block the host took back costs a host fault per 4 KiB to fault
    in again: slower than 4 KiB pages, which the kernel serves first from small fragments that stayed backed
    (docs/design.md §2.2). So each chunk starts with one huge page as a probe: fast, the rest of the chunk
    follows in huge pages; slow, in 4 KiB pages. One call per chunk (MADV_POPULATE_WRITE), not one fault per
    page.
    Nothing here changes a byte of the memory's contents; it only decides how the pages arrive.
    """

    def __init__(self, libc, start: int, end: int):
        self.libc, self.bytes = libc, end - start
        self.started = self.done_at = time.perf_counter()
        self.chunks = iter([(a, min(_POPULATE_CHUNK, end - a)) for a in range(start, end, _POPULATE_CHUNK)])
        self.state = {"failed": False, "stopped": False, "huge_bytes": 0, "small_bytes": 0}
        self.lock = threading.Lock()

    def work(self) -> None:
        """Take the next chunk until none is left (shared by every thread that calls this)."""
        state, libc = self.state, self.libc
        while True:
            with self.lock:
                chunk = None if state["failed"] or state["stopped"] else next(self.chunks, None)
                if chunk is None:
                    return
            addr, n = chunk
            probe = min(HUGE_PAGE, n)
            t = time.thread_time()  # CPU time, kernel included: a thread preempted by the imports is not slow
            if libc.madvise(addr, probe, _MADV_POPULATE_WRITE) != 0:
                with self.lock:
                    state["failed"] = True  # an older kernel: pages fault in on first touch instead
                return
            huge = probe / max(time.thread_time() - t, 1e-9) >= _SLOW_HUGE
            if not huge:
                libc.madvise(addr + probe, n - probe, _MADV_NOHUGEPAGE)
            libc.madvise(addr + probe, n - probe, _MADV_POPULATE_WRITE)
            with self.lock:
                state["huge_bytes"] += probe + (n - probe if huge else 0)
                state["small_bytes"] += 0 if huge else n - probe
                self.done_at = time.perf_counter()

    def run(self, workers: int) -> None:
        threads = [threading.Thread(target=self.work) for _ in range(workers - 1)]
        for t in threads:
            t.start()
        self.work()
        for t in threads:
            t.join()

    def stop(self) -> None:
        """No more chunks: the memory will not be used (chunks under way finish)."""
        with self.lock:
            self.state["stopped"] = True

    def record(self) -> None:
        """Log (debug) what the arena did; its load_phases field carries the figures."""
        done = dict(self.state, seconds=self.done_at - self.started, bytes=self.bytes)
        log.debug("fast-memory arena: %d bytes faulted in ahead in %.3f s", self.bytes, done["seconds"],
                  extra={"load_phases": {"populate": done}})


_streams = threading.local()  # MLX streams belong to the thread that made them


def cpu_streams() -> tuple[mx.Stream, ...]:
    """One CPU stream per core (at most 4): each runs its own thread, so loads on them run in parallel.

    Made once per thread (a stream of another thread cannot be used here: a server loads each model on its own
    thread) and per process (a forked child must not use streams whose threads stayed behind)."""
    pid = os.getpid()
    if getattr(_streams, "pid", None) != pid:
        count = _cores()
        _streams.pid = pid
        _streams.streams = (mx.default_stream(mx.cpu), *(mx.new_stream(mx.cpu) for _ in range(count - 1)))
    return _streams.streams


def assign_streams(sizes: Mapping[str, int]) -> dict[str, int]:
    """An index into cpu_streams() for each name: walking `sizes` (name -> bytes) in order, each goes to the stream
    with the fewest bytes so far, so the streams finish together."""
    loads = [0] * len(cpu_streams())
    chosen = {}
    for name, nbytes in sizes.items():
        i = loads.index(min(loads))
        chosen[name] = i
        loads[i] += nbytes
    return chosen


def load_parallel(open_lazy: Callable[[mx.Stream], dict[str, mx.array]], order: list[str] | None = None,
                  lazy: bool = False, from_disk: bool = False) -> dict[str, mx.array]:
    """`open_lazy(stream)` returns lazily loaded arrays (e.g. `mx.load(path, stream=stream)`); evaluate them
    spread over the CPU streams, inside a huge-page arena, and return them. `lazy=True` only opens them.

    `order` (the arrays' order in the file): walking it, each array goes to the stream with the fewest bytes so
    far, so the streams advance through the file side by side, which keeps reads from disk sequential."""
    if lazy:
        return open_lazy(mx.default_stream(mx.cpu))
    opened = [open_lazy(s) for s in cpu_streams()]
    first = opened[0]
    if order is None or set(order) != set(first):
        order = list(first)
    sizes = {name: first[name].nbytes for name in order}
    chosen = assign_streams(sizes)
    arrays = [opened[chosen[name]][name] for name in order]
    del opened
    with huge_page_arena(sum(sizes.values()), wait=not from_disk):
        mx.eval(arrays)
    return dict(zip(order, arrays))


def load_each_parallel(open_one: Callable[[str, mx.Stream], mx.array], sizes: Mapping[str, int],
                       lazy: bool = False) -> dict[str, mx.array]:
    """Many files, one array each (`open_one(name, stream)`, e.g. `mx.load(path, stream=stream)`): each opened
    once, on the stream assign_streams gives it by `sizes` (name -> bytes, in read order), and evaluated there,
    spread over the CPU streams, inside a huge-page arena. `lazy=True` only opens them."""
    return load_files_parallel(lambda name, stream: {name: open_one(name, stream)}, sizes, lazy)


def load_files_parallel(open_file: Callable[[str, mx.Stream], dict[str, mx.array]], sizes: Mapping[str, int],
                        lazy: bool = False) -> dict[str, mx.array]:
    """Many files, several arrays each (`open_file(file, stream)`: the lazily loaded arrays wanted from it, by
    name, e.g. from `mx.load(path, stream=stream)`): each file opened once, on the stream assign_streams gives it
    by `sizes` (file -> bytes, in read order), its arrays evaluated there, spread over the CPU streams, inside a
    huge-page arena. Returns the arrays of every file. `lazy=True` only opens them."""
    streams = (mx.default_stream(mx.cpu),) if lazy else cpu_streams()
    chosen = dict.fromkeys(sizes, 0) if lazy else assign_streams(sizes)
    arrays: dict[str, mx.array] = {}
    for file in sizes:
        arrays.update(open_file(file, streams[chosen[file]]))
    if not lazy:
        with huge_page_arena(sum(a.nbytes for a in arrays.values())):
            mx.eval(list(arrays.values()))
    return arrays


def prefetch(paths: list, root: Path | None, sample: int = 16) -> threading.Thread | None:
    """Files not (all) in the page cache: ask the kernel to read them ahead, from a background thread, so the disk
    streams at full speed while the loaders copy. Cached files: nothing to do (probing costs a few preads).

    Of many files (a store's hundreds of parts, written and read together) only `sample` evenly spread ones are
    probed: probing each cost more than loading SmolLM2's 692 cached parts; if any is out, all are advised. Each is
    opened from `root` (the store) with no link followed (files.open_regular)."""
    probed = paths if len(paths) <= sample else [paths[i * len(paths) // sample] for i in range(sample)]
    cold = [p for p in probed if not _cached(p, root)]
    if not cold:
        return None
    cold = cold if len(paths) <= sample else paths

    def advise() -> None:
        for p in cold:
            with contextlib.suppress(OSError, FormatError), open_regular(p, root) as f:  # no link, never a FIFO
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)

    thread = threading.Thread(target=advise, name="squishlike-readahead", daemon=True)
    thread.start()
    return thread


def _cached(path, root: Path | None, probes: int = 8) -> bool:
    """Whether a few evenly spread pages of the file are in the page cache (RWF_NOWAIT reads fail if not)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return True
    try:
        f = open_regular(path, root)  # no link followed below `root`, never a FIFO: it would block
    except (OSError, FormatError):
        return True
    with f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        buffer = bytearray(1)
        for k in range(probes):
            offset = size * k // probes
            try:
                os.preadv(fd, [buffer], offset, flag)
            except BlockingIOError:
                return False
            except OSError:
                return True  # RWF_NOWAIT unsupported here: assume cached, never worse than before
        return True


def load_each(openers: dict[str, tuple[int, Callable[[mx.Stream], mx.array]]], lazy: bool = False,
              batch: int = 256, from_disk: bool = False) -> dict[str, mx.array]:
    """Like load_parallel, for one lazily loaded array per file: `openers[name] = (nbytes, open(stream))`.

    Each file is opened once, on the stream it is assigned to, and evaluated in batches (a lazy array holds its
    file open until evaluated, so a model of thousands of files never needs thousands of descriptors)."""
    if lazy:
        stream = mx.default_stream(mx.cpu)
        return {name: opener(stream) for name, (_, opener) in openers.items()}
    streams = cpu_streams()
    chosen = assign_streams({name: openers[name][0] for name in sorted(openers, key=lambda k: -openers[k][0])})
    out: dict[str, mx.array] = {}
    names = list(openers)
    with huge_page_arena(sum(nbytes for nbytes, _ in openers.values()), wait=not from_disk):
        for start in range(0, len(names), batch):
            part = {n: openers[n][1](streams[chosen[n]]) for n in names[start:start + batch]}
            mx.eval(list(part.values()))
            out.update(part)
    return out
