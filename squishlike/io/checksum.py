"""The one checksum squishlike keeps for its files (sha256), the {size, sha256} record of a file, and the check of
files against their records (hashed in parallel: hashlib releases the GIL)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import FormatError, IntegrityError

from .files import open_regular

CHECKSUM = "sha256"
CHUNK = 16 << 20


def file_checksum(path: Path) -> str:
    """The hex checksum of a file's bytes, read in big chunks."""
    h = hashlib.new(CHECKSUM)
    with open_regular(path) as f:
        buf = bytearray(min(CHUNK, max(1, os.fstat(f.fileno()).st_size)))  # zeroing 16 MiB per small file is slow
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_record(path: Path) -> dict:
    """The {size, checksum} record sentinels and manifests keep for every file."""
    return {"size": Path(path).stat().st_size, CHECKSUM: file_checksum(path)}


def file_problem(path: Path, record: dict) -> str | None:
    """What is wrong with `path` against its {size, sha256} record (None: nothing)."""
    try:
        size = os.stat(path).st_size
        if size != record.get("size"):
            return f"size {size}, expected {record.get('size')}"
        if file_checksum(path) != record.get(CHECKSUM):
            return f"{CHECKSUM} differs from the recorded checksum"
    except FileNotFoundError:
        return "missing"
    except FormatError as e:  # not a regular file
        return e.problem
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None


def file_problems(root: Path, files: dict[str, dict]) -> dict[Path, str]:
    """Every recorded file under `root` that is not what its record says, with what is wrong; several hashed at
    once."""
    paths = [Path(root) / rel for rel in files]
    with ThreadPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        found = pool.map(file_problem, paths, files.values())
        return {p: problem for p, problem in zip(paths, found) if problem is not None}


def verify_files(root: Path, files: dict[str, dict]) -> list[str]:
    """Re-read and checksum every recorded file; return one problem line per bad file."""
    return [f"{p}: {problem}" for p, problem in file_problems(root, files).items()]


def check_files(root: Path, files: dict[str, dict]) -> None:
    """Re-read and checksum every recorded file; IntegrityError naming the first bad one."""
    for p, problem in file_problems(root, files).items():
        raise IntegrityError(p, problem)
