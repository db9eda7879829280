"""A store rewritten in format 1 (one .npy per part, docs/format.md §3), for tests of the format-1 reader.

squishlike writes format 2 only, and every reader must keep reading format 1, hostile files included: the
hostile-file cases edit a part's own .npy, which only format 1 has. The rewrite moves each part's bytes, as they
are, out of its pack into its own .npy (written by squishlike's .npy writer) and records them as format 1 does,
so the store holds the same values; the committed fixture (support.fixtures.FORMAT1_STORE) is what the format-1
writer itself wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from squishlike.io.atomic import write_json
from squishlike.io.npy import write_npy_stream
from squishlike.npydir import MANIFEST, NpyDir, part_file


def as_format_1(path: Path) -> Path:
    """Rewrite the format-2 store at `path` in place as format 1; returns `path`."""
    store = NpyDir(path)
    raw = json.loads((path / MANIFEST).read_text())
    for name, entry in store.entries.items():
        raw["tensors"][name]["files"] = {
            suffix: write_npy_stream(path / part_file(entry.key, suffix), np.array(store.load_part(name, suffix)))
            for suffix in entry.kind.suffixes
        }
    for rel in raw.pop("packs"):
        (path / rel).unlink()
    raw["format_version"] = 1
    write_json(path / MANIFEST, raw)
    assert NpyDir(path).version == 1
    return path
