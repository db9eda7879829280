"""How a load runs its plan (tiers/__init__.py `decide`): the forced tier, or the first ready one in this device's
order, skipping a damaged one; when none is ready, the cold path (build.py).

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
from ..npydir import NpyDir
from . import BUILT, COLD_PATH, ORDER, STORE, TIERS, Plan, decide, first_builds, target
from . import background as background_build
from .base import Loaded, Tier
from .build import cold_and_build
from .order import ordered, reason

log = logging.getLogger("squishlike")


def verify_wanted(verify: bool | None = None) -> bool:
    """`verify`, or when it is None the environment switch SQUISHLIKE_VERIFY=1."""
    return verify if verify is not None else switch("SQUISHLIKE_VERIFY")


def load_weights(store: NpyDir, tier: str | None = None, lazy: bool = False, verify: bool | None = None,
                 plan: Plan | None = None) -> Loaded:
    """Weights for the model, as `plan` says (default: decide(store, tier), the decision tree): the forced `tier` or
    the first ready one in this device's order; when none is ready, the cold path (which builds the tier the order
    will use).

    `lazy=True` leaves a ready tier's arrays unevaluated, as mlx_lm.load(lazy=True) does; the cold path always
    computes them. The cold path always checks the store's files against the manifest's fast hash; `verify`
    (see verify_wanted) makes it check every recorded hash, SHA-256 too, and also checks a cache tier's files
    against every hash its sentinel records before they are loaded (a damaged tier is then rebuilt). The side
    files (config, tokenizer, chat template) are checked on every load, warm or cold (once per opened store:
    `load` checks them before it builds the tokenizer)."""
    verify = verify_wanted(verify)
    try:
        store.check_side_files(verify)  # the tiers record the weights only: what else a load reads, checked here
        return _run(store, plan if plan is not None else decide(store, tier), lazy, verify)
    finally:
        memory.release()  # a prepare_memory() reservation this load did not use


def _run(store: NpyDir, plan: Plan, lazy: bool, verify: bool) -> Loaded:
    chosen = plan.tier
    if plan.source == STORE:
        return chosen.from_store(store, lazy=lazy, verify=verify)
    if plan.source == BUILT:
        if plan.forced:
            _say_if_slower(store, chosen)
        try:
            chosen.check_files(store, plan.payload, verify)  # a file replaced since its sentinel was written is hashed
            return chosen.load(store, lazy=lazy)
        except (FormatError, OSError, ValueError, RuntimeError) as e:
            if plan.forced:
                raise
            # A tier that passed its cheap checks but fails to load is corrupt: skip it; the cold path rebuilds it.
            warnings.warn(f"{store.path}: tier {chosen.name} is unreadable ({e}); skipping it and rebuilding")
            _remove(store, chosen)
            return cold_and_build(store, first_builds(store), lazy, recheck=False, verify=verify,
                                  background=background_build.background_wanted())
    if plan.source == COLD_PATH:
        if plan.damaged is not None:  # rebuilt from the store now (cold path), even when a slower tier is ready
            warnings.warn(f"{store.path / plan.damaged.sentinel}: tier {plan.damaged.name} is damaged "
                          f"({plan.state}); skipping it and rebuilding it from the store")
            _remove(store, plan.damaged)
        return cold_and_build(store, list(plan.builds), lazy, recheck=plan.damaged is None, verify=verify,
                              background=background_build.background_wanted() and not plan.forced)
    if plan.builds:  # MISSING, forced, in the policy and never built: build it now
        cold_and_build(store, list(plan.builds), lazy, verify=verify)
        if chosen.ready(store)[0] is not None:
            _say_if_slower(store, chosen)
            return chosen.load(store, lazy=lazy)
    raise TierNotReadyError(_not_ready(store, chosen, plan.state))


def _remove(store: NpyDir, tier: Tier) -> None:
    """Remove a damaged tier's sentinel, so no load takes it again; the cold path rebuilds it if it builds it."""
    with contextlib.suppress(OSError):  # a read-only directory: nothing to rebuild into anyway
        tier.invalidate(store)


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
