"""The npy-dir as a FormatReader: an adapter over squishlike/npydir/, which owns the format (canonical names,
values dequantized from the store). What the cache tiers beside the store hold is verified by the tiers
themselves (info.verify_report)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..dtypes import to_mx
from ..npydir import TOKENIZER_FACTS, UNRECORDED, NpyDir, is_npydir
from ..io.atomic import copy_file
from ..io.checksum import check_files, verify_files
from ..io.files import read_json
from .base import FormatReader, QuantizedTensor, TensorInfo


class NpyDirReader(FormatReader):
    """The provider's view of an npy-dir: canonical names, values dequantized from the store."""

    format_name = "npydir"
    naming = "canonical"
    verifies = "checked the checksum of every file of the store and of each ready tier and rank share"

    def __init__(self, path: Path):
        super().__init__(path)
        self.store = NpyDir(path)
        self._checked: set[str] = set()

    def _check(self, records: dict[str, dict]) -> None:
        """Check files against the manifest's records before their data is used, each once per reader, as a load
        checks the whole store: compress or export of a damaged store must fail naming the file, not write the
        damage into an output that looks sound."""
        check_files(self.store.path, {rel: r for rel, r in records.items() if rel not in self._checked})
        self._checked.update(records)

    def _check_tensor(self, name: str) -> None:
        entry = self.store.entry(name)
        self._check({rel: record.to_json() for rel, record in self.store.manifest.files_of(entry).items()})

    @classmethod
    def detect(cls, path: Path) -> bool:
        return Path(path).is_dir() and is_npydir(path)

    def config(self) -> dict:
        return read_json(self.path / "config.json", self.path)

    def tensors(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(
                name=name,
                shape=e.shape,
                dtype=e.scheme if e.kind.quantized else e.stored_dtype,
                nbytes=sum(r.size for r in e.files.values()),
                quantized=e.kind.quantized,
            )
            for name, e in self.store.entries.items()
        }

    def read(self, name: str) -> mx.array:
        self._check_tensor(name)
        return to_mx(self.store.dequantize(name), self.store.runtime_dtype)

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        self._check_tensor(name)
        return self.store.quantized(name)

    def verify(self) -> list[str]:
        """The store's own files; the tiers beside it are checked by info.verify_report."""
        problems = verify_files(self.store.path, self.store.file_records())
        problems += [f"{p}: {UNRECORDED}" for p in self.store.unrecorded_side_files()]
        if TOKENIZER_FACTS in self.store.manifest.side_files:  # its record may be true and its content hostile
            from ..tokenizer import facts_problem  # transformers: imported on use

            problems += [p for p in [facts_problem(self.store.path)] if p is not None]
        return problems

    def write_side_files(self, dest: Path) -> list[Path]:
        Path(dest).mkdir(parents=True, exist_ok=True)
        self._check({rel: record.to_json() for rel, record in self.store.manifest.side_files.items()})
        written = []
        # Not the tokenizer's facts: squishlike's own record of its tokenizer, which a compress works out afresh
        # for what it writes, and which no other format reads (an export never carries a hostile one on).
        for rel in (r for r in self.store.manifest.side_files if r != TOKENIZER_FACTS):
            copy_file(self.path / rel, Path(dest) / rel)
            written.append(Path(dest) / rel)
        return written
