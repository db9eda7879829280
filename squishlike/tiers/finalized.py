"""Tier `finalized`: one `.npy` per tensor in the runtime dtype under `finalized/`, sentinel `finalized/.ready`.

Memory-mappable and readable by anything that reads NumPy; the sentinel sits inside the directory, so the
directory and its "ready" mark appear together in one rename.
"""

from __future__ import annotations

import shutil

import numpy as np

from ..dtypes import NP_STORAGE, to_mx
from ..errors import FormatError
from ..formats.npydir import NpyDir
from ..storage import make_temp_dir, publish_dir, write_npy, write_sentinel
from .base import Loaded, Tier, mlx_names

DIRECTORY = "finalized"


class FinalizedTier(Tier):
    name = "finalized"
    sentinel = f"{DIRECTORY}/.ready"

    def load(self, store: NpyDir) -> Loaded:
        names = mlx_names(store)
        dtype = store.runtime_dtype
        weights = {}
        for name, entry in store.entries.items():
            path = store.path / DIRECTORY / f"{entry['key']}.npy"
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            if array.dtype != NP_STORAGE[dtype] or list(array.shape) != entry["shape"]:
                raise FormatError(path, f"holds {array.dtype}{list(array.shape)}, expected {dtype}{entry['shape']}")
            weights[names[name]] = to_mx(array, dtype)
        return Loaded(weights, store.config(), self.name)

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        final = store.path / DIRECTORY
        tmp = make_temp_dir(final)
        try:
            files = {f"{store.entries[n]['key']}.npy": write_npy(tmp / f"{store.entries[n]['key']}.npy", a) for n, a in dense.items()}
            write_sentinel(tmp / ".ready", manifest_fingerprint=store.fingerprint, files=files, tier=self.name)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
