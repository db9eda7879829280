"""Writing an npy-dir: the other half of reader.py. What the manifest records of a tensor and the files its parts
are stored in are decided here, and only here; compress (squishlike/compressor.py) decides the values.

The writer fills a directory that nothing reads yet (compress's temporary directory, which publish_dir fsyncs and
renames as a whole once the store is complete), so no file gets its own temporary name or fsync. The manifest is
written last: a directory without one is no npy-dir (is_npydir).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError
from ..dtypes import MX_DTYPES, NP_STORAGE, to_mx, to_numpy
from ..io.atomic import write_json
from ..io.checksum import file_record
from ..io.npy import write_npy_stream
from .manifest import MANIFEST, TENSORS, FileRecord, Manifest, Policy, Source, TensorEntry


JOURNAL = ".journal.jsonl"  # the tensors written so far, in a directory being written (`checkpoint`)


class NpyDirWriter:
    """Writes an npy-dir into `path`: each tensor's parts as they come (add_tensor), the side files' records
    (add_side_files), then the manifest (write_manifest), which may be updated after (record_int3_gate)."""

    def __init__(self, path: str | Path, runtime_dtype: str):
        self.path = Path(path)
        self.runtime_dtype = runtime_dtype
        self.tensors: dict[str, TensorEntry] = {}  # canonical name -> entry, in the order they were added
        self.side_files: dict[str, FileRecord] = {}
        self.manifest: Manifest | None = None  # once written
        self._journaled: set[str] = set()  # the tensors the journal records (checkpoint)
        (self.path / TENSORS).mkdir()

    def add_tensor(self, name: str, entry: TensorEntry, parts: dict[str, np.ndarray] | None, values: np.ndarray,
                   values_dtype: str) -> TensorEntry:
        """Write one tensor's files and record them in `entry`: `parts` (by suffix) for a quantized scheme, or its
        `values` (of dtype `values_dtype`) for a passthrough one. Returns the entry, complete."""
        if not entry.kind.quantized:
            if entry.dtype not in NP_STORAGE and values_dtype != self.runtime_dtype:
                # Dequantized from a quantized source (a GGUF Q8_0 embedding): its float32 values hold no more than
                # the runtime dtype it is cast to at load, so store that (the same mx rounding, half the bytes).
                values, values_dtype = to_numpy(to_mx(values, values_dtype).astype(MX_DTYPES[self.runtime_dtype]))
            parts = dict(zip(entry.kind.suffixes, [values]))
            entry.stored_dtype = values_dtype
        entry.files = {
            suffix: FileRecord.from_json(write_npy_stream(self.path / entry.part_file(suffix), part, atomic=False))
            for suffix, part in parts.items()
        }
        self.tensors[name] = entry
        return entry

    def checkpoint(self) -> None:
        """Record the tensors added since the last checkpoint in the directory's journal: a run killed after this
        point and reopened (`reopen`) keeps them. One line appended per checkpoint; a line cut short by a kill is no
        checkpoint. Not synced, as the parts are not: the directory is synced once, when it is published."""
        new = {n: e.to_json() for n, e in self.tensors.items() if n not in self._journaled}
        with open(self.path / JOURNAL, "ab") as f:
            f.write(json.dumps(new, separators=(",", ":")).encode() + b"\n")
        self._journaled.update(new)

    @classmethod
    def reopen(cls, path: str | Path, runtime_dtype: str) -> NpyDirWriter:
        """A writer over the directory a killed run left: the tensors of its last checkpoint, the files written
        after it deleted. FormatError when there is no journal (the caller starts over)."""
        path = Path(path)
        tensors: dict[str, TensorEntry] = {}
        try:
            lines = (path / JOURNAL).read_bytes().split(b"\n")
        except OSError as e:
            raise FormatError(path / JOURNAL, f"cannot resume from it: {e.strerror}") from None
        for line in lines[:-1]:  # the last piece has no newline: empty, or a line the kill cut short
            try:
                tensors.update({n: TensorEntry.from_json(n, e) for n, e in json.loads(line).items()})
            except (ValueError, TypeError, AttributeError) as e:
                raise FormatError(path / JOURNAL, f"cannot resume from it: {e}") from None
        writer = cls.__new__(cls)
        writer.path, writer.runtime_dtype, writer.tensors = path, runtime_dtype, tensors
        writer.side_files, writer.manifest, writer._journaled = {}, None, set(tensors)
        kept = {e.part_file(suffix) for e in tensors.values() for suffix in e.kind.suffixes}
        for f in (path / TENSORS).iterdir():
            if f"{TENSORS}/{f.name}" not in kept:
                f.unlink()
        return writer

    def add_side_files(self, written: list[Path]) -> None:
        """Record the side files (config, tokenizer, ...) written into the directory, by file name."""
        self.side_files.update({p.name: FileRecord.from_json(file_record(p)) for p in written})

    def write_manifest(self, *, model_type: str, naming: str, scheme: str, group_size: int, clip_search: bool,
                       source: Source, policy: Policy, extra: dict[str, Any]) -> Manifest:
        """The manifest of every tensor and side file added, written; returns it."""
        self.manifest = Manifest(
            model_type=model_type,
            naming=naming,
            runtime_dtype=self.runtime_dtype,
            scheme=scheme,
            group_size=group_size,
            clip_search=clip_search,
            source=source,
            policy=policy,
            tensors=self.tensors,
            side_files=self.side_files,
            extra=dict(extra),
        )
        self._write()
        return self.manifest

    def record_int3_gate(self, record: dict[str, Any]) -> None:
        """Record the INT3 accuracy gate's verdict in the written manifest (docs/format.md §6.4)."""
        if self.manifest is None:
            raise RuntimeError(f"{self.path}: the INT3 gate is recorded in a manifest not written yet")
        self.manifest.int3_gate = record
        self._write()

    def _write(self) -> None:
        write_json(self.path / MANIFEST, self.manifest.to_json())  # atomic: a reader never sees half of it
        (self.path / JOURNAL).unlink(missing_ok=True)  # a published store has no journal
