"""Tier `mlx`: one `squish_weights.safetensors` in the runtime dtype, keyed by mlx_lm parameter names.

The fastest dense tier. Load: `mx.load` spread over one CPU stream per core, its buffers in huge pages
(squishlike/memory.py); on Metal, the file's pages wrapped without a copy (`map_without_copy`). Build: the cold path's dequantized buffers are streamed straight into the file (header, then
each tensor's bytes), checksummed while written; no second copy of the model is ever made.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..dtypes import MX_DTYPES, NP_STORAGE
from ..formats.safetensors import PAGE_ALIGN, Tensor, check_layout, layout, write_safetensors
from ..io.files import open_regular
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir
from .base import Loaded, Tier, mlx_names
from ..memory import load_parallel, prefetch

WEIGHTS = "squish_weights.safetensors"
METADATA = {"format": "mlx"}  # what mx.save_safetensors records
ALIGN = PAGE_ALIGN  # every tensor of a cache file starts on a 16 KiB page: Metal maps it (map_without_copy)


class MlxTier(Tier):
    name = "mlx"
    sentinel = ".squish_ready"
    paths = (WEIGHTS,)

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        weights = load_safetensors(store.path / WEIGHTS, self.tensors(store), store.path, lazy=lazy)
        return Loaded(weights, store.config(), self.name)

    def tensors(self, store: NpyDir, dense: dict[str, np.ndarray] | None = None) -> list[Tensor]:
        """What the tier's file holds, in order; with `dense`, the data to write."""
        names = mlx_names(store)
        dtype = store.runtime_dtype
        return [Tensor(names[n], dtype, e.shape, dense[n] if dense is not None else None) for n, e in store.entries.items()]

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        record = write_safetensors(store.path / WEIGHTS, self.tensors(store, dense), METADATA, align=ALIGN)
        write_sentinel(
            store.path / self.sentinel, manifest_fingerprint=store.fingerprint, files={WEIGHTS: record}, tier=self.name
        )


def load_safetensors(path: Path, tensors: list[Tensor], root: Path | None = None,
                     lazy: bool = False) -> dict[str, mx.array]:
    """mx.load(path) of a cache file written for `tensors`, evaluated unless `lazy`: the same arrays, loaded in
    parallel into huge-page memory; on Metal, wrapped over the file's pages without a copy. The header is checked
    first to be exactly the one written for them (check_layout)."""
    check_layout(path, tensors, root, ALIGN)
    if not lazy and on_metal():
        return map_without_copy(path, tensors, root)
    from_disk = not lazy and prefetch([path], root) is not None
    return load_parallel(lambda stream: mx.load(str(path), stream=stream), order=[t.name for t in tensors],
                         lazy=lazy, from_disk=from_disk)


def on_metal() -> bool:
    """Whether the model runs on Metal, the one MLX backend that wraps memory it did not allocate (mlx >= 0.32.1)."""
    return mx.metal.is_available() and mx.default_device().type == mx.DeviceType.gpu


def map_without_copy(path: Path, tensors: list[Tensor], root: Path | None = None) -> dict[str, mx.array]:
    """The tensors of a cache file as arrays over one private mapping of it, no copy: each starts on a 16 KiB page
    (ALIGN), which is what Metal needs to use memory it did not allocate. The mapping is copy-on-write (the
    file never changes) and lives as long as the NumPy views the arrays were made from. Not run yet: the
    project's machines have no Metal (docs/design.md §5.3); the CPU and CUDA paths copy (mx.load)."""
    with open_regular(path, root) as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + int.from_bytes(mapping[:8], "little")
    arrays = {}
    for t, entry in zip(tensors, layout(tensors, ALIGN).values()):
        begin, end = entry["data_offsets"]
        storage = np.dtype(NP_STORAGE.get(t.dtype, t.dtype))
        view = np.frombuffer(mapping, storage, (end - begin) // storage.itemsize, start + begin).reshape(t.shape)
        array = mx.asarray(view, copy=False)
        arrays[t.name] = mx.view(array, MX_DTYPES[t.dtype]) if t.dtype == "bfloat16" else array
    return arrays
