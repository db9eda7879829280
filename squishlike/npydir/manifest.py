"""The npy-dir manifest (`manifest.json`) as typed objects, with strict validation.

`Manifest.from_json` accepts exactly what `to_json` writes (format_version 2: the parts in packs, packs.py) and what
format 1 wrote (one .npy per part), and refuses anything else with a FormatError naming the manifest file, before a reader allocates or opens anything the manifest names. A hostile
manifest therefore cannot name a file outside the directory (keys are checked to decode to their tensor name),
ask for a part no file could hold, or mix a scheme with another scheme's parts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import numpy as np

from ..dtypes import NP_STORAGE
from ..errors import FormatError
from ..io.checksum import CHECKSUM, HASHES
from ..io.files import open_regular
from ..quant.schemes import SCHEMES, Scheme, rows_cols
from .packs import TENSORS, is_pack_name, layout, nbytes, part_name

FORMAT = "squishlike-npy-dir"
FORMAT_VERSION = 2  # what the writer writes: the parts in packs (packs.py)
READABLE_VERSIONS = (1, 2)  # 1: one .npy per part; every version ever written stays readable
MANIFEST = "manifest.json"

_KEY = re.compile(r"[A-Za-z0-9_.%-]+")


def encode_key(name: str) -> str:
    """Percent-encode everything but [A-Za-z0-9_.-]; a leading dot too, so no key is hidden or '..'."""
    key = quote(name, safe="")
    return "%2E" + key[1:] if key.startswith(".") else key


def decode_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or key.startswith("."):
        raise ValueError(f"not a valid tensor key: {key!r}")
    return unquote(key)


def part_file(key: str, suffix: str) -> str:
    """Where a tensor's part lives in a format-1 store, relative to the npy-dir."""
    return f"{TENSORS}/{part_name(key, suffix)}.npy"


# -- field checks: each returns the value or raises TypeError/ValueError saying what is wrong

_KINDS = {int: "an integer", str: "a string", bool: "true or false", dict: "a JSON object"}


def _typed(v: Any, kind: type, what: str) -> Any:
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise TypeError(f"{what} {v!r} is not {_KINDS[kind]}")
    return v


def _size(v: Any, what: str) -> int:
    if _typed(v, int, what) < 0:
        raise ValueError(f"{what} {v!r} is negative")
    return v


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} {v!r} is not a number")
    return v


_FIELD_CHECKS = {"int": _size, "float": _number, "str": lambda v, what: _typed(v, str, what)}


def _dtype(v: Any, what: str) -> str:
    if v not in NP_STORAGE:
        raise ValueError(f"unknown {what} {v!r}")
    return v


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


_R = TypeVar("_R", bound="_Flat")


@cache
def _field_checks(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, check) of each field of a _Flat record, by its annotated type; worked out once per class (a manifest
    holds thousands of records)."""
    return tuple((f.name, _FIELD_CHECKS[f.type]) for f in dataclasses.fields(cls))


class _Flat:
    """A record whose JSON object is its fields, as they are: each checked by its annotated type."""

    @classmethod
    def from_json(cls: type[_R], raw: Any) -> _R:
        raw = _typed(raw, dict, cls.__name__)
        return cls(*(check(raw[name], name) for name, check in _field_checks(cls)))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FileRecord:
    """A file's size and hashes, as manifests and sentinels record it (io/checksum.py names the hashes): SHA-256
    always, XXH3-128 in records written since squishlike added it."""

    size: int
    hashes: dict[str, str]  # hash name -> hex digest

    @classmethod
    def from_json(cls, raw: Any) -> FileRecord:
        raw = _typed(raw, dict, cls.__name__)
        names = [name for name in HASHES if name == CHECKSUM or name in raw]  # a store written before XXH3 lacks it
        return cls(_size(raw["size"], "size"), {name: _typed(raw[name], str, name) for name in names})

    def to_json(self) -> dict:
        return {"size": self.size, **self.hashes}


@dataclass(frozen=True)
class PartRecord(_Flat):
    """Where one part lies in a format-2 store: its pack (relative to the npy-dir), the absolute offset of its data
    in that file, and its exact size. The pack's own record (size, hashes) is the manifest's `packs` entry."""

    pack: str
    offset: int
    size: int


@dataclass(frozen=True)
class ErrorStats(_Flat):
    """The quantization error measured at compress time on evenly sampled rows."""

    rel_error: float
    cosine: float
    sampled_rows: int


@dataclass
class TensorEntry:
    """One tensor of the store: how it is stored, and the files that hold it."""

    key: str  # the filesystem-safe encoding of the tensor's canonical name (encode_key)
    source_name: str  # the tensor's name in the source model
    shape: tuple[int, ...]
    dtype: str  # the source's dtype name (a GGUF/MLX quantization type for quantized sources)
    scheme: str
    reason: str  # why this scheme was chosen
    files: dict[str, FileRecord | PartRecord] = field(default_factory=dict)  # part suffix -> record (format 1:
    # the part's own file; format 2: where it lies in its pack)
    group_size: int | None = None  # group-wise schemes only: the tensor's own, which may differ from the store's
    scale_dtype: str | None = None  # INT4/INT3 only
    stored_dtype: str | None = None  # passthrough only
    error: ErrorStats | None = None  # quantized schemes only

    @property
    def kind(self) -> Scheme:
        return SCHEMES[self.scheme]

    def part_file(self, suffix: str) -> str:
        """The file holding a part: its own .npy (format 1), or its pack (format 2)."""
        record = self.files.get(suffix)
        return record.pack if isinstance(record, PartRecord) else part_file(self.key, suffix)

    def part_name(self, suffix: str) -> str:
        """A part's tensor name in its pack."""
        return part_name(self.key, suffix)

    def part_spec(self, suffix: str) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of one part: what its file must hold."""
        return self.kind.part_spec(self.kind.roles[suffix], self.shape, group_size=self.group_size or 0,
                                   scale_dtype=self.scale_dtype, stored_dtype=self.stored_dtype)

    @classmethod
    def from_json(cls, name: str, raw: Any, version: int = FORMAT_VERSION) -> TensorEntry:
        raw = _typed(raw, dict, "entry")
        record = PartRecord if version >= 2 else FileRecord
        shape = raw["shape"]
        if not isinstance(shape, list):
            raise TypeError(f"shape {shape!r} is not a list")
        for d in shape:
            _size(d, "shape dimension")
        scheme = raw["scheme"]
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}")
        kind = SCHEMES[scheme]
        entry = cls(
            key=_typed(raw["key"], str, "key"),
            source_name=_typed(raw["source_name"], str, "source_name"),
            shape=tuple(shape),
            dtype=_typed(raw["dtype"], str, "dtype"),
            scheme=scheme,
            reason=_typed(raw["reason"], str, "reason"),
            files={suffix: record.from_json(r) for suffix, r in _typed(raw["files"], dict, "files").items()},
            group_size=_size(raw["group_size"], "group_size") if kind.grouped else None,
            scale_dtype=_dtype(raw["scale_dtype"], "scale_dtype") if kind.grouped else None,
            stored_dtype=_dtype(raw["stored_dtype"], "stored_dtype") if not kind.quantized else None,
            error=ErrorStats.from_json(raw["error"]) if "error" in raw else None,
        )
        entry._validate(name)
        return entry

    def _validate(self, name: str) -> None:
        if decode_key(self.key) != name:
            raise ValueError(f"key {self.key!r} does not decode to its name")
        if self.kind.grouped:
            _, cols = rows_cols(self.shape)
            if self.group_size <= 0 or cols % self.group_size:
                raise ValueError(f"group_size {self.group_size} does not divide {cols} columns")
        if set(self.files) != set(self.kind.suffixes):
            raise ValueError("file list does not match its scheme")
        for suffix, record in self.files.items():  # a shape no file could hold is refused before any allocation
            dtype, part_shape = self.part_spec(suffix)
            if record.size < math.prod(part_shape) * dtype.itemsize:
                raise ValueError(f"part {suffix}: {record.size} bytes cannot hold {dtype}{part_shape}")
            if isinstance(record, PartRecord) and record.size != nbytes(dtype, part_shape):  # no header: exact
                raise ValueError(f"part {suffix}: {record.size} bytes, but {dtype}{part_shape} is "
                                 f"{nbytes(dtype, part_shape)}")

    def to_json(self) -> dict:
        return _drop_none({
            "key": self.key,
            "source_name": self.source_name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scheme": self.scheme,
            "reason": self.reason,
            "files": {suffix: r.to_json() for suffix, r in sorted(self.files.items(), key=self._part_order)},
            "group_size": self.group_size,
            "scale_dtype": self.scale_dtype,
            "stored_dtype": self.stored_dtype,
            "error": self.error.to_json() if self.error else None,
        })

    def _part_order(self, item: tuple[str, Any]) -> int:
        """The scheme's order of parts: the order they lie in a pack."""
        return self.kind.suffixes.index(item[0]) if item[0] in self.kind.suffixes else len(self.kind.suffixes)


@dataclass(frozen=True)
class Source(_Flat):
    """The model a store was compressed from: where it was, its format, and a fingerprint of its files."""

    path: str
    format: str
    fingerprint: str


@dataclass(frozen=True)
class Policy:
    """The cache policy: the tiers loads may build and use, and which of them the first load builds: "order",
    only the one this device's tier order takes (docs/format.md §9), or "all" of them."""

    tiers: tuple[str, ...]
    build: str = "order"

    @classmethod
    def from_json(cls, raw: Any) -> Policy:
        tiers = _typed(raw, dict, "policy")["tiers"]
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            raise TypeError(f"policy tiers {tiers!r} is not a list of tier names")
        build = raw.get("build", "order")
        if build not in ("order", "all"):
            raise ValueError(f"policy build {build!r} is neither 'order' nor 'all'")
        return cls(tuple(tiers), build)

    def to_json(self) -> dict:
        return {"tiers": list(self.tiers), "build": self.build}


# What a store's tensor names are (docs/format.md §2): squishlike's canonical names from a family's rule table, or
# mlx_lm's own parameter names (after the model's sanitize) for a family without one.
NAMINGS = ("canonical", "mlx")


@dataclass
class Manifest:
    model_type: str
    runtime_dtype: str
    scheme: str  # the stored scheme of its linears (compress --scheme, with --group-size)
    group_size: int
    clip_search: bool
    source: Source
    policy: Policy
    tensors: dict[str, TensorEntry]  # canonical tensor name -> entry
    side_files: dict[str, FileRecord] = field(default_factory=dict)  # config and tokenizer files, by file name
    int3_gate: dict[str, Any] | None = None  # the INT3 accuracy gate's verdict ("passed", figures, reason)
    extra: dict[str, Any] = field(default_factory=dict)  # calibration records (awq, mixed_precision, ...), as written
    naming: str = "canonical"  # one of NAMINGS; absent in a manifest: "canonical"
    format_version: int = FORMAT_VERSION  # as read; a store written now is FORMAT_VERSION
    packs: dict[str, FileRecord] = field(default_factory=dict)  # format 2: each pack file -> its record

    _FIELDS = ("format", "format_version", "model_type", "naming", "runtime_dtype", "scheme", "group_size",
               "clip_search", "source", "policy", "tensors", "side_files", "int3_gate", "packs")

    @classmethod
    def from_json(cls, raw: Any, path: Path) -> Manifest:
        """The manifest in `raw` (parsed JSON); FormatError naming `path` when it is not a valid one."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise FormatError(path, f"not a {FORMAT} manifest")
        version = raw.get("format_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise FormatError(path, f"unsupported format_version {version!r}; this squishlike reads "
                                    f"{', '.join(map(str, READABLE_VERSIONS))}")
        packs = raw.get("packs", {}) if version >= 2 else {}
        if not isinstance(packs, dict):
            raise FormatError(path, "packs is not a table of pack files")
        for rel in packs:
            if not is_pack_name(rel):
                raise FormatError(path, f"pack {rel!r} is not a pack file name ({TENSORS}/pack-NNNNN.safetensors)")
        if not isinstance(raw.get("runtime_dtype"), str) or raw["runtime_dtype"] not in NP_STORAGE:
            raise FormatError(path, f"unknown runtime_dtype {raw.get('runtime_dtype')!r}")
        if not isinstance(raw.get("tensors"), dict):
            raise FormatError(path, "has no tensor table")
        if raw.get("naming", "canonical") not in NAMINGS:
            raise FormatError(path, f"unknown naming {raw['naming']!r}; a store is named by {' or '.join(NAMINGS)}")
        side = raw.get("side_files", {})
        if not isinstance(side, dict):
            raise FormatError(path, "side_files is not a table of file names")
        for rel in side:
            if Path(rel).name != rel or rel in (".", ".."):
                raise FormatError(path, f"side file {rel!r} is not a plain file name")
        try:
            manifest = cls(
                model_type=_typed(raw["model_type"], str, "model_type"),
                runtime_dtype=raw["runtime_dtype"],
                scheme=_typed(raw["scheme"], str, "scheme"),
                group_size=_size(raw["group_size"], "group_size"),
                clip_search=_typed(raw["clip_search"], bool, "clip_search"),
                source=Source.from_json(raw["source"]),
                policy=Policy.from_json(raw["policy"]),
                tensors={},
                side_files={rel: FileRecord.from_json(r) for rel, r in side.items()},
                int3_gate=_typed(raw["int3_gate"], dict, "int3_gate") if "int3_gate" in raw else None,
                extra={k: v for k, v in raw.items() if k not in cls._FIELDS},
                naming=raw.get("naming", "canonical"),
                format_version=version,
                packs={rel: FileRecord.from_json(r) for rel, r in packs.items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(path, f"bad manifest field ({type(e).__name__}: {e})") from None
        for name, entry in raw["tensors"].items():
            try:
                manifest.tensors[name] = TensorEntry.from_json(name, entry, version)
            except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
                raise FormatError(path, f"tensor {name!r}: bad entry ({e})") from None
        if version >= 2:
            try:
                check_packs(manifest.tensors, manifest.packs)
            except ValueError as e:
                raise FormatError(path, str(e)) from None
        return manifest

    def to_json(self) -> dict:
        return _drop_none({
            **self.extra,
            "format": FORMAT,
            "format_version": self.format_version,
            "model_type": self.model_type,
            "naming": self.naming,
            "runtime_dtype": self.runtime_dtype,
            "scheme": self.scheme,
            "group_size": self.group_size,
            "clip_search": self.clip_search,
            "source": self.source.to_json(),
            "policy": self.policy.to_json(),
            "side_files": {rel: r.to_json() for rel, r in self.side_files.items()},
            "tensors": {name: e.to_json() for name, e in self.tensors.items()},
            "int3_gate": self.int3_gate,
            "packs": {rel: r.to_json() for rel, r in self.packs.items()} if self.format_version >= 2 else None,
        })

    @property
    def schemes(self) -> set[str]:
        return {e.scheme for e in self.tensors.values()}

    def bits_per_weight(self) -> float:
        """The store's real bits per weight (`bits_per_weight` of its entries)."""
        return bits_per_weight(self.tensors.values())

    @property
    def int3_passed(self) -> bool:
        return bool(self.int3_gate and self.int3_gate.get("passed", False))

    def part_files(self) -> dict[str, FileRecord]:
        """Every file that holds parts (format 1: each part's .npy; format 2: the packs), relative to the npy-dir,
        with its record."""
        if self.format_version >= 2:
            return dict(self.packs)
        return {e.part_file(suffix): r for e in self.tensors.values() for suffix, r in e.files.items()}

    def files_of(self, entry: TensorEntry) -> dict[str, FileRecord]:
        """The files that hold `entry`'s parts, relative to the npy-dir, with their records."""
        if self.format_version >= 2:
            return {r.pack: self.packs[r.pack] for r in entry.files.values()}
        return {entry.part_file(suffix): r for suffix, r in entry.files.items()}

    def pack_parts(self) -> dict[str, list[tuple[str, str]]]:
        """Format 2: each pack -> the (tensor name, suffix) of the parts it holds, in the order they lie in it."""
        return _pack_parts(self.tensors)


def bits_per_weight(entries: Iterable[TensorEntry]) -> float:
    """Bits per weight of a store holding `entries` (a manifest's, or a writer's so far), as mlx_lm's
    compute_bits_per_weight counts a model's: the bytes of every stored part (codes, scales and offsets, exact
    tensors) times 8, over the parameters (each tensor's elements, a quantized one's by its dense shape). 0.0 for
    no tensors."""
    entries = list(entries)
    parts = [e.part_spec(suffix) for e in entries for suffix in e.kind.suffixes]
    parameters = sum(math.prod(e.shape) for e in entries)
    return 8 * sum(math.prod(shape) * dtype.itemsize for dtype, shape in parts) / parameters if parameters else 0.0


def _pack_parts(tensors: dict[str, TensorEntry]) -> dict[str, list[tuple[str, str]]]:
    packs: dict[str, list[tuple[str, str]]] = {}
    for name, entry in tensors.items():
        for suffix in entry.kind.suffixes:
            packs.setdefault(entry.files[suffix].pack, []).append((name, suffix))
    # In the order of their offsets: manifest.json lists the tensors by name (write_json sorts keys), not as added
    return {rel: sorted(parts, key=lambda p: tensors[p[0]].files[p[1]].offset) for rel, parts in sorted(packs.items())}


def pack_layout(tensors: dict[str, TensorEntry], parts: list[tuple[str, str]]) -> tuple[dict[str, int], int]:
    """packs.layout of the given parts (tensor name, suffix) of `tensors`."""
    return layout([(tensors[name].part_name(suffix), *tensors[name].part_spec(suffix)) for name, suffix in parts])


def check_packs(tensors: dict[str, TensorEntry], packs: dict[str, FileRecord]) -> None:
    """ValueError unless the parts of `tensors` lie in `packs` exactly as the writer lays them out: every part in a
    listed pack, at the offset the pack's layout gives it (so no two overlap and none runs past the end), each pack
    holding at least one part and of the size that layout gives. A format-2 manifest and a writer's journal are both
    checked so before anything reads a pack."""
    held = _pack_parts(tensors)
    for rel in packs.keys() - held.keys():
        raise ValueError(f"pack {rel!r} holds no part")
    for rel, parts in held.items():
        if rel not in packs:
            raise ValueError(f"tensor {parts[0][0]!r}: part {parts[0][1]} is in {rel!r}, which is not a listed pack")
        offsets, size = pack_layout(tensors, parts)
        for name, suffix in parts:
            recorded, expected = tensors[name].files[suffix].offset, offsets[tensors[name].part_name(suffix)]
            if recorded != expected:
                raise ValueError(f"tensor {name!r}: part {suffix} is recorded at offset {recorded} of {rel}, "
                                 f"which lays it out at {expected}")
        if packs[rel].size != size:
            raise ValueError(f"pack {rel!r} is recorded as {packs[rel].size} bytes; its parts lay out as {size}")


FINGERPRINT_HEAD = 1 << 20  # of each source file, the first bytes hashed whole: every format's header lies there
FINGERPRINT_SAMPLES = 64  # and this many evenly spread blocks of its data
FINGERPRINT_BLOCK = 64 << 10


def source_fingerprint(path: Path) -> str:
    """The identity of a source by content: of each of its files (opened with no link followed), its name, size,
    first FINGERPRINT_HEAD bytes and FINGERPRINT_SAMPLES blocks spread over the rest (a file smaller than that
    whole). Another model whose files have the same names, sizes and mtimes differs in its headers or data; mtimes
    are not part of it (a copy of the same source is the same source). About 5 MiB read per file."""
    path = Path(path)
    root = path.parent if path.is_file() else path
    h = hashlib.sha256()
    for p in sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file()):
        h.update(json.dumps(p.name).encode())
        try:
            with open_regular(p, root) as f:
                h.update(_content_sample(f))
        except (FormatError, OSError) as e:  # a link or a file squishlike never reads: only its name and problem
            h.update(json.dumps(str(e.problem if isinstance(e, FormatError) else e.strerror)).encode())
    return h.hexdigest()


def _content_sample(f) -> bytes:
    """A file's size, its head, and evenly spread blocks of the rest, as one string of bytes."""
    size = os.fstat(f.fileno()).st_size
    spread = size - FINGERPRINT_HEAD
    if spread <= FINGERPRINT_SAMPLES * FINGERPRINT_BLOCK:
        return size.to_bytes(8, "little") + f.read()
    sample = [size.to_bytes(8, "little"), os.pread(f.fileno(), FINGERPRINT_HEAD, 0)]
    for i in range(FINGERPRINT_SAMPLES):
        at = FINGERPRINT_HEAD + i * (spread - FINGERPRINT_BLOCK) // (FINGERPRINT_SAMPLES - 1)
        sample.append(os.pread(f.fileno(), FINGERPRINT_BLOCK, at))
    return b"".join(sample)
