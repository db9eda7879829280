"""The decision tree (docs/format.md §9): the first ready cache tier in the device's order (tiers/order.py) serves
the load; the cold tier, last, is always ready.

Here: the tiers, and which of them a load takes or builds, decided once per load as a `Plan` (`decide`), which
memory preparation (prepare.py), the load (load.py) and `inspect` all read: none of them walks the order again.
How a load runs the plan is load.py; the cold path that builds a tier, build.py; removing tiers, prune.py; getting
memory ready ahead of a load, prepare.py.
Each tier declares the files it writes once (base.Tier.sentinel and paths), and all of them derive from that.

Adding a cache tier means adding a module with a `Tier` subclass, one entry in ORDER and its name in
order.PREFERENCE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..io.sentinel import ABSENT, sentinel_says_damaged
from ..npydir import NpyDir
from .base import Loaded, Tier, runtime_bytes
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


# Where a plan's weights come from
BUILT = "built"  # the tier's own files, which its sentinel records
STORE = "store"  # the store's parts, read straight into the tier's arrays (a quantized tier, order.FROM_STORE)
COLD_PATH = "cold"  # the store dequantized (tiers/cold.py); the cold path builds `builds` from the same buffers
MISSING = "missing"  # a forced tier that is not ready: built first when `builds` names it, refused otherwise


@dataclass(frozen=True)
class Plan:
    """What one load of a store does, decided once by the decision tree (`decide`, docs/format.md §9): the tier that
    serves it, where its bytes come from (`source`), what it builds, and why. Memory preparation, the load and
    `inspect` read it; a tier found damaged is named, for the load to remove and rebuild."""

    tier: Tier
    source: str  # BUILT, STORE, COLD_PATH or MISSING
    why: str
    payload: dict | None = None  # BUILT: the tier's sentinel (its files)
    builds: tuple[Tier, ...] = ()  # what the cold path builds (COLD_PATH), or builds before loading (MISSING)
    damaged: Tier | None = None  # a tier whose sentinel says its files are damaged: removed, then rebuilt
    state: str = ""  # the sentinel's verdict on `damaged`, or on a MISSING tier
    forced: bool = False  # load(tier=...) asked for this tier

    def files(self, store: NpyDir) -> list[Path]:
        """The files the load reads, to read ahead (a tier read from the store reads ahead its own parts)."""
        if self.source == BUILT:
            return [store.path / Path(self.tier.sentinel).parent / rel for rel in self.payload.get("files", {})]
        if self.source == COLD_PATH:
            return [store.path / rel for rel in store.part_files()]
        return []

    def nbytes(self, store: NpyDir) -> int:
        """About the bytes of memory the load fills (to reserve them ahead): the store's parts where the tier is
        read from them, the dense model on the cold path; 0 for a tier not ready."""
        if self.source == STORE:  # the parts' own bytes (format 2's packs also hold the gaps between them)
            return sum(record.size for entry in store.entries.values() for record in entry.files.values())
        if self.source == COLD_PATH:
            return runtime_bytes(store)
        return self.tier.nbytes(store) if self.source == BUILT else 0


def decide(store: NpyDir, tier: str | None = None) -> Plan:
    """The plan of a load of `store`: the forced `tier`, or the first ready tier in this device's order, one read
    straight from the store where the order says so, or the cold path with what it builds. A damaged tier met on
    the way sends the load to the cold path, which rebuilds it. ValueError for an unknown tier name."""
    if tier is not None:
        return _decide_forced(store, tier)
    why = reason()
    for t in ordered(ORDER):
        payload, state = t.ready(store)
        if payload is not None:
            return Plan(t, BUILT, f"the first ready tier in the order {_names()} ({why})", payload)
        if t.serves_from_store(store):
            return Plan(t, STORE, f"the first tier in the order {_names()}, read straight from the store, which "
                                  f"holds it in MLX's packing: no copy is written ({why})")
        if sentinel_says_damaged(state) and t.wanted(store):
            goals = tuple(first_builds(store))
            return Plan(COLD, COLD_PATH, f"tier {t.name} is damaged ({state}): this load removes it and loads from "
                                         "the store, rebuilding what the policy builds", builds=goals, damaged=t,
                        state=state)
    goals = tuple(first_builds(store))
    if goals:
        return Plan(COLD, COLD_PATH, f"no cache tier is ready; this load builds tier {goals[0].name}, later loads "
                                     f"take it ({why})", builds=goals)
    if target(store) is not None:
        return Plan(COLD, COLD_PATH, "no cache tier is ready, and on this device none is faster than the store "
                                     "itself")
    return Plan(COLD, COLD_PATH, "no cache tier is ready and the policy asks for none")


def _decide_forced(store: NpyDir, name: str) -> Plan:
    """load(tier=name): that tier, from its files, from the store, or (one the policy asks for but never built: no
    sentinel at all) built first; any other tier that is not ready is MISSING with nothing to build, and refused:
    a stale, damaged or foreign sentinel is never trusted and never silently replaced by a forced load."""
    if name not in BY_NAME:
        raise ValueError(f"unknown tier {name!r}; choose one of {', '.join(TIER_NAMES)}")
    chosen = BY_NAME[name]
    why = f"forced with tier={name}"
    if chosen is COLD:
        return Plan(COLD, COLD_PATH, why, forced=True)
    payload, state = chosen.ready(store)
    if payload is not None:
        return Plan(chosen, BUILT, why, payload, forced=True)
    if chosen.serves_from_store(store):
        return Plan(chosen, STORE, f"{why}, read straight from the store", forced=True)
    builds = (chosen,) if chosen.wanted(store) and state == ABSENT else ()
    return Plan(chosen, MISSING, why, builds=builds, state=state, forced=True)


def choice(store: NpyDir) -> tuple[str, str]:
    """(the tier `load(store)` takes now, why), for `inspect`: the load's own plan."""
    plan = decide(store)
    return plan.tier.name, plan.why


def _names() -> str:
    return " > ".join(t.name for t in ordered(ORDER))


__all__ = ["ORDER", "COLD", "TIERS", "BY_NAME", "TIER_NAMES", "Loaded", "Tier", "Plan", "tier_status", "target",
           "first_builds", "decide", "choice", "ordered", "BUILT", "STORE", "COLD_PATH", "MISSING"]
