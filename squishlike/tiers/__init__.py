"""The decision tree (SPEC §2): the first ready tier in ORDER serves the load; otherwise the cold path.

Adding a tier means adding a module with a `Tier` subclass and one entry in ORDER.

Cold path: dequantize `tensors/` with the Rust kernels, then, holding the directory lock, build every tier the
manifest's policy asks for, so the next process takes a fast path. A process that waited on the lock re-checks
the tiers first and loads the one its predecessor built instead of building it again.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

from ..dtypes import to_mx
from ..errors import FormatError, TierNotReadyError
from ..formats.npydir import NpyDir
from ..storage import DirectoryLock, remove_stale_temps
from .base import Loaded, Tier, mlx_names
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


def load_weights(store: NpyDir, tier: str | None = None) -> Loaded:
    """Weights for the model, from the forced `tier` or the first ready one; cold (and build) when none is."""
    if tier is not None:
        return _load_forced(store, tier)
    loaded = _first_ready(store)
    if loaded is not None:
        return loaded
    return _cold_and_build(store)


def _load_forced(store: NpyDir, tier: str) -> Loaded:
    if tier == "cold":
        return _cold(store)[0]
    if tier not in BY_NAME:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIER_NAMES)}")
    payload, why = BY_NAME[tier].ready(store)
    if payload is None:
        raise TierNotReadyError(f"{store.path}: tier {tier!r} is not ready ({why})")
    return BY_NAME[tier].load(store)


def _first_ready(store: NpyDir) -> Loaded | None:
    for tier in ORDER:
        payload, _ = tier.ready(store)
        if payload is None:
            continue
        try:
            return tier.load(store)
        except (FormatError, OSError, ValueError, RuntimeError) as e:
            # A tier that passed its cheap checks but fails to load is corrupt: skip it; the cold path rebuilds it.
            warnings.warn(f"{store.path}: tier {tier.name} is unreadable ({e}); skipping it and rebuilding")
            tier.invalidate(store)
    return None


def _cold(store: NpyDir) -> tuple[Loaded, dict[str, np.ndarray]]:
    dense = {name: store.dequantize(name) for name in store.entries}
    names = mlx_names(store)
    weights = {names[n]: to_mx(a, store.runtime_dtype) for n, a in dense.items()}
    return Loaded(weights, store.config(), "cold"), dense


def _cold_and_build(store: NpyDir) -> Loaded:
    lock = DirectoryLock(store.path)
    try:
        lock.acquire()
    except OSError as e:  # read-only directory: load cold, build nothing
        log.warning("%s: cannot lock (%s); loading from the store without building caches", store.path, e)
        return _cold(store)[0]
    try:
        loaded = _first_ready(store)  # built by the process we waited for?
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


__all__ = ["ORDER", "BY_NAME", "TIER_NAMES", "Loaded", "Tier", "load_weights", "build_tiers", "tier_status"]
