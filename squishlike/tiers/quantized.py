"""The MLX-native quantized tiers (`squish_4bit/`, `squish_3bit/` here; `squish_8bit/` in int8.py): each an
MLX model directory.

Built by a lossless repack of the store: the INT4 nibbles reinterpret as MLX's uint32 words, INT2/3/5/6 and
group-wise INT8 are stored in MLX's own layout already, and scales/offsets are kept in the runtime dtype, so
`mx.dequantize` of this tier equals the cold tier's Rust dequantization bit for bit. Every group-wise tensor is held
at its own width: a mixed store's (docs/format.md §6.3) with the per-layer "quantization" entries mlx_lm.convert
writes for mixed recipes. Tensors stored any other way go in dense. The directory is a complete mlx_lm model
(config.json with "quantization", tokenizer files): `mlx_lm.load` opens it too.

The repack is a byte copy: the store's parts (memory-mapped) and the cold path's dense buffers are streamed into
one safetensors file as they are, checksummed while written.

Because it is only a byte copy, the store itself can serve the same model: `from_store` reads the parts straight
into MLX arrays (the codes viewed as MLX's uint32 words), so a device that takes a quantized tier first (a GPU)
needs no second copy of the weights on disk (order.FROM_STORE).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from ..config import CONFIG
from ..errors import FormatError
from ..formats.safetensors import Tensor, write_safetensors
from ..dtypes import MX_DTYPES
from ..io.atomic import copy_file, make_temp_dir, publish_dir, write_json
from ..io.checksum import check_files
from ..io.files import read_json
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir, check_finite
from ..quant import mlx_words
from ..quant.schemes import SCHEMES
from ..memory import load_each_parallel, load_files_parallel, prefetch
from .base import Loaded, Tier, mlx_names
from .mlx import ALIGN, METADATA, load_safetensors
from .order import from_store_here

WEIGHTS = "model.safetensors"


class _StoredPart(NamedTuple):
    """One stored part as from_store reads it: its file, whose part it is, its NumPy dtype and shape at rest (what
    its header must declare), and the MLX dtype and shape the tier's model takes it as."""

    path: Path  # format 1: the part's .npy; format 2: its pack
    name: str
    suffix: str
    stored: np.dtype
    stored_shape: tuple[int, ...]
    dtype: mx.Dtype
    shape: list[int]


class QuantizedTier(Tier):
    """An MLX model directory; a subclass declares its `directory`, and its files follow from it."""

    scheme: str
    bits: int
    directory: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.paths = (cls.directory,)
        cls.sentinel = f".{cls.directory}_ready"

    def unavailable(self, store: NpyDir) -> str | None:
        """A store of the tier's scheme (its scheme that of the store's linears), or one holding tensors of the
        tier's scheme, has one, holding all its group-wise tensors (at least one) at their widths."""
        schemes = store.manifest.schemes
        if self.scheme not in {*schemes, store.manifest.scheme} or not any(SCHEMES[s].grouped for s in schemes):
            return f"only an {self.scheme} store has one: compress with scheme={self.scheme}"
        return None

    def needs_dense(self, store: NpyDir) -> set[str]:
        """Only the tensors not stored group-wise: the others are repacked from the store's parts."""
        return {name for name, entry in store.entries.items() if not entry.kind.grouped}

    def nbytes(self, store: NpyDir) -> int:
        """The built tier's file (read from the store instead, the plan counts the store's parts: Plan.nbytes)."""
        with contextlib.suppress(OSError):
            return (store.path / self.directory / WEIGHTS).stat().st_size
        return 0

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        root = store.path / self.directory
        config = self.config(store)
        if _canonical(read_json(root / CONFIG, store.path)) != _canonical(config):  # 32.0 is not 32 here
            raise FormatError(root / CONFIG, "is not the config this tier was built with")
        weights = load_safetensors(root / WEIGHTS, self.tensors(store), store.path, lazy=lazy)
        _check_finite(store, mlx_names(store), weights, lambda key: root / WEIGHTS)
        return Loaded(weights, config, self.name)

    def serves_from_store(self, store: NpyDir) -> bool:
        """Whether loads on this device take the tier straight from the store (from_store) rather than from a built
        copy: where the order says so (order.FROM_STORE) and the store's policy asks for the tier without asking
        for every tier it names to be built (policy build "all", compress --tiers)."""
        return from_store_here() and self.wanted(store) and store.manifest.policy.build != "all"

    def from_store(self, store: NpyDir, lazy: bool = False, verify: bool = False) -> Loaded:
        """The tier's weights read from the store's own parts, bit for bit what `load` of the built tier returns,
        with nothing written: the codes are MLX's uint32 words already (a view), scales and biases are stored as
        MLX keeps them; tensors of another scheme are dequantized by the cold path's kernels.

        Checked as a built tier's file is at each load: each part must be a regular file inside the store whose
        header declares the dtype and shape its manifest entry demands, and hold all of its data (a FormatError
        names the first that does not). `verify` first checks every file against every hash the manifest records
        (IntegrityError naming a damaged one), so the values are those compress wrote."""
        if verify:
            check_files(store.path, store.file_records(), every=True)
        names = mlx_names(store)
        parts = self._parts(store, names)  # format 2: each pack's header checked against the manifest here
        if not lazy:
            prefetch(list(dict.fromkeys(part.path for part in parts.values())), store.path)
        try:
            raw = _read_parts(store, parts, lazy)
            wrong = any(tuple(raw[key].shape) != part.stored_shape or raw[key].dtype != _AT_REST[part.stored]
                        for key, part in parts.items())
        except (RuntimeError, ValueError):  # MLX read a header it could not parse, or a file shorter than its data
            wrong = True
        if wrong:  # the strict reader names the part and what is wrong with it
            for part in parts.values():
                store.checked_part(part.name, part.suffix)
            raise FormatError(store.path, "a stored part could not be read")
        _check_finite(store, names, raw, lambda key: parts[key].path)
        runtime = MX_DTYPES[store.runtime_dtype]
        weights = {key: raw[key].view(part.dtype).reshape(part.shape) for key, part in parts.items()}
        weights = {key: a if a.dtype in (mx.uint32, runtime) else a.astype(runtime) for key, a in weights.items()}
        for name, entry in store.entries.items():
            if entry.kind.quantized and not entry.kind.grouped:  # per-row INT8: MLX has no such layer
                weights[names[name]] = mx.array(store.dequantize(name)).view(runtime)
        return Loaded(weights, self.config(store), self.name)

    def _parts(self, store: NpyDir, names: dict[str, str]) -> dict[str, _StoredPart]:
        """mlx_lm parameter name -> the part read as it, for each part of a group-wise tensor and each tensor stored
        exactly (`names`: canonical name -> mlx_lm name)."""
        parts = {}
        for name, entry in store.entries.items():
            if not entry.kind.quantized:
                read_as = {entry.kind.suffixes[0]: (MX_DTYPES[entry.stored_dtype], list(entry.shape))}
                keys = (names[name],)
            elif entry.kind.grouped:
                lead, cols = list(entry.shape[:-1]), entry.shape[-1]
                scales = (MX_DTYPES[entry.scale_dtype], [*lead, cols // entry.group_size])
                codes = (mx.uint32, [*lead, entry.kind.uint32_cols(cols)])
                read_as = dict(zip(entry.kind.suffixes, (codes, scales, scales)))
                prefix = names[name].removesuffix(".weight")
                keys = (f"{prefix}.weight", f"{prefix}.scales", f"{prefix}.biases")
            else:
                continue
            for key, (suffix, (dtype, shape)) in zip(keys, read_as.items()):
                stored, stored_shape = entry.part_spec(suffix)
                parts[key] = _StoredPart(store.part_path(name, suffix), name, suffix, stored, tuple(stored_shape),
                                         dtype, shape)
        return parts

    def config(self, store: NpyDir) -> dict:
        """The tier's config.json: the store's, with the quantization its file holds. The top level names the
        tier's width and the smallest group size of its tensors at that width; each layer at another width or
        group size gets its own entry, keyed by module path, as mlx_lm.convert writes a mixed recipe (mlx_lm
        infers a layer's group size and width from its arrays' shapes too, but only where the config names
        none)."""
        grouped = [e for e in store.entries.values() if e.kind.grouped]
        group_size = min(e.group_size for e in [e for e in grouped if e.scheme == self.scheme] or grouped)
        config = store.config()
        quantization = {"group_size": group_size, "bits": self.bits, "mode": "affine"}
        for name, mlx_name in mlx_names(store).items():
            entry = store.entries[name]
            if entry.kind.grouped and (entry.kind.bits, entry.group_size) != (self.bits, group_size):
                module = mlx_name.removesuffix(".weight")
                quantization[module] = {"group_size": entry.group_size, "bits": entry.kind.bits, "mode": "affine"}
        config["quantization"] = config["quantization_config"] = quantization
        return config

    def tensors(self, store: NpyDir, dense: dict[str, np.ndarray] | None = None) -> list[Tensor]:
        """What the tier's file holds, in order; with `dense`, the data to write. Each part is memory-mapped only
        while it is written (a callable, opened by write_safetensors): zero-copy views of the store's bytes, never
        all mapped (and counted in RSS) at once."""
        names = mlx_names(store)
        tensors = []
        for name, entry in store.entries.items():
            if entry.kind.grouped:
                q_part, s_part, z_part = entry.kind.suffixes
                lead, cols = list(entry.shape[:-1]), entry.shape[-1]
                words = entry.kind.uint32_cols(cols)
                groups = cols // entry.group_size
                prefix = names[name].removesuffix(".weight")
                sd = entry.scale_dtype
                tensors.append(Tensor(f"{prefix}.weight", "uint32", [*lead, words], self._words(store, name, q_part)))
                tensors.append(Tensor(f"{prefix}.scales", sd, [*lead, groups], _part(store, name, s_part)))
                tensors.append(Tensor(f"{prefix}.biases", sd, [*lead, groups], _part(store, name, z_part)))
            else:
                tensors.append(Tensor(names[name], store.runtime_dtype, entry.shape, dense[name] if dense is not None else None))
        return tensors

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        tensors = self.tensors(store, dense)
        config = self.config(store)

        final = store.path / self.directory
        tmp = make_temp_dir(final)
        try:
            files = {f"{self.directory}/{WEIGHTS}": write_safetensors(tmp / WEIGHTS, tensors, METADATA, align=ALIGN)}
            files[f"{self.directory}/{CONFIG}"] = write_json(tmp / CONFIG, config)
            for rel in store.manifest.side_files:
                if rel != CONFIG:
                    files[f"{self.directory}/{rel}"] = copy_file(store.path / rel, tmp / rel)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_sentinel(
            store.path / self.sentinel,
            manifest_fingerprint=store.fingerprint,
            files=files,
            tier=self.name,
            **self.sentinel_extra(store),
        )

    def sentinel_extra(self, store: NpyDir) -> dict:
        return {}

    def _words(self, store: NpyDir, name: str, suffix: str):
        return lambda: mlx_words(store.entry(name).scheme, store.load_part(name, suffix))


def _read_parts(store: NpyDir, parts: dict[str, _StoredPart], lazy: bool) -> dict[str, mx.array]:
    """Each part as MLX reads it at rest, by mlx_lm parameter name: format 2 opens each pack once (`mx.load`)
    and takes the parts wanted from it; format 1 opens each part's own .npy."""
    if store.version < 2:
        sizes = {key: math.prod(part.stored_shape) * part.stored.itemsize for key, part in parts.items()}
        return load_each_parallel(lambda key, stream: mx.load(str(parts[key].path), stream=stream), sizes, lazy=lazy)
    wanted: dict[str, dict[str, str]] = {}  # pack path -> {part name in the pack: mlx_lm name}
    for key, part in parts.items():
        wanted.setdefault(str(part.path), {})[store.entry(part.name).part_name(part.suffix)] = key
    sizes = {path: Path(path).stat().st_size for path in wanted}  # a pack per stream, balanced by bytes

    def open_pack(path: str, stream: mx.Stream) -> dict[str, mx.array]:
        arrays = mx.load(path, stream=stream)
        return {key: arrays[in_pack] for in_pack, key in wanted[path].items()}

    return load_files_parallel(open_pack, sizes, lazy=lazy)


def _check_finite(store: NpyDir, names: dict[str, str], arrays: dict[str, mx.array],
                  file_of: Callable[[str], Path]) -> None:
    """Every group-wise tensor's scales and offsets among `arrays` (by mlx_lm name, `names`: canonical -> mlx_lm;
    as stored or in the runtime dtype) checked finite where they are, in memory, as the cold path checks the
    store's (npydir.check_finite), each named by the file `file_of` says holds it. A lazy load reads them here: a
    sixteenth of its bytes or less."""
    parts = {}  # mlx_lm name -> what it is, for the error
    for name, entry in store.entries.items():
        if entry.kind.grouped:
            prefix = names[name].removesuffix(".weight")
            for suffix, key in zip(entry.kind.suffixes[1:], (f"{prefix}.scales", f"{prefix}.biases")):
                parts[key] = f"{key} (part {suffix} of {name})"
    values = [arrays[key].view(mx.uint16) if arrays[key].dtype == mx.bfloat16 else arrays[key] for key in parts]
    mx.eval(values)  # one evaluation for all (bfloat16's bits views; a lazy load's reads), not one per array
    for (key, what), array in zip(parts.items(), values):
        check_finite(file_of(key), np.asarray(array), what)


def _canonical(value: dict) -> str:
    return json.dumps(value, sort_keys=True)


# The NumPy dtypes parts are stored in (codes; scales and offsets, bf16 as its uint16 bits) and MLX's names for them.
_AT_REST = {np.dtype(np.uint8): mx.uint8, np.dtype(np.uint32): mx.uint32, np.dtype(np.float32): mx.float32,
            np.dtype(np.float16): mx.float16, np.dtype(np.uint16): mx.uint16}


def _part(store: NpyDir, name: str, suffix: str):
    return lambda: store.load_part(name, suffix)


class Int4Tier(QuantizedTier):
    name = "int4"
    scheme = "int4"
    bits = 4
    directory = "squish_4bit"


class Int3Tier(QuantizedTier):
    """Only for a store whose 3-bit model passed the accuracy gate at compress time (docs/format.md §6.4)."""

    name = "int3"
    scheme = "int3"
    bits = 3
    directory = "squish_3bit"

    def unavailable(self, store: NpyDir) -> str | None:
        if (no_codes := super().unavailable(store)) or store.manifest.int3_passed:
            return no_codes
        gate = store.manifest.int3_gate or {}
        return f"the store did not pass the INT3 accuracy gate ({gate.get('reason', 'not measured')})"

    def sentinel_extra(self, store: NpyDir) -> dict:
        return {"int3_gate": store.manifest.int3_gate}
