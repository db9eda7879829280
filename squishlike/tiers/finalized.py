"""Tier `finalized`: one `.npy` per tensor in the runtime dtype under `finalized/`, sentinel `finalized/.ready`.

Memory-mappable and readable by anything that reads NumPy; the sentinel sits inside the directory, so the
directory and its "ready" mark appear together in one rename. Loaded with `mx.load` of each file (it reads .npy
natively), spread over the CPU streams into huge-page memory (squishlike/memory.py), not through NumPy: a memory map
copied by `mx.array` would fault every page twice.
"""

from __future__ import annotations

import math
import shutil

import mlx.core as mx
import numpy as np

from ..dtypes import MX_DTYPES, MX_STORAGE, NP_STORAGE
from ..errors import FormatError
from ..io.atomic import make_temp_dir, publish_dir
from ..io.npy import check_npy, write_npy_stream
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir, TensorEntry
from .base import Loaded, Tier, mlx_names
from ..memory import load_each, prefetch

DIRECTORY = "finalized"


class FinalizedTier(Tier):
    name = "finalized"
    sentinel = f"{DIRECTORY}/.ready"
    paths = (DIRECTORY,)

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        names = mlx_names(store)
        dtype = store.runtime_dtype
        itemsize = np.dtype(NP_STORAGE[dtype]).itemsize

        def opener(entry: TensorEntry):
            path = store.path / _file(entry)

            def open_on(stream: mx.Stream) -> mx.array:
                check_npy(path, NP_STORAGE[dtype], entry.shape)
                try:
                    array = mx.load(str(path), format="npy", stream=stream)
                except (RuntimeError, ValueError, OSError) as e:
                    raise FormatError(path, f"unreadable .npy ({e})") from None
                if array.dtype != MX_STORAGE[dtype] or tuple(array.shape) != entry.shape:
                    raise FormatError(
                        path, f"holds {array.dtype}{list(array.shape)}, expected {dtype}{list(entry.shape)}")
                return mx.view(array, MX_DTYPES[dtype], stream=stream) if dtype == "bfloat16" else array

            return math.prod(entry.shape) * itemsize, open_on

        paths = [store.path / _file(e) for e in store.entries.values()]
        from_disk = not lazy and prefetch(paths, store.path) is not None
        loaded = load_each({names[n]: opener(e) for n, e in store.entries.items()}, lazy=lazy, from_disk=from_disk)
        return Loaded(loaded, store.config(), self.name)

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        final = store.path / DIRECTORY
        tmp = make_temp_dir(final)
        try:
            names = {n: f"{store.entries[n].key}.npy" for n in dense}
            files = {names[n]: write_npy_stream(tmp / names[n], a, atomic=False) for n, a in dense.items()}
            write_sentinel(tmp / ".ready", manifest_fingerprint=store.fingerprint, files=files, tier=self.name)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _file(entry: TensorEntry) -> str:
    """A tensor's file, relative to the npy-dir: the runtime-dtype array, named by the tensor's key."""
    return f"{DIRECTORY}/{entry.key}.npy"
