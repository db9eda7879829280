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
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_config

from .. import quant
from ..dtypes import MX_DTYPES, NP_STORAGE, to_mx, to_numpy
from ..errors import FormatError, MissingTensorError
from ..storage import read_json
from .base import FormatReader, QuantizedTensor, TensorInfo

MANIFEST = "manifest.json"
FORMAT = "squishlike-npy-dir"
FORMAT_VERSION = 1
TENSORS = "tensors"

_KEY = re.compile(r"[A-Za-z0-9_.%-]+")


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
        for name, entry in tensors.items():
            try:
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
            except (KeyError, TypeError, ValueError) as e:
                raise FormatError(manifest_path, f"tensor {name!r}: bad entry ({e})") from None

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
        return self.path / TENSORS / f"{self.entry(name)['key']}__{suffix}.npy"

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
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise FormatError(path, f"unreadable .npy ({e})") from None
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
        return array

    def dequantize(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor in the runtime dtype (bf16 as raw uint16), computed by the Rust kernels."""
        entry = self.entry(name)
        dtype = self.runtime_dtype
        scheme = entry["scheme"]
        if scheme == "passthrough":
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
