"""How a load runs the decision (tiers/__init__.py): the forced tier, or the first ready one in this device's order,
skipping a damaged one; when none is ready, the cold path (build.py).

A process that waited on the directory lock re-checks the cache tiers first and loads the one its predecessor
built instead of building it again (build.cold_and_build).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from .. import memory
from ..environment import switch
from ..errors import FormatError, TierNotReadyError
from ..io.sentinel import ABSENT, sentinel_says_damaged
from ..npydir import NpyDir
from . import BY_NAME, COLD, ORDER, TIER_NAMES, TIERS, first_builds, target
from . import background as background_build
from .base import Loaded, Tier
from .build import cold_and_build
from .order import ordered, reason

log = logging.getLogger("squishlike")


def verify_wanted(verify: bool | None = None) -> bool:
    """`verify`, or when it is None the environment switch SQUISHLIKE_VERIFY=1."""
    return verify if verify is not None else switch("SQUISHLIKE_VERIFY")


def load_weights(store: NpyDir, tier: str | None = None, lazy: bool = False, verify: bool | None = None) -> Loaded:
    """Weights for the model, from the forced `tier` or the first ready one in this device's order; when none is
    ready, the cold path (which builds the tier the order will use).

    `lazy=True` leaves a ready tier's arrays unevaluated, as mlx_lm.load(lazy=True) does; the cold path always
    computes them. The cold path always checks the store's files against the manifest's fast hash; `verify`
    (see verify_wanted) makes it check every recorded hash, SHA-256 too, and also checks a cache tier's files
    against every hash its sentinel records before they are loaded (a damaged tier is then rebuilt). The side
    files (config, tokenizer, chat template) are checked on every load, warm or cold."""
    verify = verify_wanted(verify)
    try:
        store.check_side_files(verify)  # the tiers record the weights only: what else a load reads, checked here
        if tier is not None:
            return _load_forced(store, tier, lazy, verify)
        damaged: list[str] = []
        loaded = _first_ready(store, lazy, damaged, verify)
        if loaded is not None:
            return loaded
        # A damaged tier is rebuilt from the store now (cold path), even when a slower tier is ready.
        return cold_and_build(store, first_builds(store), lazy, recheck=not damaged, verify=verify,
                               background=background_build.background_wanted())
    finally:
        memory.release()  # a prepare_memory() reservation this load did not use


def _load_forced(store: NpyDir, tier: str, lazy: bool = False, verify: bool = False) -> Loaded:
    """The named tier's weights; one the policy asks for but never built (no sentinel at all) is built now (cold
    path). Any other tier that is not ready is an error: a stale, damaged or foreign sentinel is never trusted and
    never silently replaced by a forced load."""
    if tier not in BY_NAME:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIER_NAMES)}")
    chosen = BY_NAME[tier]
    payload, why = chosen.ready(store)
    if payload is None and chosen.serves_from_store(store):
        return chosen.from_store(store, lazy=lazy, verify=verify)
    if payload is not None:
        _say_if_slower(store, chosen)
        if chosen is COLD:  # it checks the store's files as it loads them
            return COLD.load(store, verify=verify)
        chosen.check_files(store, payload, verify)
        return chosen.load(store, lazy=lazy)
    if chosen is not COLD and chosen.wanted(store) and why == ABSENT:
        cold_and_build(store, [chosen], lazy, verify=verify)
        if chosen.ready(store)[0] is not None:
            _say_if_slower(store, chosen)
            return chosen.load(store, lazy=lazy)
    raise TierNotReadyError(_not_ready(store, chosen, why))


def _say_if_slower(store: NpyDir, forced: Tier) -> None:
    """A forced tier that comes after the one a load would take on this device: say which, and why."""
    goal, order = target(store), ordered(ORDER)
    if goal is not None and forced in order and order.index(forced) > order.index(goal):
        log.warning("%s: tier %s is forced, but a load here would take %s: %s", store.path, forced.name, goal.name,
                    reason())


def _not_ready(store: NpyDir, tier: Tier, why: str) -> str:
    """Which tiers the store has, and how the one asked for would be built."""
    ready = [t.name for t in TIERS if t.ready(store)[0] is not None]
    if tier.wanted(store):
        how = "it is in the store's policy: a load without tier= rebuilds it"
    else:
        how = tier.unavailable(store) or f"compress again with {tier.name} in tiers= and a first load builds it"
    return (f"{store.path}: tier {tier.name!r} is not ready ({tier.sentinel}: {why}); ready: {', '.join(ready)}; "
            f"{how}")


def _first_ready(store: NpyDir, lazy: bool = False, damaged: list[str] | None = None,
                 verify: bool = False) -> Loaded | None:
    """The first ready tier's weights. With `damaged`, stop at the first tier whose files are damaged (missing,
    wrong size, unreadable header), name it there and return None, so the caller rebuilds it."""
    for tier in ordered(ORDER):
        payload, why = tier.ready(store)
        if payload is None and tier.serves_from_store(store):
            return tier.from_store(store, lazy=lazy, verify=verify)
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
            tier.check_files(store, payload, verify)  # a file replaced since its sentinel was written is hashed
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
