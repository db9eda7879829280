"""The hashes squishlike records for its files, the record of a file ({size, sha256, xxh3}), and the check of
files against their records (hashed in parallel: hashlib and the Rust hasher release the GIL).

This is the one module that knows the hash names. Every record holds SHA-256 (CHECKSUM; also the digest Ollama
names its blobs by). Records written now also hold XXH3-128 (FAST), computed in the same pass: a first load
checks that one (SHA-256 would cost it more than the dequantization it runs beside), and falls back to SHA-256
for a store written before XXH3 was recorded. `verify` checks every hash a record holds."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rust_quant import Xxh3

from ..errors import FormatError, IntegrityError

from .files import open_regular

CHECKSUM = "sha256"
FAST = "xxh3"  # XXH3-128, 32 hex digits, as xxh128sum prints it
HASHES = (CHECKSUM, FAST)  # what a record written now holds besides the size
CHUNK = 16 << 20


class Digests:
    """Several hashes of one stream of bytes, fed once."""

    def __init__(self, names: Iterable[str] = HASHES):
        self._hashers = {name: Xxh3() if name == FAST else hashlib.new(name) for name in names}

    def update(self, data) -> None:
        """Hash `data`: bytes, a memoryview or a uint8 array."""
        for h in self._hashers.values():
            h.update(data)

    def hexdigests(self) -> dict[str, str]:
        return {name: h.hexdigest() for name, h in self._hashers.items()}


def file_digests(path: Path, names: Iterable[str] = HASHES, root: Path | None = None) -> dict[str, str]:
    """The hex digests `names` of a file's bytes, read once in big chunks; with `root`, the file is opened from it
    with no link followed (files.open_regular)."""
    with open_regular(path, root) as f:
        return _digests(f, names)


def _digests(f, names: Iterable[str]) -> dict[str, str]:
    digests = Digests(names)
    buf = bytearray(min(CHUNK, max(1, os.fstat(f.fileno()).st_size)))  # zeroing 16 MiB per small file is slow
    view = memoryview(buf)
    while n := f.readinto(buf):
        digests.update(view[:n])
    return digests.hexdigests()


def file_checksum(path: Path, root: Path | None = None) -> str:
    """The hex SHA-256 of a file's bytes (opened from `root` with no link followed, when given)."""
    return file_digests(path, (CHECKSUM,), root)[CHECKSUM]


def file_record(path: Path) -> dict:
    """The {size, sha256, xxh3} record sentinels and manifests keep for every file."""
    return {"size": Path(path).stat().st_size, **file_digests(path)}


def hashes_to_check(record: dict, every: bool = False) -> list[str]:
    """The hashes a file is checked against: the fast one when its record holds it, SHA-256 otherwise; with
    `every`, each one the record holds. A record holding none is checked against SHA-256, which then differs."""
    if not every:
        return [FAST if FAST in record else CHECKSUM]
    return [name for name in HASHES if name in record] or [CHECKSUM]


def file_problem(path: Path, record: dict, every: bool = False, root: Path | None = None) -> str | None:
    """What is wrong with `path` against its record (None: nothing); `every`: see hashes_to_check. With `root`, the
    file is opened from it with no link followed, and a link, a FIFO or a device is itself the problem, found
    before a byte is read."""
    try:
        with open_regular(path, root) as f:
            size = os.fstat(f.fileno()).st_size
            if size != record.get("size"):
                return f"size {size}, expected {record.get('size')}"
            names = hashes_to_check(record, every)
            actual = _digests(f, names)
        for name in names:
            if actual[name] != record.get(name):
                return f"{name} differs from the recorded checksum"
    except FormatError as e:  # missing, a link, not a regular file
        return e.problem
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None


def file_problems(root: Path, files: dict[str, dict], every: bool = False, threads: int | None = None) -> dict[Path, str]:
    """Every recorded file under `root` that is not what its record says, with what is wrong (each opened from
    `root` with no link followed); `threads` files at once (default: one per core)."""
    paths = [Path(root) / rel for rel in files]
    with ThreadPoolExecutor(max(1, min(len(paths), threads or os.cpu_count() or 1))) as pool:
        found = pool.map(file_problem, paths, files.values(), [every] * len(paths), [Path(root)] * len(paths))
        return {p: problem for p, problem in zip(paths, found) if problem is not None}


def verify_files(root: Path, files: dict[str, dict]) -> list[str]:
    """Re-read every recorded file and check every hash its record holds; one problem line per bad file."""
    return [f"{p}: {problem}" for p, problem in file_problems(root, files, every=True).items()]


def check_files(root: Path, files: dict[str, dict], every: bool = False) -> None:
    """Re-read every recorded file and check it (the fast hash, or with `every` each one recorded); IntegrityError
    naming the first bad one.

    XXH3 alone runs one file at a time: it outruns the reads, so one thread keeps up and leaves the cores to the
    kernels it runs beside, where two fight over the GIL on a store's many small parts (SmolLM2's 698: 0.065 s on
    one thread, 0.16 s on two). SHA-256 is slower than the reads and hashlib lets go of the GIL, so it takes every
    core. Measured on a 1.2 GB INT4 store's first load, against no check: XXH3 on one thread 0.98-1.16x; SHA-256
    on one thread 2.8x, on every core 1.35-1.41x."""
    fast_only = not every and all(FAST in record for record in files.values())
    for p, problem in file_problems(root, files, every, threads=1 if fast_only else None).items():
        raise IntegrityError(p, problem)
