"""An opened npy-dir: its validated manifest, and typed, checked access to the stored parts.

Every part is checked against the dtype and shape its role demands (`TensorEntry.part_spec`) before it is used,
and every path is checked to stay inside the directory. A format-1 part is its own .npy, whose header says so; a
format-2 part lies in a pack (packs.py) at the offset the manifest records, checked against the pack's layout when
the manifest is read, and the pack's header against that same layout when the pack is first opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
from pathlib import Path
from typing import BinaryIO, Iterator

import mlx.core as mx
import numpy as np

from .. import quant
from ..dtypes import MX_DTYPES, STORED_AS, to_mx, to_numpy
from ..errors import FormatError, IntegrityError, MissingTensorError, UnsupportedArchitectureError
from ..quant.tensor import QuantizedTensor
from ..config import SIDE_FILES, load_config, model_args_defaults
from ..io.checksum import check_files
from ..io.files import open_regular, read_bytes, read_json, regular_file
from ..io.npy import read_npy_header
from ..quant.reference import to_float32
from ..quant.schemes import rows_cols
from .manifest import FORMAT, MANIFEST, FileRecord, Manifest, Source, TensorEntry
from .packs import alignment

TOKENIZER_FACTS = "squishlike_tokenizer.json"  # the tokenizer's facts (squishlike/tokenizer.py), a side file
UNRECORDED = f"not written by squishlike: {MANIFEST} records no such file"  # a side file the manifest lacks

_READ_CHUNK = 1 << 30  # one read() returns at most 2 GiB


def check_finite(path: Path, values: np.ndarray, what: str) -> None:
    """FormatError naming `path` and `what` when `values`, stored scales or offsets (bfloat16 as its uint16 bits),
    hold a NaN or an infinity, which docs/format.md §7 forbids: each would make a whole group of weights NaN or
    infinite. Checked wherever a load has them in memory (a sixteenth of a store's bytes or less, tested by the Rust
    kernel, a big part on every core)."""
    values = np.ascontiguousarray(values)
    if (at := quant.first_non_finite(values, STORED_AS[values.dtype])) is not None:
        raise FormatError(path, f"{what} holds NaN or infinite scales or offsets (value {at} is "
                                f"{to_float32(values.reshape(-1)[at:at + 1], STORED_AS[values.dtype])[0]})")


def is_npydir(path: str | Path, damaged: bool = False) -> bool:
    """Whether `path` holds an npy-dir manifest (checked cheaply: its format field only). With `damaged`, whether
    it has anything named like one, readable or not: what verify checks as an npy-dir, and what the errors of
    prune and of format detection name as one."""
    manifest = Path(path) / MANIFEST
    if damaged:
        return os.path.lexists(manifest)
    try:  # opened from `path` with no link followed: a manifest linked in from elsewhere makes no npy-dir
        return read_json(manifest, path).get("format") == FORMAT
    except (FormatError, AttributeError):
        return False


def read_source(path: str | Path) -> Source | None:
    """The model the npy-dir at `path` was compressed from, or None when `path` has no manifest.

    Reads only the manifest's source record, so it also serves a store that fails full validation."""
    manifest_path = Path(path) / MANIFEST
    if not os.path.lexists(manifest_path):
        return None
    raw = read_json(manifest_path, path)
    try:
        return Source.from_json(raw["source"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(manifest_path, f"bad source record ({type(e).__name__}: {e})") from None


def _pread_into(fd: int, path: Path, view: memoryview, offset: int) -> None:
    """Fill `view` from the file at `offset`; FormatError when the file ends first."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:done + _READ_CHUNK]], offset + done)
        except OSError as e:
            raise FormatError(path, f"unreadable ({e.strerror})") from None
        if n == 0:
            raise FormatError(path, f"ends after {done} of {len(view)} data bytes")
        done += n


class NpyDir:
    """An opened npy-dir. `manifest` is validated; `fingerprint` identifies its exact bytes (for sentinels)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        raw = read_bytes(manifest_path, self.path)
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
            raise FormatError(manifest_path, f"not readable as JSON: {e}") from None
        self.manifest = Manifest.from_json(parsed, manifest_path)
        self._pack_parts = self.manifest.pack_parts() if self.version >= 2 else {}
        self._checked_packs: dict[str, Path] = {}  # format 2: the packs whose header was checked, by name
        self._side_files_checked: bool | None = None  # check_side_files done: with `every` (True) or fast (False)
        self._validate_side_files(manifest_path)
        self._validate_architecture(manifest_path)
        self._validate_dimensions(manifest_path)

    def _validate_side_files(self, manifest_path: Path) -> None:
        """Side files are plain files inside the directory, never links that lead out of it."""
        for rel in [*self.manifest.side_files, "config.json"]:
            try:
                regular_file(self.path / rel, self.path)
            except FormatError as e:
                raise FormatError(e.path, f"{e.problem} (side file of {manifest_path})") from None

    def check_side_files(self, every: bool = False) -> None:
        """IntegrityError naming the first side file (config, generation config, tokenizer files and facts, chat
        template) that is not what the manifest records (its fast hash; with `every`, each hash recorded), or that
        a load would read though the manifest records no such file. Every load runs it, warm or cold: a cache tier
        records nothing of them, and they are small. Done once per opened store (`load` checks them before it
        builds the tokenizer, and the weights' load asks again)."""
        if self._side_files_checked is not None and self._side_files_checked >= every:
            return
        for path in self.unrecorded_side_files():
            raise IntegrityError(path, UNRECORDED)
        check_files(self.path, {rel: r.to_json() for rel, r in self.manifest.side_files.items()}, every)
        self._side_files_checked = every

    def unrecorded_side_files(self) -> list[Path]:
        """The files a load would read as side files (mlx_lm's and transformers' names, the tokenizer facts) that
        the manifest does not record: never written by squishlike, so never read."""
        return [self.path / name for name in (*SIDE_FILES, TOKENIZER_FACTS)
                if name not in self.manifest.side_files and os.path.lexists(self.path / name)]

    def _validate_architecture(self, manifest_path: Path) -> None:
        """Canonical names must be rows of the family's table. mlx_lm's names are checked by the model they bind
        to, when it is built (a name it does not have fails its strict load_weights)."""
        from ..arch import architecture_for  # noqa: PLC0415 - the arch tables import lazily

        if self.manifest.naming == "mlx":
            return
        model_type = self.manifest.model_type
        try:
            arch = architecture_for(model_type)
        except UnsupportedArchitectureError as e:
            raise UnsupportedArchitectureError(f"{manifest_path}: {e}") from None
        for name in self.manifest.tensors:
            try:
                arch.mlx_name(name)
            except KeyError:
                raise FormatError(manifest_path, f"tensor {name!r} is not a tensor of {model_type}") from None

    def _validate_dimensions(self, manifest_path: Path) -> None:
        """No tensor dimension exceeds the sum of every size the config states (nested configs included): a derived
        size (a fused projection, mamba's in_proj) is a sum or small product of them, while a manifest claiming
        terabytes that parts on sparse files would back is refused before anything reads them. The sizes the model
        takes by default count too: config.json need not state them (phixtral's vocabulary)."""
        if not self.entries:
            return
        config = self.config()
        name, entry = max(self.entries.items(), key=lambda item: max(item[1].shape, default=0))
        widest = max(entry.shape, default=0)
        # mlx_lm's ModelArgs (importing mlx_lm.utils) only where the sizes config.json states fall short
        if widest > _config_size_sum(config):
            model_type = self.manifest.model_type
            bound = _config_size_sum({**model_args_defaults(model_type), **config})
            if widest > bound:
                raise FormatError(manifest_path, f"tensor {name!r} has shape {list(entry.shape)}; the sizes in "
                                                 f"{self.path / 'config.json'} and mlx_lm's defaults for "
                                                 f"{model_type} add up to only {bound}")

    # -- manifest views

    @property
    def version(self) -> int:
        """The store's format version (docs/format.md §2): 1, one .npy per part; 2, the parts in packs."""
        return self.manifest.format_version

    @property
    def runtime_dtype(self) -> str:
        return self.manifest.runtime_dtype

    @property
    def entries(self) -> dict[str, TensorEntry]:
        return self.manifest.tensors

    def config(self) -> dict:
        """config.json with generation_config's eos merged in, exactly as mlx_lm.utils.load_config reads it."""
        return load_config(self.path)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise MissingTensorError(self.path / MANIFEST, name) from None

    # -- parts

    def part_path(self, name: str, suffix: str) -> Path:
        """The file that holds one part (format 1: its .npy; format 2: its pack, its header checked): a regular
        file inside the store."""
        entry = self.entry(name)
        if self.version >= 2:
            return self.pack_path(entry.files[suffix].pack)
        return self._stored_file(self.path / entry.part_file(suffix))

    def _stored_file(self, path: Path) -> Path:
        return regular_file(path, self.path)  # squishlike writes no link: one can only lead out

    def pack_path(self, rel: str) -> Path:
        """The path of one pack (format 2), once checked: a regular file inside the store whose safetensors header
        is exactly the layout of the parts the manifest puts in it (names, dtypes, shapes, offsets, in order), and
        exactly as long. FormatError naming the pack otherwise. Checked once per opened store: a header read."""
        checked = self._checked_packs.get(rel)
        if checked is not None:
            return checked
        from ..formats.safetensors import Tensor, check_layout  # noqa: PLC0415 - formats/ imports npydir

        if rel not in self._pack_parts:
            raise FormatError(self.path / MANIFEST, f"records no pack {rel!r}")
        path = self._stored_file(self.path / rel)
        tensors = []
        for name, suffix in self._pack_parts[rel]:
            entry = self.entries[name]
            dtype, shape = entry.part_spec(suffix)
            tensors.append(Tensor(entry.part_name(suffix), dtype.name, tuple(shape), None))
        check_layout(path, tensors, self.path, alignment())
        self._checked_packs[rel] = path
        return path

    @property
    def packs(self) -> dict[str, list[tuple[str, str]]]:
        """Format 2: each pack -> the (tensor name, suffix) of its parts, in file order; {} in format 1."""
        return self._pack_parts

    @contextlib.contextmanager
    def _open_part(self, name: str, suffix: str) -> Iterator[tuple[Path, BinaryIO, int]]:
        """(the file holding one part, open; where the part's data starts in it): its own .npy, whose header must
        say exactly the part's dtype and shape in C order (format 1), or its pack, checked by pack_path, at the
        offset the manifest records (format 2). FormatError naming the file otherwise."""
        entry = self.entry(name)
        path = self.part_path(name, suffix)
        with open_regular(path, self.path) as f:
            if self.version >= 2:
                yield path, f, entry.files[suffix].offset
            else:
                yield path, f, read_npy_header(f, path, *entry.part_spec(suffix))

    def check_part_sizes(self) -> None:
        """Every stored part is a regular file big enough for the data its manifest entry claims: call before
        allocating anything from the manifest's shapes, so a hostile manifest cannot ask for terabytes. Format 2:
        every pack's header and size (pack_path)."""
        for rel in self._pack_parts:
            self.pack_path(rel)
        for name, entry in self.entries.items() if self.version < 2 else ():
            for suffix in entry.kind.suffixes:
                path = self.part_path(name, suffix)
                dtype, shape = entry.part_spec(suffix)
                size = path.stat().st_size
                if size < math.prod(shape) * dtype.itemsize:
                    raise FormatError(path, f"is {size} bytes, too small for {dtype}{list(shape)}")

    def part_files(self) -> dict[str, FileRecord]:
        """Every store file, relative to the npy-dir, with its recorded size and checksum."""
        return self.manifest.part_files()

    def file_records(self) -> dict[str, dict]:
        """Every file the manifest records (parts and side files), relative to the npy-dir: {size, sha256[, xxh3]}."""
        recorded = {**self.part_files(), **self.manifest.side_files}
        return {rel: record.to_json() for rel, record in recorded.items()}

    def checked_part(self, name: str, suffix: str) -> Path:
        """The path of the file holding one stored part, its header and size checked against the dtype, shape and
        order the part's role demands: for a reader that opens the file itself (mx.load)."""
        with self._open_part(name, suffix) as (path, _, _):
            return path

    def load_part(self, name: str, suffix: str) -> np.ndarray:
        """One stored part, memory-mapped, checked against the dtype, shape and order its role demands; scales and
        offsets checked finite."""
        entry = self.entry(name)
        dtype, shape = entry.part_spec(suffix)
        with self._open_part(name, suffix) as (path, f, offset):
            array = np.memmap(f, dtype, "r", offset, shape) if math.prod(shape) else np.empty(shape, dtype)
        self._check_scales(name, suffix, path, array)
        return array

    def _check_scales(self, name: str, suffix: str, path: Path, array: np.ndarray) -> None:
        """check_finite of a quantized tensor's scales or offsets (any part but its codes)."""
        kind = self.entry(name).kind
        if kind.quantized and suffix != kind.suffixes[0]:
            check_finite(path, array, f"part {suffix} of {name}")

    def read_part_into(self, name: str, suffix: str, out: np.ndarray) -> None:
        """Read one stored part into `out` (C-contiguous, of the part's dtype and size) with pread, checked as
        load_part checks it. For big passthrough tensors: the bytes land once, in the buffer that keeps them."""
        dtype, shape = self.entry(name).part_spec(suffix)
        if out.dtype != dtype or out.size != math.prod(shape) or not out.flags.c_contiguous:
            raise ValueError(f"out is {out.dtype}{list(out.shape)}; {name}:{suffix} needs {dtype}{list(shape)}")
        with self._open_part(name, suffix) as (path, f, offset):
            _pread_into(f.fileno(), path, memoryview(out.reshape(-1).view(np.uint8)), offset)
        self._check_scales(name, suffix, path, out)

    def read_part_block(self, name: str, suffix: str, rows: list[tuple[int, int]],
                        cols: tuple[int, int]) -> np.ndarray:
        """Rows `rows` (half-open runs) and columns `cols` of one stored part, seen as the kernels see it
        (`rows_cols`: a 1-D part is one row): only those bytes are copied. Checked as load_part checks it."""
        dtype, shape = self.entry(name).part_spec(suffix)
        n_rows, n_cols = rows_cols(shape)
        (c0, c1), itemsize = cols, dtype.itemsize
        if any(not 0 <= r0 <= r1 <= n_rows for r0, r1 in rows) or not 0 <= c0 <= c1 <= n_cols:
            raise ValueError(f"{name}:{suffix}: block rows {rows} cols {cols} outside [{n_rows}, {n_cols}]")
        out = np.empty((sum(r1 - r0 for r0, r1 in rows), c1 - c0), dtype)
        with self._open_part(name, suffix) as (path, f, offset):
            fd = f.fileno()
            if (c0, c1) == (0, n_cols):  # whole rows: one pread per run of rows
                view, at = memoryview(out.reshape(-1).view(np.uint8)), 0
                for r0, r1 in rows:
                    length = (r1 - r0) * n_cols * itemsize
                    _pread_into(fd, path, view[at:at + length], offset + r0 * n_cols * itemsize)
                    at += length
            else:
                # Part of each row: one strided copy per run of rows out of a memory map, which copies only the
                # needed bytes (the page cache's pages are mapped, not copied). One pread per row (a syscall and a
                # Python step per row) made a column cut 5-10x slower than a row cut of the same size.
                with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:  # its size was checked with the header
                    data, at = np.ndarray((n_rows, n_cols), dtype, mapped, offset), 0
                    for r0, r1 in rows:
                        out[at:at + r1 - r0] = data[r0:r1, c0:c1]
                        at += r1 - r0
                    del data  # the map closes only once no array holds it
        self._check_scales(name, suffix, path, out)
        return out

    def dequantize(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor in the runtime dtype (bf16 as raw uint16), computed by the Rust kernels."""
        entry = self.entry(name)
        dtype = self.runtime_dtype
        if not entry.kind.quantized:
            (suffix,) = entry.kind.suffixes
            if out is not None and entry.stored_dtype == dtype and out.flags.c_contiguous:
                # Straight from the file into the caller's buffer: no memory map, no intermediate copy.
                self.read_part_into(name, suffix, out)
                return out
            result = self.to_runtime(entry, self.load_part(name, suffix))
            if out is None:
                return np.array(result)
            np.copyto(out.reshape(result.shape), result)
            return out
        if out is not None:
            out = out.reshape(rows_cols(entry.shape))
        parts = [self.load_part(name, suffix) for suffix in entry.kind.suffixes]
        result = quant.dequantize(entry.scheme, *parts, group_size=entry.group_size, scale_dtype=entry.scale_dtype,
                                  out_dtype=dtype, out=out)
        return result.reshape(entry.shape)

    def to_runtime(self, entry: TensorEntry, stored: np.ndarray) -> np.ndarray:
        """A passthrough tensor's stored values in the runtime dtype: exact values at rest, the runtime dtype in
        memory (like mlx_lm's model.set_dtype)."""
        if entry.stored_dtype == self.runtime_dtype:
            return stored
        values = to_mx(np.asarray(stored, order="C"), entry.stored_dtype)
        return to_numpy(values.astype(MX_DTYPES[self.runtime_dtype]))[0]

    def quantized(self, name: str) -> QuantizedTensor | None:
        """The MLX triple of an INT4/INT3 tensor: a lossless repack of the store."""
        entry = self.entry(name)
        if not entry.kind.grouped:
            return None
        q, s, z = (self.load_part(name, suffix) for suffix in entry.kind.suffixes)
        words = quant.mlx_words(entry.scheme, q)
        lead = entry.shape[:-1]
        return QuantizedTensor(
            weight=mx.array(np.ascontiguousarray(words)).reshape(*lead, -1),
            scales=to_mx(np.ascontiguousarray(s), entry.scale_dtype).reshape(*lead, -1),
            biases=to_mx(np.ascontiguousarray(z), entry.scale_dtype).reshape(*lead, -1),
            group_size=entry.group_size,
            bits=entry.kind.bits,
        )


def _config_size_sum(config) -> int:
    """The sum of every integer in a config (nested tables and lists included)."""
    if isinstance(config, bool):
        return 0
    if isinstance(config, int):
        return max(config, 0)
    if isinstance(config, dict):
        return sum(_config_size_sum(v) for v in config.values())
    if isinstance(config, list):
        return sum(_config_size_sum(v) for v in config)
    return 0
