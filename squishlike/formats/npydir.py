"""squishlike's own at-rest format: the npy-dir (SPEC §2).

    OUT/manifest.json     format, version, source, runtime dtype, cache policy, one entry per tensor
    OUT/tensors/{key}__{part}.npy

The manifest is keyed by canonical tensor name; `key` is a reversible, filesystem-safe encoding of that name.
Each scheme stores a fixed set of parts, and every part has a dtype and shape that follow from the tensor's
shape, so a reader can reject a file that does not fit its role before using it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import mlx.core as mx
import numpy as np

from .. import quant
from ..config import load_config
from ..dtypes import MX_DTYPES, NP_STORAGE, to_mx, to_numpy
from ..errors import FormatError, MissingTensorError, UnsupportedArchitectureError
from ..storage import read_json
from .base import FormatReader, QuantizedTensor, TensorInfo

MANIFEST = "manifest.json"
FORMAT = "squishlike-npy-dir"
FORMAT_VERSION = 1
TENSORS = "tensors"

_KEY = re.compile(r"[A-Za-z0-9_.%-]+")
_READ_CHUNK = 1 << 30  # one read() returns at most 2 GiB
# NumPy parses a .npy header with ast.literal_eval, and CPython 3.11 (before 3.11.8) keeps the AST constructor's
# recursion depth in interpreter-wide state: two threads parsing at once fail at random with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905). The cold path opens parts from a thread pool,
# so header parsing takes turns; it is microseconds, the reads and dequantization stay parallel.
_HEADER_LOCK = threading.Lock()


def encode_key(name: str) -> str:
    """Percent-encode everything but [A-Za-z0-9_.-]; a leading dot too, so no key is hidden or '..'."""
    key = quote(name, safe="")
    return "%2E" + key[1:] if key.startswith(".") else key


def decode_key(key: str) -> str:
    if not _KEY.fullmatch(key) or key.startswith("."):
        raise ValueError(f"not a valid tensor key: {key!r}")
    return unquote(key)


@dataclass(frozen=True)
class Part:
    """One file of a scheme: its dtype and shape as functions of the tensor's (rows, cols, group, scale dtype)."""

    suffix: str
    dtype: object  # numpy dtype, or "scale" for the entry's scale dtype, or "stored" for passthrough
    shape: object  # callable (rows, cols, group) -> tuple


def _scale_shape(r: int, c: int, g: int) -> tuple:
    return (r, c // g)


SCHEMES: dict[str, tuple[Part, ...]] = {
    "int8": (Part("q", np.int8, lambda r, c, g: (r, c)), Part("s", np.float32, lambda r, c, g: (r,))),
    "int4": (
        Part("q4", np.uint8, lambda r, c, g: (r, c // 2)),
        Part("s4", "scale", _scale_shape),
        Part("z4", "scale", _scale_shape),
    ),
    "int3": (
        Part("q3", np.uint32, lambda r, c, g: (r, c * 3 // 32)),
        Part("s3", "scale", _scale_shape),
        Part("z3", "scale", _scale_shape),
    ),
    "passthrough": (Part("pt", "stored", None),),
}


def rows_cols(shape: list[int] | tuple[int, ...]) -> tuple[int, int]:
    """Kernels see an N-D weight as [product of leading dims, last dim]."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _is_size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _part_spec(entry: dict, part: Part) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape a part must have, from its manifest entry."""
    rows, cols = rows_cols(entry["shape"])
    if part.dtype == "stored":
        return np.dtype(NP_STORAGE[entry["stored_dtype"]]), tuple(entry["shape"])
    dtype = NP_STORAGE[entry["scale_dtype"]] if part.dtype == "scale" else part.dtype
    return np.dtype(dtype), part.shape(rows, cols, entry.get("group_size", 0))


class NpyDir:
    """An opened npy-dir: its manifest, and typed, validated access to the stored parts."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        raw = manifest_path.read_bytes() if manifest_path.is_file() else None
        if raw is None:
            raise FormatError(manifest_path, "missing: not a squishlike npy-dir")
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        self.manifest = read_json(manifest_path)
        self._validate(manifest_path)

    @staticmethod
    def is_npydir(path: str | Path) -> bool:
        manifest = Path(path) / MANIFEST
        if not manifest.is_file():
            return False
        try:
            return read_json(manifest).get("format") == FORMAT
        except (FormatError, AttributeError):
            return False

    def _validate(self, manifest_path: Path) -> None:
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise FormatError(manifest_path, f"not a {FORMAT} manifest")
        if m.get("format_version") != FORMAT_VERSION:
            raise FormatError(manifest_path, f"unsupported format_version {m.get('format_version')!r}")
        if m.get("runtime_dtype") not in NP_STORAGE:
            raise FormatError(manifest_path, f"unknown runtime_dtype {m.get('runtime_dtype')!r}")
        tensors = m.get("tensors")
        if not isinstance(tensors, dict):
            raise FormatError(manifest_path, "has no tensor table")
        self._validate_side_files(manifest_path)
        for name, entry in tensors.items():
            try:
                if not isinstance(entry, dict):
                    raise TypeError("not a JSON object")
                shape = entry["shape"]
                if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
                    raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
                if entry["scheme"] in ("int4", "int3") and entry["scale_dtype"] not in NP_STORAGE:
                    raise ValueError(f"unknown scale_dtype {entry['scale_dtype']!r}")
                if decode_key(entry["key"]) != name:
                    raise ValueError(f"key {entry['key']!r} does not decode to its name")
                if entry["scheme"] not in SCHEMES:
                    raise ValueError(f"unknown scheme {entry['scheme']!r}")
                if entry["scheme"] in ("int4", "int3"):
                    rows, cols = rows_cols(entry["shape"])
                    if entry["group_size"] <= 0 or cols % entry["group_size"]:
                        raise ValueError(f"group_size {entry['group_size']} does not divide {cols} columns")
                if entry["scheme"] == "passthrough" and entry["stored_dtype"] not in NP_STORAGE:
                    raise ValueError(f"unknown stored_dtype {entry['stored_dtype']!r}")
                if set(entry["files"]) != {p.suffix for p in SCHEMES[entry["scheme"]]}:
                    raise ValueError("file list does not match its scheme")
                for p in SCHEMES[entry["scheme"]]:  # a shape no file could hold is refused before any allocation
                    dtype, part_shape = _part_spec(entry, p)
                    size = entry["files"][p.suffix]["size"]
                    if not _is_size(size) or size < math.prod(part_shape) * np.dtype(dtype).itemsize:
                        raise ValueError(f"part {p.suffix}: {size!r} bytes cannot hold {np.dtype(dtype)}{part_shape}")
            except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
                raise FormatError(manifest_path, f"tensor {name!r}: bad entry ({e})") from None
        from ..arch import architecture_for  # noqa: PLC0415 - the arch tables import lazily

        try:
            arch = architecture_for(m.get("model_type"))
        except UnsupportedArchitectureError as e:
            raise UnsupportedArchitectureError(f"{manifest_path}: {e}") from None
        for name in tensors:
            try:
                arch.mlx_name(name)
            except KeyError:
                raise FormatError(manifest_path, f"tensor {name!r} is not a tensor of {m['model_type']}") from None

    def _validate_side_files(self, manifest_path: Path) -> None:
        """Side files are plain file names inside the directory, never links that lead out of it."""
        side = self.manifest.get("side_files", {})
        if not isinstance(side, dict):
            raise FormatError(manifest_path, "side_files is not a table of file names")
        root = self.path.resolve()
        for rel in [*side, "config.json"]:
            if not isinstance(rel, str) or Path(rel).name != rel or rel in (".", ".."):
                raise FormatError(manifest_path, f"side file {rel!r} is not a plain file name in {self.path}")
            p = self.path / rel
            try:
                if p.is_symlink() and root not in p.resolve().parents:
                    raise FormatError(p, f"is a symbolic link out of {self.path}")
                if p.exists() and not p.is_file():  # a FIFO or a device would block or never end when read
                    raise FormatError(p, "is not a regular file")
            except (OSError, RuntimeError) as e:  # a name too long for the filesystem, a symlink loop
                raise FormatError(manifest_path, f"side file {rel!r}: unusable ({e})") from None

    # -- manifest views

    @property
    def runtime_dtype(self) -> str:
        return self.manifest["runtime_dtype"]

    @property
    def entries(self) -> dict[str, dict]:
        return self.manifest["tensors"]

    def config(self) -> dict:
        """config.json with generation_config's eos merged in, exactly as mlx_lm.utils.load_config reads it."""
        return load_config(self.path)

    def schemes(self) -> set[str]:
        return {e["scheme"] for e in self.entries.values()}

    def entry(self, name: str) -> dict:
        try:
            return self.entries[name]
        except KeyError:
            raise MissingTensorError(self.path / MANIFEST, name) from None

    # -- parts

    def part_path(self, name: str, suffix: str) -> Path:
        path = self.path / TENSORS / f"{self.entry(name)['key']}__{suffix}.npy"
        try:
            if path.is_symlink() or path.parent.is_symlink():  # squishlike writes none: a link can only lead out
                raise FormatError(path, f"is a symbolic link; a stored part must be a file inside {self.path}")
            if path.exists() and not path.is_file():  # a FIFO or a device would block or never end when read
                raise FormatError(path, "is not a regular file")
        except OSError as e:  # a key too long for the filesystem
            raise FormatError(path, f"unusable file name ({e.strerror})") from None
        return path

    def check_part_sizes(self) -> None:
        """Every stored part is a regular file big enough for the data its manifest entry claims: call before
        allocating anything from the manifest's shapes, so a hostile manifest cannot ask for terabytes."""
        for name, entry in self.entries.items():
            for p in SCHEMES[entry["scheme"]]:
                path = self.part_path(name, p.suffix)
                dtype, shape = _part_spec(entry, p)
                try:
                    size = path.stat().st_size if path.is_file() else -1
                except OSError:
                    size = -1
                if size < 0:
                    raise FormatError(path, "missing (or not a regular file)")
                if size < math.prod(shape) * dtype.itemsize:
                    raise FormatError(path, f"is {size} bytes, too small for {dtype}{list(shape)}")

    def part_files(self) -> dict[str, dict]:
        """Every store file, relative to the npy-dir, with its recorded size and checksum."""
        return {
            f"{TENSORS}/{e['key']}__{suffix}.npy": record
            for e in self.entries.values()
            for suffix, record in e["files"].items()
        }

    def load_part(self, name: str, suffix: str) -> np.ndarray:
        """One stored part, memory-mapped, checked against the dtype and shape its role demands."""
        entry = self.entry(name)
        part = next(p for p in SCHEMES[entry["scheme"]] if p.suffix == suffix)
        path = self.part_path(name, suffix)
        try:
            with _HEADER_LOCK:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy's header parser also raises tokenize.TokenError, ...
            raise FormatError(path, f"unreadable .npy ({type(e).__name__}: {e})") from None
        rows, cols = rows_cols(entry["shape"])
        if part.dtype == "stored":
            dtype, shape = NP_STORAGE[entry["stored_dtype"]], tuple(entry["shape"])
        else:
            dtype = NP_STORAGE[entry["scale_dtype"]] if part.dtype == "scale" else part.dtype
            shape = part.shape(rows, cols, entry.get("group_size", 0))
        if array.dtype != np.dtype(dtype) or array.shape != shape:
            raise FormatError(
                path, f"holds {array.dtype}{list(array.shape)}, its role needs {np.dtype(dtype)}{list(shape)}"
            )
        if not array.flags.c_contiguous:
            raise FormatError(path, "is stored in Fortran (column-major) order; squishlike writes C order")
        return array

    def read_part_into(self, name: str, suffix: str, out: np.ndarray) -> None:
        """Read one stored part into `out` (C-contiguous, of the part's dtype and size) with pread, checked as
        load_part checks it. For big passthrough tensors: the bytes land once, in the buffer that keeps them."""
        entry = self.entry(name)
        part = next(p for p in SCHEMES[entry["scheme"]] if p.suffix == suffix)
        path = self.part_path(name, suffix)
        rows, cols = rows_cols(entry["shape"])
        if part.dtype == "stored":
            dtype, shape = np.dtype(NP_STORAGE[entry["stored_dtype"]]), tuple(entry["shape"])
        else:
            dtype = np.dtype(NP_STORAGE[entry["scale_dtype"]] if part.dtype == "scale" else part.dtype)
            shape = part.shape(rows, cols, entry.get("group_size", 0))
        if out.dtype != dtype or out.size != math.prod(shape) or not out.flags.c_contiguous:
            raise ValueError(f"out is {out.dtype}{list(out.shape)}; {name}:{suffix} needs {dtype}{list(shape)}")
        try:
            with open(path, "rb", buffering=0) as f:
                version = np.lib.format.read_magic(f)
                readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
                if version not in readers:
                    raise ValueError(f"npy format version {version} not supported")
                with _HEADER_LOCK:
                    got_shape, fortran, got_dtype = readers[version](f)
                if got_dtype != dtype or tuple(got_shape) != shape or (fortran and len(shape) > 1):
                    raise FormatError(path, f"holds {got_dtype}{list(got_shape)}, its role needs {dtype}{list(shape)}")
                offset, view, done = f.tell(), memoryview(out.reshape(-1).view(np.uint8)), 0
                while done < len(view):
                    n = os.preadv(f.fileno(), [view[done:done + _READ_CHUNK]], offset + done)
                    if n == 0:
                        raise FormatError(path, f"ends after {done} of {len(view)} data bytes")
                    done += n
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 - numpy's header parser also raises tokenize.TokenError, ...
            raise FormatError(path, f"unreadable .npy ({type(e).__name__}: {e})") from None

    def dequantize(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor in the runtime dtype (bf16 as raw uint16), computed by the Rust kernels."""
        entry = self.entry(name)
        dtype = self.runtime_dtype
        scheme = entry["scheme"]
        if scheme == "passthrough":
            if out is not None and entry["stored_dtype"] == dtype and out.flags.c_contiguous:
                # Straight from the file into the caller's buffer: no memory map, no intermediate copy.
                self.read_part_into(name, "pt", out)
                return out
            stored = self.load_part(name, "pt")
            if entry["stored_dtype"] == dtype:
                result = stored
            else:  # exact values at rest, the runtime dtype in memory (like mlx_lm's model.set_dtype)
                result, _ = to_numpy(to_mx(np.ascontiguousarray(stored), entry["stored_dtype"]).astype(MX_DTYPES[dtype]))
            if out is None:
                return np.array(result)
            np.copyto(out.reshape(result.shape), result)
            return out
        rows, cols = rows_cols(entry["shape"])
        if out is not None:
            out = out.reshape(rows, cols)
        parts = [self.load_part(name, p.suffix) for p in SCHEMES[scheme]]
        if scheme == "int8":
            result = quant.dequantize_int8(*parts, out_dtype=dtype, out=out)
        else:
            fn = quant.dequantize_int4 if scheme == "int4" else quant.dequantize_int3
            result = fn(
                *parts, group_size=entry["group_size"], scale_dtype=entry["scale_dtype"], out_dtype=dtype, out=out
            )
        return result.reshape(entry["shape"])

    def quantized(self, name: str) -> QuantizedTensor | None:
        """The MLX triple of an INT4/INT3 tensor: a lossless repack of the store (SPEC §2 invariant)."""
        entry = self.entry(name)
        scheme = entry["scheme"]
        if scheme not in ("int4", "int3"):
            return None
        q, s, z = (self.load_part(name, p.suffix) for p in SCHEMES[scheme])
        words = quant.int4_to_mlx(q) if scheme == "int4" else q
        lead = tuple(entry["shape"][:-1])
        sd = entry["scale_dtype"]
        return QuantizedTensor(
            weight=mx.array(np.ascontiguousarray(words)).reshape(*lead, -1),
            scales=to_mx(np.ascontiguousarray(s), sd).reshape(*lead, -1),
            biases=to_mx(np.ascontiguousarray(z), sd).reshape(*lead, -1),
            group_size=entry["group_size"],
            bits=4 if scheme == "int4" else 3,
        )


class NpyDirReader(FormatReader):
    """The provider's view of an npy-dir: canonical names, values dequantized from the store."""

    format_name = "npydir"
    naming = "canonical"

    def __init__(self, path: Path):
        super().__init__(path)
        self.store = NpyDir(path)

    @classmethod
    def detect(cls, path: Path) -> bool:
        return Path(path).is_dir() and NpyDir.is_npydir(path)

    def config(self) -> dict:
        return read_json(self.path / "config.json")

    def tensors(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(
                name=name,
                shape=tuple(e["shape"]),
                dtype=e["scheme"] if e["scheme"] != "passthrough" else e["stored_dtype"],
                nbytes=sum(r["size"] for r in e["files"].values()),
                quantized=e["scheme"] != "passthrough",
            )
            for name, e in self.store.entries.items()
        }

    def read(self, name: str) -> mx.array:
        return to_mx(self.store.dequantize(name), self.store.runtime_dtype)

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        return self.store.quantized(name)

    def write_side_files(self, dest: Path) -> list[Path]:
        written = []
        for rel in self.store.manifest.get("side_files", {}):
            written.append(Path(shutil.copy2(self.path / rel, Path(dest) / rel)))
        return written
