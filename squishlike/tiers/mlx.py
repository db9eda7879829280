"""Tier `mlx`: one `squish_weights.safetensors` in the runtime dtype, keyed by mlx_lm parameter names.

The fastest dense tier. Load: `mx.load` spread over one CPU stream per core, its buffers in huge pages
(tiers/fastmem.py). Build: the cold path's dequantized buffers are streamed straight into the file (header, then
each tensor's bytes), checksummed while written; no second copy of the model is ever made.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.safetensors import Tensor, check_layout, file_order, write_safetensors
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir
from .base import Loaded, Tier, mlx_names
from .fastmem import load_parallel, prefetch

WEIGHTS = "squish_weights.safetensors"
METADATA = {"format": "mlx"}  # what mx.save_safetensors records


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
        record = write_safetensors(store.path / WEIGHTS, self.tensors(store, dense), METADATA)
        write_sentinel(
            store.path / self.sentinel, manifest_fingerprint=store.fingerprint, files={WEIGHTS: record}, tier=self.name
        )


def load_safetensors(path: Path, tensors: list[Tensor] | None = None, root: Path | None = None,
                     lazy: bool = False) -> dict[str, mx.array]:
    """mx.load(path), evaluated unless `lazy`: the same arrays, loaded in parallel into huge-page memory. With
    `tensors`, the header is checked first to be exactly the one written for them (check_layout)."""
    if tensors is not None:
        check_layout(path, tensors, root)
    from_disk = not lazy and prefetch([path]) is not None
    return load_parallel(lambda stream: mx.load(str(path), stream=stream), order=file_order(path), lazy=lazy,
                         from_disk=from_disk)
