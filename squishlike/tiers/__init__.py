"""The decision tree (docs/format.md §9): the first ready cache tier in the device's order (tiers/order.py) serves
the load; the cold tier, last, is always ready.

Here: the tiers, and which of them a load takes or builds. How a load runs that decision is load.py; the cold
path that builds a tier, build.py; removing tiers, prune.py; getting memory ready ahead of a load, prepare.py.
Each tier declares the files it writes once (base.Tier.sentinel and paths), and all of them derive from that.

Adding a cache tier means adding a module with a `Tier` subclass, one entry in ORDER and its name in
order.PREFERENCE.
"""

from __future__ import annotations

from ..npydir import NpyDir
from .base import Loaded, Tier
from .cold import ColdTier
from .finalized import FinalizedTier
from .int8 import Int8Tier
from .mlx import MlxTier
from .order import caches_by_default, ordered, reason
from .quantized import Int3Tier, Int4Tier

ORDER: list[Tier] = [Int4Tier(), Int8Tier(), Int3Tier(), MlxTier(), FinalizedTier()]  # the cache tiers (order: order.py)
COLD = ColdTier()
TIERS: list[Tier] = [*ORDER, COLD]
BY_NAME: dict[str, Tier] = {t.name: t for t in TIERS}
TIER_NAMES = list(BY_NAME)


def tier_status(store: NpyDir) -> dict[str, str]:
    """For `inspect`: each cache tier's state, 'ready' or why it is not, in this device's order."""
    status = {}
    for tier in ordered(ORDER):
        payload, why = tier.ready(store)
        status[tier.name] = "ready" if payload else why
    return status


def target(store: NpyDir) -> Tier | None:
    """The cache tier loads of `store` use on this device: the first in the order that the policy asks for."""
    return next((t for t in ordered(ORDER) if t.wanted(store)), None)


def first_builds(store: NpyDir) -> list[Tier]:
    """The tiers the cold path builds: the one loads will take where this device caches by default (order.CACHES),
    or with a policy that names its tiers ("all"), every tier in it."""
    if store.manifest.policy.build == "all":
        return [t for t in ordered(ORDER) if t.wanted(store)]
    if not caches_by_default():
        return []
    return [t for t in [target(store)] if t is not None and not t.serves_from_store(store)]


def choice(store: NpyDir) -> tuple[str, str]:
    """(the tier `load(store)` takes now, why), for `inspect`."""
    why = reason()
    ready = next((t for t in ordered(ORDER) if t.ready(store)[0] is not None or t.serves_from_store(store)), None)
    if ready is not None and ready.ready(store)[0] is None:
        return ready.name, (f"the first tier in the order {_names()}, read straight from the store, which holds it in "
                            f"MLX's packing: no copy is written ({why})")
    if ready is not None:
        return ready.name, f"the first ready tier in the order {_names()} ({why})"
    goals = first_builds(store)
    if not goals:
        if target(store) is not None:
            return COLD.name, "no cache tier is ready, and on this device none is faster than the store itself"
        return COLD.name, "no cache tier is ready and the policy asks for none"
    return COLD.name, f"no cache tier is ready; this load builds tier {goals[0].name}, later loads take it ({why})"


def _names() -> str:
    return " > ".join(t.name for t in ordered(ORDER))


__all__ = ["ORDER", "COLD", "TIERS", "BY_NAME", "TIER_NAMES", "Loaded", "Tier", "tier_status", "target",
           "first_builds", "choice", "ordered"]
