"""The decision tree (docs/format.md §9): the first ready tier in TIERS serves the load. The cache tiers (ORDER)
come first; the cold tier, last, is always ready.

Adding a cache tier means adding a module with a `Tier` subclass and one entry in ORDER.

Cold path: dequantize `tensors/` (tiers/cold.py), then, holding the directory lock, build every cache tier the
manifest's policy asks for from those same buffers, so the next process takes a fast path. A process that waited
on the lock re-checks the cache tiers first and loads the one its predecessor built instead of building it again.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np

from ..errors import FormatError, TierNotReadyError
from ..io.atomic import remove_stale_temps
from ..io.lock import DirectoryLock
from ..io.sentinel import sentinel_says_damaged
from ..npydir import NpyDir
from . import fastmem
from .base import Loaded, Tier
from .cold import ColdTier
from .finalized import FinalizedTier
from .mlx import MlxTier
from .quantized import Int3Tier, Int4Tier

log = logging.getLogger("squishlike")

ORDER: list[Tier] = [Int4Tier(), Int3Tier(), MlxTier(), FinalizedTier()]  # the cache tiers, fastest first
COLD = ColdTier()
TIERS: list[Tier] = [*ORDER, COLD]
BY_NAME: dict[str, Tier] = {t.name: t for t in TIERS}
TIER_NAMES = list(BY_NAME)


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
        candidates = TIERS if tier is None else [t for t in TIERS if t.name == tier]
        chosen, payload = next(((t, p) for t in candidates if (p := t.ready(store)[0]) is not None), (None, None))
        if payload is None:
            return False  # an unknown tier or one that is not ready: load_weights says why
        files, nbytes = [store.path / rel for rel in payload.get("files", {})], chosen.nbytes(store)
    except (OSError, ValueError, KeyError):
        return False
    fastmem.prefetch(files)
    return fastmem.reserve(nbytes) if nbytes else False


def _load_forced(store: NpyDir, tier: str, lazy: bool = False) -> Loaded:
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


def _cold_and_build(store: NpyDir, lazy: bool = False, recheck: bool = True) -> Loaded:
    lock = DirectoryLock(store.path)
    try:
        lock.acquire()
    except OSError as e:  # read-only directory: load cold, build nothing
        log.warning("%s: cannot lock (%s); loading from the store without building caches", store.path, e)
        return COLD.load(store)
    try:
        loaded = _first_ready(store, lazy) if recheck else None  # built by the process we waited for?
        if loaded is not None:
            return loaded
        remove_stale_temps(store.path)
        loaded, dense = COLD.load_dense(store)
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


__all__ = ["ORDER", "COLD", "TIERS", "BY_NAME", "TIER_NAMES", "Loaded", "Tier", "load_weights", "build_tiers", "tier_status",
           "prepare_memory", "release_memory"]
