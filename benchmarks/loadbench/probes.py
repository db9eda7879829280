"""What the benchmark's child processes run besides a timed load (that is squishlike/loadtime.py): the startup,
memory and disk floors and a compress. Each prints a JSON report whose `ready_at` the parent times to.

    python -m benchmarks.loadbench.probes startup|floor|disk|compress ARGS
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import threading
import time
from pathlib import Path

from squishlike.loadtime import peak_rss_bytes, rss_now


def read_into(paths: list[str], buffer, threads: int, chunk: int = 64 << 20) -> int:
    """Read the files back to back into `buffer` (None: into small reused buffers), `threads` at a time."""
    jobs, offset = [], 0
    for p in paths:
        size = os.path.getsize(p)
        jobs += [(p, o, min(chunk, size - o), offset + o) for o in range(0, size, chunk)]
        offset += size
    errors: list = []

    def work(i: int) -> None:
        fds: dict = {}
        scratch = None if buffer is not None else memoryview(mmap.mmap(-1, chunk))
        view = memoryview(buffer) if buffer is not None else None
        try:
            for p, o, n, at in jobs[i::threads]:
                fd = fds.get(p)
                if fd is None:
                    fd = fds[p] = os.open(p, os.O_RDONLY)
                dest = view[at:at + n] if view is not None else scratch[:n]
                done = 0
                while done < n:
                    got = os.preadv(fd, [dest[done:]], o + done)
                    if got == 0:
                        raise OSError(f"{p}: short read")
                    done += got
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            for fd in fds.values():
                os.close(fd)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return offset


def startup(path: str) -> dict:
    """The startup floor: what every drop-in for mlx_lm.load does besides reading weights (interpreter, import
    mlx_lm and with it transformers, the tokenizer), so no load can be faster than this process."""
    t0 = time.monotonic()
    rss_start = rss_now()
    import mlx_lm.utils as utils

    t_import = time.monotonic()
    rss_import = rss_now()
    utils.load_tokenizer(Path(path), {})
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "import_s": t_import - t0, "tokenizer_s": t_ready - t_import,
            "rss_start": rss_start, "rss_after_import": rss_import, "rss_peak": peak_rss_bytes()}


def floor(paths: list[str], threads: int, pages: str) -> dict:
    """The memory floor: the files' bytes read into one fresh mapping (huge pages or 4 KiB), `threads` readers."""
    t0 = time.monotonic()
    total = sum(os.path.getsize(p) for p in paths)
    buffer = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        buffer.madvise(mmap.MADV_HUGEPAGE if pages == "huge" else mmap.MADV_NOHUGEPAGE)
    t = time.monotonic()
    read_into(paths, buffer, threads)
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "read_s": t_ready - t, "startup_s": t - t0, "bytes": total,
            "rss_start": 0, "rss_after_import": 0, "rss_peak": peak_rss_bytes()}


def disk(paths: list[str], threads: int) -> dict:
    """The disk floor: evicted files read sequentially into small reused buffers (bandwidth, not memory)."""
    t = time.monotonic()
    total = read_into(paths, None, threads, chunk=16 << 20)
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "read_s": t_ready - t, "bytes": total, "rss_peak": peak_rss_bytes()}


def compress(src: str, out: str, fmt: str, clip: bool) -> dict:
    t0 = time.monotonic()
    rss_start = rss_now()
    import squishlike

    t_import = time.monotonic()
    rss_import = rss_now()
    squishlike.compress(src, out, scheme=fmt, clip_search=clip, force=True)
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "import_s": t_import - t0, "compress_s": t_ready - t_import,
            "rss_start": rss_start, "rss_after_import": rss_import, "rss_peak": peak_rss_bytes()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadbench.probes")
    parser.add_argument("kind", choices=("startup", "floor", "disk", "compress"))
    parser.add_argument("args", nargs="+", help="startup: SOURCE; floor, disk: FILE...; compress: SRC OUT FORMAT")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pages", default="huge", choices=("huge", "4k"))
    parser.add_argument("--clip", action="store_true")
    a = parser.parse_args(argv)
    if a.kind == "startup":
        report = startup(a.args[0])
    elif a.kind == "floor":
        report = floor(a.args, a.threads, a.pages)
    elif a.kind == "disk":
        report = disk(a.args, a.threads)
    else:
        report = compress(a.args[0], a.args[1], a.args[2], a.clip)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
