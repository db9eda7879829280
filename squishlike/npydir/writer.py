"""Writing an npy-dir: the other half of reader.py. What the manifest records of a tensor and the files its parts
are stored in are decided here, and only here; compress (squishlike/compressor.py) decides the values.

The parts go into packs (packs.py, docs/format.md §3): the parts of one block of tensors (a layer; the tensors
before or after the layers) are kept until the block ends, then written as one file. A pack therefore holds only
whole tensors of one block, and a block whose tensors were all added is on disk once the next block starts.

The writer fills a directory that nothing reads yet (compress's temporary directory, which publish_dir fsyncs and
renames as a whole once the store is complete), so no pack gets its own temporary name. The manifest is written
last: a directory without one is no npy-dir (is_npydir).

A long compress can stop halfway (killed, out of memory, a reboot). `checkpoint` makes everything added so far
durable and records it in a journal in the directory; `reopen` continues a writer from its last checkpoint, so a
resumed compress redoes one block at most. The journal is removed when the manifest is written: a published store
never holds one.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..dtypes import MX_DTYPES, NP_STORAGE, to_mx, to_numpy
from ..errors import FormatError, JournalError
from ..formats.safetensors import Tensor, write_safetensors
from ..io.atomic import fsync_dir, write_json
from ..io.checksum import file_problems, file_record
from ..io.files import open_regular, plain_tree, read_json_object, remove_inside
from .manifest import (FORMAT_VERSION, MANIFEST, TENSORS, FileRecord, Manifest, PartRecord, Policy, Source,
                       TensorEntry, check_packs, pack_layout)
from .packs import alignment, block_of, file_order, pack_name

JOURNAL = ".journal.json"  # an unfinished writer's checkpoint (hidden: no reader looks for it)
JOURNAL_VERSION = 1
# A block bigger than this is split over several packs: the writer holds a pack's parts in memory until it is
# written, and a layer of a big mixture of experts can be gigabytes.
PACK_BYTES = 1 << 30


class NpyDirWriter:
    """Writes an npy-dir into `path`: each tensor's parts as they come (add_tensor), the side files' records
    (add_side_files), then the manifest (write_manifest), which may be updated after (record_int3_gate)."""

    def __init__(self, path: str | Path, runtime_dtype: str, seal: Callable[[dict], str] | None = None):
        self.path = Path(path)
        self.runtime_dtype = runtime_dtype
        self.seal = seal  # a digest of a journal, for its checkpoints (resume.seal), or None
        self.resumed: Any = None  # what the journal a writer was reopened from records of its caller (`checkpoint`)
        self.tensors: dict[str, TensorEntry] = {}  # canonical name -> entry, in the order they were added
        self.packs: dict[str, FileRecord] = {}  # each pack written -> its record
        self.side_files: dict[str, FileRecord] = {}
        self.manifest: Manifest | None = None  # once written
        self._pending: list[tuple[str, str, np.ndarray]] = []  # (name, suffix, data) of the pack not written yet
        self._pending_block: str | None = None
        self._pending_bytes = 0
        self._unsynced: list[Path] = []  # packs written since the last checkpoint
        (self.path / TENSORS).mkdir(exist_ok=True)

    def add_tensor(self, name: str, entry: TensorEntry, parts: dict[str, np.ndarray] | None, values: np.ndarray,
                   values_dtype: str) -> TensorEntry:
        """Add one tensor, recorded in `entry`: `parts` (by suffix) for a quantized scheme, or its `values` (of
        dtype `values_dtype`) for a passthrough one. Returns the entry; its `files` say where each part lies once
        its pack is written (when the next block starts, at checkpoint, or with the manifest)."""
        if name in self.tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is added twice")
        if not entry.kind.quantized:
            if entry.dtype not in NP_STORAGE and values_dtype != self.runtime_dtype:
                # Dequantized from a quantized source (a GGUF Q8_0 embedding): its float32 values hold no more than
                # the runtime dtype it is cast to at load, so store that (the same mx rounding, half the bytes).
                values, values_dtype = to_numpy(to_mx(values, values_dtype).astype(MX_DTYPES[self.runtime_dtype]))
            parts = dict(zip(entry.kind.suffixes, [values]))
            entry.stored_dtype = values_dtype
        block = block_of(name)
        if self._pending and (block != self._pending_block or self._pending_bytes >= PACK_BYTES):
            self._write_pack()
        self._pending_block = block
        entry.files = {}
        for suffix in entry.kind.suffixes:
            data = np.asarray(parts[suffix], order="C")  # keeps a 0-d array 0-d, as ascontiguousarray does not
            dtype, shape = entry.part_spec(suffix)
            if data.dtype != dtype or data.shape != tuple(shape):  # the manifest's offsets follow from the spec
                raise ValueError(f"{self.path}: {name} part {suffix} is {data.dtype}{list(data.shape)}; its scheme "
                                 f"stores {dtype}{list(shape)}")
            self._pending.append((name, suffix, data))
            self._pending_bytes += data.nbytes
        self.tensors[name] = entry
        return entry

    def _write_pack(self) -> None:
        """Write the parts added since the last pack as the next pack, and record where each lies."""
        if not self._pending:
            return
        rel = pack_name(len(self.packs))
        pending = [self._pending[i] for i in file_order([data.nbytes for _, _, data in self._pending])]
        tensors = [Tensor(self.tensors[name].part_name(suffix), data.dtype.name, data.shape, data)
                   for name, suffix, data in pending]
        record = write_safetensors(self.path / rel, tensors, atomic=False, align=alignment())
        offsets, _ = pack_layout(self.tensors, [(name, suffix) for name, suffix, _ in pending])
        for (name, suffix, data), tensor in zip(pending, tensors):
            self.tensors[name].files[suffix] = PartRecord(rel, offsets[tensor.name], data.nbytes)
        self.packs[rel] = FileRecord.from_json(record)
        self._unsynced.append(self.path / rel)
        self._pending, self._pending_block, self._pending_bytes = [], None, 0

    def checkpoint(self, resume: Any = None) -> None:
        """Make every tensor added so far durable: its pack written and fsynced, and the journal (atomically
        replaced) recording them and `resume` (what the caller needs to go on: `resumed` after `reopen`), sealed by
        the writer's `seal`, so that `reopen` after a crash continues from here. Compress calls it after each
        block."""
        self._write_pack()
        for path in self._unsynced:
            with open_regular(path, self.path) as f:
                os.fsync(f.fileno())
        if self._unsynced:
            fsync_dir(self.path / TENSORS)
        self._unsynced = []
        journal = {
            "journal_version": JOURNAL_VERSION,
            "format_version": FORMAT_VERSION,
            "runtime_dtype": self.runtime_dtype,
            "packs": {rel: record.to_json() for rel, record in self.packs.items()},
            "tensors": {name: entry.to_json() for name, entry in self.tensors.items()},
            "resume": resume,
        }
        if self.seal is not None:
            journal["seal"] = self.seal(journal)
        write_json(self.path / JOURNAL, journal, indent=None)

    @classmethod
    def reopen(cls, path: str | Path, runtime_dtype: str, seal: Callable[[dict], str] | None = None) -> NpyDirWriter:
        """A writer over the directory an interrupted writer left: it holds exactly the tensors of its last
        checkpoint (`tensors`), every file in `tensors/` written after that checkpoint is deleted, and adding
        continues into the next pack. JournalError naming the journal when there is none, or when it is unreadable,
        not sealed by `seal` (when given), or disagrees with the directory (a link or a FIFO in it, a pack missing,
        of another size or layout, or whose bytes do not hash to its record): the caller starts over."""
        path = Path(path)
        journal = path / JOURNAL
        if (odd := plain_tree(path)) is not None:
            raise JournalError(odd, "is not a regular file or directory: the directory is not a writer's")
        if not os.path.lexists(journal):
            raise JournalError(journal, "is gone: the store was written whole, not published (killed while it was "
                                        "distilled or gated)" if os.path.lexists(path / MANIFEST)
                               else "is missing: the writer never reached a checkpoint")
        try:
            raw = read_json_object(journal, path)
        except FormatError as e:
            raise JournalError(journal, e.problem) from None
        if seal is not None and raw.pop("seal", None) != seal(raw):
            raise JournalError(journal, "is not sealed for this run (another source or options, or edited)")
        if raw.get("journal_version") != JOURNAL_VERSION or raw.get("format_version") != FORMAT_VERSION:
            raise JournalError(journal, f"was written by another version of the writer (journal "
                                        f"{raw.get('journal_version')!r}, format {raw.get('format_version')!r})")
        if raw.get("runtime_dtype") != runtime_dtype:
            raise JournalError(journal, f"records runtime dtype {raw.get('runtime_dtype')!r}, not {runtime_dtype!r}")
        try:
            packs = {rel: FileRecord.from_json(r) for rel, r in raw["packs"].items()}
            tensors = {name: TensorEntry.from_json(name, e) for name, e in raw["tensors"].items()}
            check_packs(tensors, packs)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise JournalError(journal, f"is inconsistent ({type(e).__name__}: {e})") from None
        if list(packs) != [pack_name(i) for i in range(len(packs))]:
            raise JournalError(journal, "does not list the packs in the order they are written")
        # durable at the checkpoint, and hashed then: anything else is a damaged or planted directory
        for pack, problem in file_problems(path, {rel: record.to_json() for rel, record in packs.items()}).items():
            raise JournalError(journal, f"records {pack.relative_to(path)}, which differs: {problem}")
        for child in (path / TENSORS).iterdir():  # the packs (and temps) of the interrupted block
            if f"{TENSORS}/{child.name}" not in packs:
                remove_inside(child, path)
        fsync_dir(path / TENSORS)
        writer = cls(path, runtime_dtype, seal)
        writer.tensors, writer.packs, writer.resumed = tensors, packs, raw.get("resume")
        return writer

    def add_side_files(self, written: list[Path]) -> None:
        """Record the side files (config, tokenizer, ...) written into the directory, by file name."""
        self.side_files.update({p.name: FileRecord.from_json(file_record(p)) for p in written})

    def write_manifest(self, *, model_type: str, naming: str, scheme: str, group_size: int, clip_search: bool,
                       source: Source, policy: Policy, extra: dict[str, Any]) -> Manifest:
        """The manifest of every tensor and side file added, written; returns it. The journal goes: the
        directory is a complete store now, not a writer's work in progress."""
        self._write_pack()
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
            packs=self.packs,
        )
        self._write()
        with contextlib.suppress(FileNotFoundError):
            (self.path / JOURNAL).unlink()
        return self.manifest

    def rewrite_parts(self, values: dict[str, dict[str, np.ndarray]], extra: dict[str, Any]) -> None:
        """Give parts of the written store new values (`values`: tensor -> suffix -> array, of the dtype and shape
        its entry demands, so no part moves) and record `extra` in its manifest: each pack holding one is written
        again whole, through the same path as when it was first written, its untouched parts copied, then the
        manifest with the packs' new records. For a store not published yet (compress's distillation)."""
        if self.manifest is None:
            raise RuntimeError(f"{self.path}: parts are rewritten in a store whose manifest is not written yet")
        for rel, parts in self.manifest.pack_parts().items():
            if not any(suffix in values.get(name, {}) for name, suffix in parts):
                continue
            with open_regular(self.path / rel, self.path) as f:
                raw = f.read()
            tensors = []
            for name, suffix in parts:  # in the order of their offsets: the layout they were written in
                entry = self.tensors[name]
                dtype, shape = entry.part_spec(suffix)
                data = values.get(name, {}).get(suffix)
                if data is None:
                    data = np.frombuffer(raw, dtype, math.prod(shape), entry.files[suffix].offset).reshape(shape)
                elif data.dtype != dtype or data.shape != tuple(shape):
                    raise ValueError(f"{self.path}: {name} part {suffix} is {data.dtype}{list(data.shape)}; its "
                                     f"scheme stores {dtype}{list(shape)}")
                tensors.append(Tensor(entry.part_name(suffix), data.dtype.name, data.shape, data))
            self.packs[rel] = FileRecord.from_json(write_safetensors(self.path / rel, tensors, align=alignment()))
        check_packs(self.tensors, self.packs)  # every part where the manifest records it
        self.manifest.extra.update(extra)
        self._write()

    def record_int3_gate(self, record: dict[str, Any]) -> None:
        """Record the INT3 accuracy gate's verdict in the written manifest (docs/format.md §6.4)."""
        if self.manifest is None:
            raise RuntimeError(f"{self.path}: the INT3 gate is recorded in a manifest not written yet")
        self.manifest.int3_gate = record
        self._write()

    def _write(self) -> None:
        write_json(self.path / MANIFEST, self.manifest.to_json())  # atomic: a reader never sees half of it
