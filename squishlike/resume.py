"""A killed compress goes on from its last finished block when run again with the same arguments.

Compress writes into a hidden directory beside OUT named for what it makes (`.OUT.partial-KEY`, KEY a hash of the
source's fingerprint and the options), not a random temporary one, so the next run with the same source and
options finds it. After each unit (the tensors outside the blocks, a block, the head) it saves what calibration
needs to go on (`.resume-K.json` and `.resume-K.npz`, K the units done: the next block's input hidden states, the
records so far), then the writer's checkpoint commits the unit's tensors; the state before is then removed. A run
killed between the two finds both states and takes the newest one whose units the checkpoint holds. A run that
fails for any other reason than an interrupt removes the directory: only a kill or Ctrl-C leaves it, and then
only finished units, never half of one. Runs with other arguments remove a stale one."""

from __future__ import annotations

import glob
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FormatError
from .io.atomic import write_json
from .io.fault import fault_point
from .npydir import NpyDirWriter

PREFIX = ".resume-"


def partial_dir(out: Path, key: dict[str, Any]) -> Path:
    """The directory a compress of `key` (source fingerprint, options) into `out` writes into; the stale ones of
    other keys for the same `out` are removed (call with the directory's lock held)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    mine = out.parent / f".{out.name}.partial-{digest}"
    for other in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):
        if other != mine and other.is_dir() and not other.is_symlink():
            shutil.rmtree(other, ignore_errors=True)
    return mine


def save(directory: Path, units_done: int, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Save calibration's state after `units_done` units (before the writer's checkpoint commits them)."""
    npz = directory / f"{PREFIX}{units_done}.npz"
    tmp = npz.with_name(npz.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    tmp.replace(npz)
    write_json(directory / f"{PREFIX}{units_done}.json", state, indent=None)


def forget_before(directory: Path, units_done: int) -> None:
    """Remove the states older than `units_done` (once the checkpoint of `units_done` units is written)."""
    for p in directory.glob(f"{PREFIX}*"):
        stem = p.name.removeprefix(PREFIX).split(".")[0]
        if stem.isdigit() and int(stem) < units_done:
            p.unlink(missing_ok=True)


def latest(directory: Path, units: list[list[str]], written: set[str]) -> tuple[int, dict, dict] | None:
    """(units done, state, arrays) of the newest saved state whose units the writer's checkpoint holds."""
    done = sorted((int(p.name.removeprefix(PREFIX).removesuffix(".json")) for p in directory.glob(f"{PREFIX}*.json")
                   if p.name.removeprefix(PREFIX).removesuffix(".json").isdigit()), reverse=True)
    for k in done:
        if k <= len(units) and all(n in written for unit in units[:k] for n in unit):
            try:
                state = json.loads((directory / f"{PREFIX}{k}.json").read_text())
                with np.load(directory / f"{PREFIX}{k}.npz", allow_pickle=False) as npz:
                    arrays = {name: npz[name] for name in npz.files}
            except (OSError, ValueError):
                continue
            return k, state, arrays
    return None


def clear(directory: Path) -> None:
    """Remove every saved state (the store is complete)."""
    for p in directory.glob(f"{PREFIX}*"):
        p.unlink(missing_ok=True)


def open_writer(tmp: Path, runtime: str, out: Path) -> NpyDirWriter:
    """The writer over `tmp`, compress's directory for `out`: a new one, or the one a killed run left there (with
    its checkpoint's tensors)."""
    if tmp.is_dir():
        try:
            return NpyDirWriter.reopen(tmp, runtime)
        except FormatError:
            shutil.rmtree(tmp)
    tmp.mkdir()
    fault_point(f"mkdtemp:{out.name}")
    return NpyDirWriter(tmp, runtime)


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
