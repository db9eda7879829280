"""A killed compress goes on from its last finished block when run again with the same arguments.

Compress writes into a hidden directory beside OUT named for what it makes (`.OUT.partial-KEY`, KEY a hash of the
source's fingerprint and the options), not a random temporary one, so the next run with the same source and
options finds it. After each unit (the tensors outside the blocks, a block, the head) it saves what calibration
needs to go on (`.resume-K.json` and `.resume-K.npz`, K the units done: the next block's input hidden states, the
records so far), then the writer's checkpoint commits the unit's tensors in its journal, which records the state's
hashes, every pack's, and the full KEY, sealed by a digest of it all (`seal`); the state before is then removed.

Nothing in the directory is trusted: before anything is reused, a resumed run checks that the directory and
everything in it is a plain directory or regular file (no link, no FIFO), that the journal's seal and KEY are this
run's, that every pack and the saved state hash to what the journal records, and that the state holds what
calibration saves. On any mismatch it says why on stderr and starts over. A run that fails for any other reason
than an interrupt removes the directory: only a kill or Ctrl-C leaves it, and then only finished units, never
half of one. Runs with other arguments remove a stale one. Before the store is published, every file its manifest
does not record is removed (`finish`)."""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import io
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FormatError, JournalError
from .io.atomic import write_bytes, write_json
from .io.checksum import file_problems
from .io.fault import fault_point
from .io.files import open_regular, plain_tree, read_json_object, remove_inside
from .npydir import MANIFEST, TENSORS, Manifest, NpyDirWriter
from .npydir.writer import JOURNAL

PREFIX = ".resume-"


def key_digest(source_fingerprint: str, options: dict[str, Any]) -> str:
    """The hash of what a compress makes: its source's fingerprint and its options."""
    key = {"source": source_fingerprint, "options": options}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def partial_dir(out: Path, key: str) -> Path:
    """The directory a compress of `key` (key_digest) into `out` writes into; the stale ones of other keys for the
    same `out` are removed, a link among them unlinked, never followed (call with the directory's lock held)."""
    mine = out.parent / f".{out.name}.partial-{key[:16]}"
    for other in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):
        if other != mine:
            with contextlib.suppress(OSError):  # one that cannot be removed is left, as before
                remove_inside(other, out.parent)
    return mine


def open_writer(tmp: Path, runtime: str, out: Path, key: str) -> NpyDirWriter:
    """The writer over `tmp`, compress's directory for `out`: a new one, or the one a killed run of the same `key`
    left there (with its checkpoint's tensors), once the directory is found to hold nothing but plain directories
    and regular files and its journal to be sealed for `key` with every pack as it records (NpyDirWriter.reopen).
    Anything else is removed (a link itself, never what it leads to), saying why, and the run starts over."""
    sealed = functools.partial(seal, key)
    if os.path.lexists(tmp):
        try:
            if not stat.S_ISDIR(os.lstat(tmp).st_mode):
                raise JournalError(tmp, "is not a directory (a link?)")
            if (odd := plain_tree(tmp)) is not None:
                raise JournalError(odd, "is not a regular file or directory")
            writer = NpyDirWriter.reopen(tmp, runtime, sealed)
            if writer.tensors:
                return writer
        except JournalError as e:
            print(f"compress: not going on from a killed run: {e}; starting over", file=sys.stderr)
        remove_inside(tmp, out.parent)
    tmp.mkdir()
    fault_point(f"mkdtemp:{out.name}")
    return NpyDirWriter(tmp, runtime, sealed)


def seal(key: str, journal: dict[str, Any]) -> str:
    """The seal of a compress's journal: a digest of everything it records (its packs' and saved state's hashes
    included) and of the compress's `key`, so a journal of another source or options, or one edited in part, is
    not resumed from."""
    return hashlib.sha256(json.dumps([key, journal], sort_keys=True).encode()).hexdigest()


def save(directory: Path, units_done: int, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Save calibration's state after `units_done` units (before the writer's checkpoint commits them); returns
    what the checkpoint records of it: the units done and each state file's hashes."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return {"units": units_done, "state": {
        f"{PREFIX}{units_done}.npz": write_bytes(directory / f"{PREFIX}{units_done}.npz", buffer.getvalue()),
        f"{PREFIX}{units_done}.json": write_json(state_path(directory, units_done), state, indent=None)}}


def state_path(directory: Path, units_done: int) -> Path:
    """The saved state's JSON file after `units_done` units (its arrays: the same name, .npz)."""
    return directory / f"{PREFIX}{units_done}.json"


def forget_before(directory: Path, units_done: int) -> None:
    """Remove the states older than `units_done` (once the checkpoint of `units_done` units is written)."""
    for p in directory.glob(f"{PREFIX}*"):
        stem = p.name.removeprefix(PREFIX).split(".")[0]
        if stem.isdigit() and int(stem) < units_done:
            remove_inside(p, directory)


def latest(writer: NpyDirWriter, units: list[list[str]]) -> tuple[int, dict, dict] | None:
    """(units done, state, arrays) of the state the writer's checkpoint records, once its files hash to what the
    journal records; None, saying why on stderr, when there is none to go on from."""
    directory, found = writer.path, writer.resumed
    try:
        k, records = found["units"], found["state"]
        if not isinstance(k, int) or not 0 < k <= len(units) or \
                any(n not in writer.tensors for unit in units[:k] for n in unit):
            raise JournalError(directory / JOURNAL, f"records {k!r} units done, which its tensors are not")
        if set(records) != {f"{PREFIX}{k}.npz", f"{PREFIX}{k}.json"} or \
                not all(isinstance(r, dict) for r in records.values()):
            raise JournalError(directory / JOURNAL, f"records no saved state of {k} units")
        for path, problem in file_problems(directory, records).items():
            raise JournalError(path, problem)
        state = read_json_object(state_path(directory, k), directory)
        with open_regular(state_path(directory, k).with_suffix(".npz"), directory) as f, \
                np.load(io.BytesIO(f.read()), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (TypeError, KeyError, AttributeError) as e:
        print(f"compress: not going on from {directory}: its journal records no saved state ({e!r}); starting over",
              file=sys.stderr)
        return None
    except (FormatError, ValueError, OSError) as e:  # ValueError: an npz that is no zip
        print(f"compress: not going on from a killed run: {e}; starting over", file=sys.stderr)
        return None
    return k, state, arrays


def clear(directory: Path) -> None:
    """Remove every saved state (the store is complete)."""
    for p in directory.glob(f"{PREFIX}*"):
        remove_inside(p, directory)


def finish(directory: Path, manifest: Manifest) -> None:
    """Remove every file of `directory` its manifest does not record (a saved state, a temporary, anything planted
    in the directory a killed run left), so that only the store is published."""
    recorded = {MANIFEST, TENSORS, *manifest.part_files(), *manifest.side_files}
    for here, dirs, files in os.walk(directory):
        for name in [*dirs, *files]:
            path = Path(here) / name
            if path.relative_to(directory).as_posix() not in recorded:
                remove_inside(path, directory)
        dirs[:] = [d for d in dirs if (Path(here) / d).exists()]


def block_units(names: list[str]) -> list[tuple[str, list[str]]]:
    """`names` (in model order) cut where the block they belong to changes ("layers.3." ...): the units a compress
    without calibration writes, and resumes, by."""
    from .model import BLOCK  # imports mlx_lm

    units: list[tuple[str, list[str]]] = []
    for name in names:
        block = m.group(0).rstrip(".") if (m := BLOCK.match(name)) else "outside the layers"
        if not units or units[-1][0] != block:
            units.append((block, []))
        units[-1][1].append(name)
    return units
