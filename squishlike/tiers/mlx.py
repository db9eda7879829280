"""Tier `mlx`: one `squish_weights.safetensors` in the runtime dtype, keyed by mlx_lm parameter names.

The fastest dense tier: `mx.load` reads it in large parallel chunks straight into the arrays the model uses.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..dtypes import to_mx
from ..formats.npydir import NpyDir
from ..storage import atomic_path, file_record, write_sentinel
from .base import Loaded, Tier, mlx_names

WEIGHTS = "squish_weights.safetensors"


class MlxTier(Tier):
    name = "mlx"
    sentinel = ".squish_ready"

    def load(self, store: NpyDir) -> Loaded:
        return Loaded(mx.load(str(store.path / WEIGHTS)), store.config(), self.name)

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        names = mlx_names(store)
        arrays = {names[n]: to_mx(a, store.runtime_dtype) for n, a in dense.items()}
        record = save_safetensors(store.path / WEIGHTS, arrays)
        write_sentinel(
            store.path / self.sentinel, manifest_fingerprint=store.fingerprint, files={WEIGHTS: record}, tier=self.name
        )


def save_safetensors(final: Path, arrays: dict[str, mx.array]) -> dict:
    """mx.save_safetensors, made atomic: written under a temp name, fsynced, renamed. Returns the file record."""
    with atomic_path(final) as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata={"format": "mlx"})
    return file_record(final)
