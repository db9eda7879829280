"""The one checksum squishlike keeps for its files (sha256), and the {size, sha256} record of a file."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHECKSUM = "sha256"
CHUNK = 16 << 20


def file_checksum(path: Path) -> str:
    """The hex checksum of a file's bytes, read in big chunks."""
    h = hashlib.new(CHECKSUM)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_record(path: Path) -> dict:
    """The {size, checksum} record sentinels and manifests keep for every file."""
    return {"size": Path(path).stat().st_size, CHECKSUM: file_checksum(path)}
