"""Sentinels: the file that marks a tier ready, written last, recording the size, checksums and identity of every
file of it.

The identity (device, inode, size, mtime and ctime in nanoseconds) binds a sentinel to the very files it was written
over: a file replaced since (another store's file of the same size copied over it, the store copied elsewhere) has
another identity, and a load hashes it before it trusts it (`moved`, then `Tier.check_files`). One stat per file,
where hashing would read the whole tier.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import FormatError
from .atomic import write_json
from .files import read_bytes

SENTINEL_VERSION = 1
ABSENT = "absent"  # read_sentinel's reason when there is no sentinel at all (the tier was never built or was removed)
IDENTITY = "identity"  # in a sentinel's file record: [st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns]
LINK = "is a symbolic link"  # files squishlike writes are never read through one (docs/format.md §7)


def identity(st: os.stat_result) -> list[int]:
    """What binds a record to one file: which file (device, inode) and its last change (size, mtime; ctime, which
    no one can set back, so a file rewritten in place and given its old mtime still differs)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def write_sentinel(path: Path, *, manifest_fingerprint: str, files: dict[str, dict], **extra: Any) -> None:
    """Mark a tier ready. `files` maps paths relative to the sentinel's directory to {size, sha256, xxh3}; each
    record gets the file's identity as it is now, when its bytes are the ones just hashed."""
    payload = {
        "format_version": SENTINEL_VERSION,
        "manifest_fingerprint": manifest_fingerprint,
        "files": {rel: {**record, IDENTITY: identity(os.lstat(path.parent / rel))} for rel, record in files.items()},
        **extra,
    }
    write_json(path, payload)


def read_sentinel(path: Path, manifest_fingerprint: str) -> tuple[dict | None, str]:
    """(payload, "") for a valid sentinel, else (None, why it does not count).

    Valid means: a regular file (never a link) holding readable JSON of our version, made for this manifest, naming
    regular files inside the sentinel's directory, none of them reached through a link, with the recorded sizes.
    Checksums are not re-read here (that is `checksum.verify_files`); sizes are cheap.
    """
    if not (path.exists() or path.is_symlink()):
        return None, ABSENT
    if path.is_symlink():
        return None, f"{path.name}: {LINK}"
    try:
        payload = json.loads(read_bytes(path, path.parent))  # O_NOFOLLOW: a link swapped in since is refused
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
    root = path.parent
    plain_dirs: set[PurePosixPath] = set()  # directories of the tier already seen not to be links
    for rel, record in files.items():
        if not isinstance(rel, str) or not rel or "\0" in rel or PurePosixPath(rel).is_absolute() or ".." in \
                PurePosixPath(rel).parts:
            return None, f"names a file outside its directory: {rel!r}"
        if not isinstance(record, dict) or not isinstance(record.get("size"), int) or isinstance(
                record.get("size"), bool):
            return None, f"malformed record for {rel}"
        try:
            linked = _linked_dir(root, PurePosixPath(rel).parent, plain_dirs)
            if linked is not None:
                return None, f"{linked}: {LINK}"
            st = os.lstat(root / rel)
        except OSError:  # absent, a name too long
            return None, f"{rel}: missing"
        if stat.S_ISLNK(st.st_mode):
            return None, f"{rel}: {LINK}"
        if not stat.S_ISREG(st.st_mode):
            return None, f"{rel}: missing"
        if st.st_size != record["size"]:
            return None, f"{rel}: size differs from the sentinel"
    return payload, ""


def _linked_dir(root: Path, directory: PurePosixPath, plain: set[PurePosixPath]) -> str | None:
    """The first directory on the way from `root` to `directory` (relative) that is a symbolic link, or None;
    `plain` remembers those already seen not to be, so a tier of many files stats each directory once."""
    parts = directory.parts
    for i in range(1, len(parts) + 1):
        step = PurePosixPath(*parts[:i])
        if step not in plain:
            if os.path.islink(root / step):
                return str(step)
            plain.add(step)
    return None


def moved(path: Path, payload: dict) -> dict[str, tuple[dict, list[int]]]:
    """The files of a valid sentinel (read_sentinel's payload) whose identity is not the one recorded when the
    sentinel was written: rel -> (its record, its identity now). Such a file was replaced, or the tier was copied
    or moved (a new inode), or the sentinel predates identities; only its hash can say whether its bytes are still
    the tier's. A file that cannot be stat'ed counts as moved: the hash check then names it."""
    found = {}
    for rel, record in payload["files"].items():
        try:
            now = identity(os.lstat(path.parent / rel))
        except OSError:
            now = []
        if record.get(IDENTITY) != now:
            found[rel] = (record, now)
    return found


def rebind(path: Path, payload: dict, checked: dict[str, tuple[dict, list[int]]]) -> bool:
    """Record the identities of files whose bytes were just checked against their hashes (`checked`: moved()'s
    answer taken before hashing), so later loads stat them again instead of hashing them. Only where each file is
    still the one that was hashed (same identity now); the caller holds the tier's lock and has re-read the sentinel
    as `payload`. True when the sentinel was rewritten."""
    files = dict(payload["files"])
    for rel, (record, before) in checked.items():
        try:
            if identity(os.lstat(path.parent / rel)) != before or files.get(rel) != record:
                return False  # changed since it was hashed: the next load checks it again
        except OSError:
            return False
        files[rel] = {**record, IDENTITY: before}
    write_json(path, {**payload, "files": files})
    return True


def sentinel_says_damaged(why: str) -> bool:
    """Whether read_sentinel's reason means a valid sentinel over damaged files (missing, wrong size, a link in place
    of a file), as opposed to no sentinel, a stale one, or one that is itself unreadable."""
    return why.endswith((": missing", ": size differs from the sentinel", f": {LINK}"))
