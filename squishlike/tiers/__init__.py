"""The decision tree (docs/format.md §9): the first ready tier in ORDER serves the load; otherwise the cold path.

Adding a tier means adding a module with a `Tier` subclass and one entry in ORDER.

Cold path: dequantize `tensors/` with the Rust kernels, then, holding the directory lock, build every tier the
manifest's policy asks for, so the next process takes a fast path. A process that waited on the lock re-checks
the tiers first and loads the one its predecessor built instead of building it again.

The cold path allocates the model's final MLX arrays first (in huge pages, tiers/fastmem.py) and has the Rust
kernels dequantize straight into them, several tensors at a time; the tier builds then stream those same buffers
to disk. One copy of the model in memory, written once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..dtypes import NP_STORAGE
from ..errors import FormatError, TierNotReadyError
from ..io.atomic import remove_stale_temps
from ..io.lock import DirectoryLock
from ..io.sentinel import sentinel_says_damaged
from ..npydir import NpyDir
from . import fastmem
from .base import Loaded, Tier, mlx_names, runtime_bytes
from .fastmem import cpu_streams, huge_page_arena
from .finalized import FinalizedTier
from .mlx import MlxTier
from .quantized import Int3Tier, Int4Tier

log = logging.getLogger("squishlike")

ORDER: list[Tier] = [Int4Tier(), Int3Tier(), MlxTier(), FinalizedTier()]
BY_NAME: dict[str, Tier] = {t.name: t for t in ORDER}
TIER_NAMES = [t.name for t in ORDER] + ["cold"]


def tier_status(store: NpyDir) -> dict[str, str]:
    """For `inspect`: each tier's state, 'ready' or why it is not."""
    status = {}
    for tier in ORDER:
        payload, why = tier.ready(store)
        status[tier.name] = "ready" if payload else why
    return status


def load_weights(store: NpyDir, tier: str | None = None, lazy: bool = False) -> Loaded:
    """Weights for the model, from the forced `tier` or the first ready one; cold (and build) when none is.

    `lazy=True` leaves a ready tier's arrays unevaluated, as mlx_lm.load(lazy=True) does; the cold path always
    computes them."""
    try:
        if tier is not None:
            return _load_forced(store, tier, lazy)
        damaged: list[str] = []
        loaded = _first_ready(store, lazy, damaged)
        if loaded is not None:
            return loaded
        # A damaged tier is rebuilt from the store now (cold path), even when a slower tier is ready.
        return _cold_and_build(store, lazy, recheck=not damaged)
    finally:
        fastmem.release()  # a prepare_memory() reservation this load did not use


def release_memory() -> None:
    """Drop a prepare_memory() reservation when the load it was made for will not happen (an error before it)."""
    fastmem.release()


def prepare_memory(store: NpyDir, tier: str | None = None, lazy: bool = False) -> bool:
    """Get ready, on background threads, for load_weights(store, tier): fault in the memory it will fill, and
    ask the kernel to read ahead the files it will read if they are not in the page cache.

    For a caller with other work to do first (importing mlx_lm and transformers, building the tokenizer: ~1 s):
    getting fresh memory is most of a warm load, and reading the disk most of a cold one (docs/design.md §3.1);
    both can run beside that work instead of after it. load_weights then uses the reservation (or releases it).
    Cheap: it only reads sentinels. Returns whether memory was reserved."""
    if lazy:
        return False
    try:
        if tier is not None and tier != "cold":
            chosen = BY_NAME.get(tier)
            payload = chosen.ready(store)[0] if chosen is not None else None
            if payload is None:
                return False  # an unknown tier or one that is not ready: load_weights says why
        else:
            ready = [] if tier == "cold" else ((t, t.ready(store)[0]) for t in ORDER)
            chosen, payload = next(((t, p) for t, p in ready if p is not None), (None, None))
        if payload is not None:
            files, nbytes = [store.path / rel for rel in payload.get("files", {})], chosen.nbytes(store)
        else:  # the cold path: the store's parts, dequantized into the runtime dtype
            files, nbytes = [store.path / rel for rel in store.part_files()], runtime_bytes(store)
    except (OSError, ValueError, KeyError):
        return False
    fastmem.prefetch(files)
    return fastmem.reserve(nbytes) if nbytes else False


def _load_forced(store: NpyDir, tier: str, lazy: bool = False) -> Loaded:
    if tier == "cold":
        return _cold(store)[0]
    if tier not in BY_NAME:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIER_NAMES)}")
    payload, why = BY_NAME[tier].ready(store)
    if payload is None:
        raise TierNotReadyError(f"{store.path / BY_NAME[tier].sentinel}: tier {tier!r} is not ready ({why})")
    return BY_NAME[tier].load(store, lazy=lazy)


def _first_ready(store: NpyDir, lazy: bool = False, damaged: list[str] | None = None) -> Loaded | None:
    """The first ready tier's weights. With `damaged`, stop at the first tier whose files are damaged (missing,
    wrong size, unreadable header), name it there and return None, so the caller rebuilds it."""
    for tier in ORDER:
        payload, why = tier.ready(store)
        if payload is None:
            if damaged is not None and sentinel_says_damaged(why) and tier.wanted(store):
                warnings.warn(f"{store.path / tier.sentinel}: tier {tier.name} is damaged ({why}); "
                              "skipping it and rebuilding it from the store")
                with contextlib.suppress(OSError):  # a read-only directory: nothing to rebuild into anyway
                    tier.invalidate(store)
                damaged.append(tier.name)
                return None
            continue
        try:
            return tier.load(store, lazy=lazy)
        except (FormatError, OSError, ValueError, RuntimeError) as e:
            # A tier that passed its cheap checks but fails to load is corrupt: skip it; the cold path rebuilds it.
            warnings.warn(f"{store.path}: tier {tier.name} is unreadable ({e}); skipping it and rebuilding")
            with contextlib.suppress(OSError):  # a read-only directory: nothing to rebuild into anyway
                tier.invalidate(store)
            if damaged is not None:
                damaged.append(tier.name)
                return None
    return None


_MX_STORAGE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.uint16}


def _cold(store: NpyDir) -> tuple[Loaded, dict[str, np.ndarray]]:
    """(weights dequantized from the store, the same memory as NumPy arrays by canonical name for the builds)."""
    dtype = store.runtime_dtype
    store.check_part_sizes()  # before allocating from the manifest's shapes
    fastmem.prefetch([store.path / rel for rel in store.part_files()])  # a store not in the page cache: read ahead
    buffers, dense = _allocate(store)
    _dequantize_all(store, dense)
    names = mlx_names(store)
    if dtype == "bfloat16":
        weights = {names[n]: b.view(mx.bfloat16) for n, b in buffers.items()}
    else:
        weights = {names[n]: b for n, b in buffers.items()}
    return Loaded(weights, store.config(), "cold"), dense


def _allocate(store: NpyDir) -> tuple[dict[str, mx.array], dict[str, np.ndarray]]:
    """The model's final arrays (runtime dtype, bf16 as uint16), allocated by MLX in huge pages, and writable
    NumPy views of them for the kernels to dequantize into."""
    dtype = store.runtime_dtype
    itemsize = np.dtype(NP_STORAGE[dtype]).itemsize
    streams = cpu_streams()
    loads = [0] * len(streams)
    buffers: dict[str, mx.array] = {}
    for name in sorted(store.entries, key=lambda n: -math.prod(store.entries[n].shape)):
        i = loads.index(min(loads))  # the zero-fill that faults the pages in runs on every core
        shape = store.entries[name].shape
        buffers[name] = mx.zeros(shape, dtype=_MX_STORAGE[dtype], stream=streams[i])
        loads[i] += math.prod(shape) * itemsize
    buffers = {name: buffers[name] for name in store.entries}
    with huge_page_arena(sum(loads)):
        mx.eval(list(buffers.values()))
    dense = {name: np.asarray(b) for name, b in buffers.items()}
    if all(a.flags.writeable and a.flags.c_contiguous for a in dense.values()):
        return buffers, dense
    # An MLX that does not lend its memory out writable: dequantize into NumPy, then copy into MLX.
    dense = {name: np.empty(store.entries[name].shape, NP_STORAGE[dtype]) for name in store.entries}
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


def _cold_and_build(store: NpyDir, lazy: bool = False, recheck: bool = True) -> Loaded:
    lock = DirectoryLock(store.path)
    try:
        lock.acquire()
    except OSError as e:  # read-only directory: load cold, build nothing
        log.warning("%s: cannot lock (%s); loading from the store without building caches", store.path, e)
        return _cold(store)[0]
    try:
        loaded = _first_ready(store, lazy) if recheck else None  # built by the process we waited for?
        if loaded is not None:
            return loaded
        remove_stale_temps(store.path)
        loaded, dense = _cold(store)
        build_tiers(store, dense)
        return loaded
    finally:
        lock.release()


def build_tiers(store: NpyDir, dense: dict[str, np.ndarray]) -> list[str]:
    """Build the tiers the policy wants that are not ready yet. The caller holds the lock. Returns those built."""
    built = []
    for tier in ORDER:
        if not tier.wanted(store) or tier.ready(store)[0] is not None:
            continue
        try:
            tier.build(store, dense)
            built.append(tier.name)
        except OSError as e:  # disk full, read-only: the load still succeeds from the cold weights
            warnings.warn(f"{store.path}: could not build tier {tier.name} ({e}); it stays unbuilt")
    return built


__all__ = ["ORDER", "BY_NAME", "TIER_NAMES", "Loaded", "Tier", "load_weights", "build_tiers", "tier_status",
           "prepare_memory", "release_memory"]
