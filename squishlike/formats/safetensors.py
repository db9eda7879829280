"""Hugging Face model directories: config.json plus model.safetensors, or shards named by model.safetensors.index.json.

Also the pieces every safetensors-based reader shares (mlx.py builds on HFReader, ollama.py on SafetensorsFile):
opening one file with its header validated, reading one tensor's bytes, and copying the model's side files; and
the one safetensors writer of the project (`write_safetensors`), which streams tensors to disk through io.

Why both libraries: the safetensors library validates a header completely (length, JSON, dtypes, offsets that
overlap, leave gaps, run past the end or disagree with dtype x shape), but its numpy/mlx frameworks go through
NumPy, which has no bfloat16. `mx.load` reads bfloat16 and is lazy (each array preads only its own bytes when
evaluated) but checks little. So a file is validated once by `safe_open`, then read through `mx.load`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Union

import mlx.core as mx
from safetensors import SafetensorError, safe_open

from ..config import CONFIG, SIDE_FILES, read_config
from ..errors import FormatError, MissingTensorError
from ..io.atomic import atomic_file, copy_file, stream_file
from ..io.files import open_regular, read_json, regular_file
from ..io.stream import StreamWriter
from .base import FormatReader, TensorInfo

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SIDE_FILE_PATTERNS = ("*.tiktoken",)

# squishlike's own safetensors files (the cache tiers, the store's packs) start every tensor on a 16 KiB boundary
# (Apple silicon's page size): Metal can then wrap a mapping of the file as the arrays' memory, without a copy.
PAGE_ALIGN = 16 << 10

# safetensors dtype -> the MLX dtype that holds it exactly. Types MLX has no exact home for (F64, F8_*, F4, F6_*)
# are refused: mx.load would hand F8 back as raw uint8 and nobody downstream would know.
DTYPES: dict[str, mx.Dtype] = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F32": mx.float32,
    "C64": mx.complex64,
}


def dtype_name(dtype: mx.Dtype) -> str:
    """"float32", "bfloat16", "uint32" ... (the spelling TensorInfo uses)."""
    return str(dtype).removeprefix("mlx.core.")


# dtype name -> safetensors dtype, for the writer
_ST_NAMES = {dtype_name(dtype): st for st, dtype in DTYPES.items()}


class Tensor(NamedTuple):
    """One tensor to write: `data` is any contiguous buffer of its bytes (a NumPy array, a memory map, an evaluated
    mx.array; bfloat16 may travel as its uint16 bits), or a callable returning one, called when the tensor is
    written and dropped after."""

    name: str
    dtype: str  # dtype name, as dtype_name spells it
    shape: tuple[int, ...]
    data: Any | Callable[[], Any]


def tensor_of(name: str, array: mx.array) -> Tensor:
    """An mx.array as a Tensor (its buffer is read when written, so evaluate it first)."""
    return Tensor(name, dtype_name(array.dtype), tuple(array.shape), array)


class PartAlignment(NamedTuple):
    """Where each tensor of a file starts by its size: one of at least `threshold` bytes on a multiple of `page`,
    a smaller one on a multiple of `small`; the data as a whole starts on a multiple of `page`. For the store's
    packs (npydir/packs.py): the big tensors, nearly all the bytes, can be mapped by Metal, while the small ones
    fill the gaps the big ones' alignment leaves instead of padding each to a page."""

    page: int
    small: int
    threshold: int

    def of(self, nbytes: int) -> int:
        return self.page if nbytes >= self.threshold else self.small


Align = Union[int, PartAlignment]  # one alignment for every tensor, or by size


def _align_of(align: Align, nbytes: int) -> int:
    return align if isinstance(align, int) else align.of(nbytes)


def _start_align(align: Align) -> int:
    return align if isinstance(align, int) else align.page


def layout(tensors: list[Tensor], align: Align = 8) -> dict[str, dict]:
    """The header entries `write_tensors` writes for `tensors`: each tensor's data after the previous one's, at the
    next multiple of `align` (8: packed, as the safetensors format asks; more leaves gaps, see `write_tensors`;
    a PartAlignment: by the tensor's size)."""
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        if dtype not in _ST_NAMES:
            raise ValueError(f"{name}: safetensors cannot hold dtype {dtype}")
        nbytes = math.prod(shape) * DTYPES[_ST_NAMES[dtype]].size
        offset += -offset % _align_of(align, nbytes)
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return header


def header_bytes(header: dict[str, dict], metadata: dict[str, str] | None = None, align: Align = 8) -> bytes:
    """What a file of `header` (a `layout`) starts with: the 8-byte length, then the JSON header, padded with spaces
    so the data starts on a multiple of `align` (the format allows trailing spaces). Its length is where the data
    starts, so the absolute offset of every tensor follows from the tensors alone."""
    blob = json.dumps({"__metadata__": metadata, **header} if metadata else header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % _start_align(align))
    return len(blob).to_bytes(8, "little") + blob


def write_tensors(w: StreamWriter, tensors: list[Tensor], metadata: dict[str, str] | None = None,
                  align: Align = 8) -> None:
    """Write `tensors` in safetensors format to `w`: the header (mx.save_safetensors' fields), then each tensor's
    bytes, streamed from its buffer without an intermediate copy of the model, each starting on a multiple of
    `align` in the file. Above 8 (squishlike's caches: 16 KiB, so Metal can wrap a mapping of the file without a
    copy) the zero gaps between tensors are more than the safetensors library accepts ("invalid offset"); mx.load,
    and with it mlx_lm.load, reads them."""
    header = layout(tensors, align)
    w.write(header_bytes(header, metadata, align))
    written = 0
    for name, dtype, shape, data in tensors:
        buffer = data() if callable(data) else data
        start, end = header[name]["data_offsets"]
        if memoryview(buffer).nbytes != end - start:
            raise ValueError(f"{name}: {memoryview(buffer).nbytes} bytes of data for {dtype}{list(shape)} "
                             f"({end - start} bytes)")
        if start > written:
            w.write(bytes(start - written))
        w.write(buffer)
        written = end
        del buffer


def _unique_names(pairs: list[tuple[str, Any]]) -> dict:
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"a tensor name appears twice: {next(n for n in names if names.count(n) > 1)!r}")
    return dict(pairs)


def check_layout(path: Path, tensors: list[Tensor], root: Path | None = None, align: Align = 8) -> None:
    """The cheap structural check of a file squishlike wrote: its header must be exactly `layout(tensors, align)` (names,
    dtypes, shapes, offsets, in that order: a swapped name or a relabelled dtype is refused) and the file exactly
    as long as that data. Reads the header only. FormatError naming `path` otherwise."""
    with open_regular(path, root) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= length <= size - 8:
            raise FormatError(path, f"header length {length} does not fit in a file of {size} bytes")
        try:
            header = json.loads(f.read(length), object_pairs_hook=_unique_names)
        except (ValueError, RecursionError) as e:
            raise FormatError(path, f"unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(path, "safetensors header is not an object")
    header.pop("__metadata__", None)
    expected = layout(tensors, align)
    if header != expected:
        name = next((n for n in expected if header.get(n) != expected[n]), None) or next(iter(header.keys() - expected))
        raise FormatError(path, f"header entry {name!r} is {header.get(name)}, squishlike wrote {expected.get(name)}")
    data = max((e["data_offsets"][1] for e in expected.values()), default=0)
    if size != 8 + length + data:
        raise FormatError(path, f"is {size} bytes; its header describes {8 + length + data}")
    if (8 + length) % _start_align(align):
        raise FormatError(path, f"its data starts at byte {8 + length}, not on a multiple of {_start_align(align)}")


def write_safetensors(final: Path, tensors: list[Tensor], metadata: dict[str, str] | None = None,
                      atomic: bool = True, align: Align = 8) -> dict:
    """Write one safetensors file and return its file record (size, checksum). Atomic (temp name, fsync, rename)
    unless `atomic=False`: straight to `final`, for a file inside a temp directory published as a whole. `align`:
    see write_tensors."""
    with (atomic_file(final) if atomic else stream_file(final)) as w:
        write_tensors(w, tensors, metadata, align)
    return w.record()


class SafetensorsFile:
    """One .safetensors file: header validated on open, tensors read one at a time and lazily.

    `entries` maps each tensor name to (shape, MLX dtype); `metadata` is the header's `__metadata__`.
    """

    def __init__(self, path: Path):
        self.path = regular_file(path, Path(path).parent)
        try:
            with safe_open(str(self.path), framework="numpy") as f:
                self.metadata: dict[str, str] = f.metadata() or {}
                slices = {name: f.get_slice(name) for name in f.keys()}
                declared = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
        except (SafetensorError, OSError) as e:
            raise FormatError(self.path, f"not a valid safetensors file: {e}") from None
        self.entries: dict[str, tuple[tuple[int, ...], mx.Dtype]] = {}
        for name, (shape, dtype) in declared.items():
            if dtype not in DTYPES:
                raise FormatError(self.path, f"tensor {name!r} has dtype {dtype}, which MLX cannot hold exactly")
            self.entries[name] = (shape, DTYPES[dtype])
        self._pending: dict[str, mx.array] = {}

    def info(self, name: str) -> TensorInfo:
        shape, dtype = self.entries[name]
        return TensorInfo(name, shape, dtype_name(dtype), math.prod(shape) * dtype.size)

    def read(self, name: str) -> mx.array:
        """A lazy array that reads only this tensor's bytes when evaluated.

        mx.load builds a lazy array for every tensor of the file; we hand them out one by one and keep none we
        have handed out, so the reader never pins evaluated weights in memory. A tensor read twice is loaded again.
        """
        if name not in self.entries:
            raise MissingTensorError(self.path, name)
        if name not in self._pending:
            try:
                self._pending = mx.load(str(self.path), format="safetensors")
            except (RuntimeError, ValueError, OSError) as e:
                raise FormatError(self.path, f"cannot read tensors: {e}") from None
        return self._pending.pop(name)

    def close(self) -> None:
        # Unread lazy arrays hold the file open.
        self._pending = {}


def find_weights(directory: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """(weight files, tensor name -> file from model.safetensors.index.json, or None when there is no index).

    Without an index: model.safetensors, else `model*.safetensors` as mlx_lm globs them.
    """
    index = directory / INDEX
    if not os.path.lexists(index):
        single = directory / SINGLE_FILE
        return ([single] if single.is_file() else sorted(directory.glob("model*.safetensors"))), None
    weight_map = read_json(index, directory)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(index, "has no weight_map of tensor name -> shard file")
    shards = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise FormatError(index, f"shard {shard!r} is not a file name in {directory}")
        try:
            exists = (directory / shard).is_file()
        except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte
            exists = False
        if not exists:
            raise FormatError(index, f"names shard {shard!r}, which does not exist")
        shards[shard] = directory / shard
    return list(shards.values()), {name: shards[shard] for name, shard in weight_map.items()}


def copy_side_files(source: Path, dest: Path) -> list[Path]:
    """Copy config.json, tokenizer files, generation config and chat template from `source` into `dest`."""
    names = [n for n in SIDE_FILES if os.path.lexists(source / n)]  # a FIFO or a link out is refused, not skipped
    names += sorted(p.name for pattern in SIDE_FILE_PATTERNS for p in source.glob(pattern))
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        copy_file(source / name, dest / name)
    return [dest / name for name in names]


class HFReader(FormatReader):
    """config.json + model.safetensors (or shards + index), tensors under the names the files spell."""

    format_name = "hf"
    naming = "hf"

    def __init__(self, path: Path):
        super().__init__(path)
        if not (self.path / CONFIG).is_file():
            raise FormatError(self.path, f"no {CONFIG}")
        paths, index = find_weights(self.path)
        if not paths:
            raise FormatError(self.path, f"no {INDEX}, {SINGLE_FILE} or model*.safetensors")
        self._files = {p: SafetensorsFile(p) for p in paths}
        # tensor name -> the file holding it
        self._where: dict[str, SafetensorsFile] = {}
        if index is not None:
            for name, p in index.items():
                if name not in self._files[p].entries:
                    raise FormatError(self.path / INDEX, f"places {name} in {p.name}, which does not hold it")
                self._where[name] = self._files[p]
        else:
            for f in self._files.values():
                for name in f.entries:
                    if name in self._where:
                        raise FormatError(f.path, f"tensor {name} is also in {self._where[name].path.name}")
                    self._where[name] = f

    @classmethod
    def detect(cls, path: Path) -> bool:
        """config.json beside an index or model*.safetensors. Headers are checked on open, so that a damaged file
        is reported by name and problem rather than as "not a model"."""
        path = Path(path)
        return (path / CONFIG).is_file() and ((path / INDEX).is_file() or any(path.glob("model*.safetensors")))

    def config(self) -> dict:
        return read_config(self.path)

    def tensors(self) -> dict[str, TensorInfo]:
        return {name: f.info(name) for name, f in self._where.items()}

    def read(self, name: str) -> mx.array:
        if name not in self._where:
            raise MissingTensorError(self.path, name)
        return self._where[name].read(name)

    def file_of(self, name: str) -> Path:
        return self._where[name].path if name in self._where else self.path

    def write_side_files(self, dest: Path) -> list[Path]:
        return copy_side_files(self.path, Path(dest))

    def close(self) -> None:
        for f in self._files.values():
            f.close()

