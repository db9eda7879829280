"""The cold tier: the store itself, dequantized by the Rust kernels. Always ready; the tier the others are built from.

The model's final MLX arrays are allocated first (in huge pages, squishlike/memory.py) and the kernels dequantize
straight into them, several tensors at a time; the cache tiers' builds then stream those same buffers to disk.
One copy of the model in memory, written once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..dtypes import MX_STORAGE, NP_STORAGE
from ..errors import FormatError
from ..io.checksum import check_files
from ..npydir import MANIFEST, NpyDir
from .base import Loaded, Tier, mlx_names, runtime_bytes
from ..memory import assign_streams, cpu_streams, huge_page_arena, prefetch


class ColdTier(Tier):
    name = "cold"
    sentinel = MANIFEST  # a store that opened is valid, so its manifest is all this tier needs
    paths = ()  # the store itself, which nothing removes

    def ready(self, store: NpyDir) -> tuple[dict | None, str]:
        return {"files": store.part_files()}, "ready"

    def invalidate(self, store: NpyDir) -> None:
        """Nothing: the store is never removed to rebuild it."""

    def check_files(self, store: NpyDir, payload: dict, verify: bool = False) -> None:
        """With `verify`, every hash of every store file; otherwise nothing here: the cold path hashes each file as
        it loads it, and the manifest records no identities to bind (nor is it ever rewritten by a load)."""
        if verify:
            check_files(store.path, payload["files"], every=True)

    def load(self, store: NpyDir, lazy: bool = False, verify: bool = False) -> Loaded:
        """Always computed: `lazy` does not apply to dequantization. `verify`: see load_dense."""
        return self.load_dense(store, verify=verify)[0]

    def load_dense(self, store: NpyDir, only: Collection[str] | None = None,
                   verify: bool = False) -> tuple[Loaded, dict[str, np.ndarray]]:
        """(the weights, the same memory as NumPy arrays by canonical name: what the cache tiers build from).

        `only`: dequantize just these tensors (what a quantized tier's build needs); the weights are then partial.

        Every store file is checked against the manifest's record, on a background thread while the kernels
        dequantize, and an IntegrityError naming the first damaged file is raised before anything is returned:
        damaged data never reaches a model, nor a cache tier built from these buffers. The check compares the
        record's XXH3 (SHA-256 for a store written before XXH3 was recorded); with `verify`, every hash recorded."""
        store.check_part_sizes()  # before allocating from the manifest's shapes
        _check_fits_in_memory(store)
        prefetch([store.path / rel for rel in store.part_files()], store.path)  # not in the page cache: read ahead
        with ThreadPoolExecutor(1, thread_name_prefix="squishlike-verify") as pool:
            checked = pool.submit(check_files, store.path, store.file_records(), verify)
            buffers, dense = _allocate(store, set(store.entries) if only is None else set(only))
            _dequantize_all(store, dense)
            checked.result()
        names = mlx_names(store)  # canonical -> mlx_lm parameter name
        if store.runtime_dtype == "bfloat16":
            weights = {names[n]: b.view(mx.bfloat16) for n, b in buffers.items()}
        else:
            weights = {names[n]: b for n, b in buffers.items()}
        return Loaded(weights, store.config(), self.name), dense

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        """Nothing: compress wrote this tier."""


def _check_fits_in_memory(store: NpyDir) -> None:
    """FormatError naming the manifest when its tensors need more memory than the machine has: parts on sparse
    files can back any shape, and a failed allocation inside MLX kills the process instead of raising."""
    needed = runtime_bytes(store)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > physical:
        raise FormatError(store.path / MANIFEST, f"its tensors need {needed} bytes of memory, more than the "
                                                 f"{physical} bytes this machine has")


def _allocate(store: NpyDir, names: set[str]) -> tuple[dict[str, mx.array], dict[str, np.ndarray]]:
    """The model's final arrays for `names` (runtime dtype, bf16 as uint16), allocated by MLX in huge pages, and
    writable NumPy views of them for the kernels to dequantize into."""
    dtype = store.runtime_dtype
    itemsize = NP_STORAGE[dtype].itemsize
    entries = {name: entry for name, entry in store.entries.items() if name in names}
    largest_first = sorted(entries, key=lambda n: -math.prod(entries[n].shape))
    sizes = {name: math.prod(entries[name].shape) * itemsize for name in largest_first}
    chosen = assign_streams(sizes)  # the zero-fill that faults the pages in runs on every core
    streams = cpu_streams()
    buffers = {
        name: mx.zeros(entry.shape, dtype=MX_STORAGE[dtype], stream=streams[chosen[name]])
        for name, entry in entries.items()
    }
    with huge_page_arena(sum(sizes.values())):
        mx.eval(list(buffers.values()))
    dense = {name: np.asarray(b) for name, b in buffers.items()}
    if all(a.flags.writeable and a.flags.c_contiguous for a in dense.values()):
        return buffers, dense
    # An MLX that does not lend its memory out writable: dequantize into NumPy, then copy into MLX.
    dense = {name: np.empty(entry.shape, NP_STORAGE[dtype]) for name, entry in entries.items()}
    _dequantize_all(store, dense)
    buffers = {name: mx.array(a) for name, a in dense.items()}
    return buffers, {name: np.asarray(b) for name, b in buffers.items()}


def _dequantize_all(store: NpyDir, dense: dict[str, np.ndarray]) -> None:
    """store.dequantize(name, out=dense[name]) for every tensor, largest first, a few at a time: the Rust kernels
    and the reads release the GIL, so passthrough copies overlap dequantization."""
    order = sorted(dense, key=lambda n: -dense[n].size)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="squishlike-cold") as pool:
        for future in [pool.submit(store.dequantize, name, dense[name]) for name in order]:
            future.result()
