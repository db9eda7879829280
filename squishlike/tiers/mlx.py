"""Tier `mlx`: one `squish_weights.safetensors` in the runtime dtype, keyed by mlx_lm parameter names.

The fastest dense tier. Load: `mx.load` spread over one CPU stream per core, its buffers in huge pages
(tiers/fastmem.py). Build: the cold path's dequantized buffers are streamed straight into the file (header, then
each tensor's bytes), checksummed while written; no second copy of the model is ever made.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..npydir import NpyDir
from ..storage import atomic_stream, write_sentinel
from .base import Loaded, Tier, mlx_names
from .fastmem import load_parallel, prefetch

WEIGHTS = "squish_weights.safetensors"
# safetensors dtype names of the arrays we write; bfloat16 travels as its raw uint16 bits
ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32", "uint8": "U8", "int8": "I8"}


class MlxTier(Tier):
    name = "mlx"
    sentinel = ".squish_ready"

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        return Loaded(load_safetensors(store.path / WEIGHTS, lazy=lazy), store.config(), self.name)

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        names = mlx_names(store)
        dtype = store.runtime_dtype
        tensors = [(names[n], dtype, store.entries[n].shape, dense[n]) for n in store.entries]
        record = write_safetensors(store.path / WEIGHTS, tensors)
        write_sentinel(
            store.path / self.sentinel, manifest_fingerprint=store.fingerprint, files={WEIGHTS: record}, tier=self.name
        )


def load_safetensors(path: Path, lazy: bool = False) -> dict[str, mx.array]:
    """mx.load(path), evaluated unless `lazy`: the same arrays, loaded in parallel into huge-page memory."""
    from_disk = not lazy and prefetch([path]) is not None
    return load_parallel(lambda stream: mx.load(str(path), stream=stream), order=file_order(path), lazy=lazy,
                         from_disk=from_disk)


def file_order(path: Path) -> list[str] | None:
    """The tensor names of a safetensors file in the order of their data (from its header), or None."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < (100 << 20) else {}
        header.pop("__metadata__", None)
        return sorted(header, key=lambda k: header[k]["data_offsets"][0])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # mx.load reports a bad file itself


def write_safetensors(final: Path, tensors: list[tuple[str, str, list[int], object]]) -> dict:
    """Write (name, dtype name, shape, data) tensors as one safetensors file, atomically; return its record.

    Loads exactly like mx.save_safetensors' output (same header fields, metadata {"format": "mlx"}); the data is
    streamed from the given buffers (NumPy arrays, memory maps) without an intermediate copy of the model. `data`
    may be a callable returning the buffer: it is called when that tensor is written, and dropped after.
    """
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, dtype, shape, _ in tensors:
        nbytes = math.prod(shape) * np.dtype(_np_dtype(dtype)).itemsize
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the format recommends
    with atomic_stream(final) as w:
        w.write(len(blob).to_bytes(8, "little") + blob)
        for name, dtype, shape, data in tensors:
            buffer = data() if callable(data) else data
            expected = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if memoryview(buffer).nbytes != expected:
                raise ValueError(f"{name}: {memoryview(buffer).nbytes} bytes of data for {dtype}{list(shape)} "
                                 f"({expected} bytes)")
            w.write(buffer)
            del buffer
    return w.record()


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)
