"""Sentinels: the file that marks a tier ready, written last, recording the size and checksum of every file of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import FormatError
from .atomic import write_json
from .files import read_bytes

SENTINEL_VERSION = 1
ABSENT = "absent"  # read_sentinel's reason when there is no sentinel at all (the tier was never built or was removed)


def write_sentinel(path: Path, *, manifest_fingerprint: str, files: dict[str, dict], **extra: Any) -> None:
    """Mark a tier ready. `files` maps paths relative to the sentinel's directory to {size, sha256, xxh3}."""
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
    sizes and inside the sentinel's directory. Checksums are not re-read here (that is `checksum.verify_files`); sizes are
    cheap.
    """
    if not (path.exists() or path.is_symlink()):
        return None, ABSENT
    try:
        payload = json.loads(read_bytes(path))
    except FormatError as e:  # a FIFO, a device: never opened
        return None, e.problem
    except (ValueError, RecursionError):  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
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
