"""The source fingerprint's cost (issue 44: by content, not names, sizes and mtimes): the content fingerprint
(squishlike.npydir.source_fingerprint: each file's head and 64 spread blocks) against the old one (names, sizes,
mtimes: one stat per file) and against hashing every byte (SHA-256), on the embedded SmolLM2-135M GGUF, page cache
warm, medians of --runs.

    python benchmarks/bench_fingerprint.py --runs 7
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

from squishlike.default_model import default_model_path
from squishlike.io.checksum import file_checksum
from squishlike.npydir import source_fingerprint


def by_stat(path: Path) -> str:
    """The fingerprint before issue 44: names, sizes and mtimes."""
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    return hashlib.sha256(json.dumps([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode()
                          ).hexdigest()


def median_seconds(fn, path: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--source", type=Path, default=None, help="a source file or directory (default: SmolLM2)")
    args = parser.parse_args()
    source = args.source or Path(default_model_path())
    size = sum(p.stat().st_size for p in ([source] if source.is_file() else source.iterdir()) if p.is_file())
    file_checksum(source) if source.is_file() else None  # the page cache warm for all three
    stat_s = median_seconds(by_stat, source, args.runs)
    content_s = median_seconds(source_fingerprint, source, args.runs)
    whole_s = median_seconds(lambda p: [file_checksum(f) for f in ([p] if p.is_file() else p.iterdir())
                                        if f.is_file()], source, args.runs)
    print(f"{source} ({size / 1e6:.1f} MB)")
    print(f"names, sizes, mtimes  {stat_s * 1e3:8.3f} ms")
    print(f"content fingerprint   {content_s * 1e3:8.3f} ms   ({content_s / stat_s:.0f}x the stat one)")
    print(f"SHA-256 of every byte {whole_s * 1e3:8.3f} ms   ({whole_s / content_s:.0f}x the content fingerprint)")


if __name__ == "__main__":
    main()
