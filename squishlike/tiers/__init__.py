"""The decision tree (docs/format.md §9): the first ready cache tier in the device's order (tiers/order.py) serves
the load; the cold tier, last, is always ready.

Adding a cache tier means adding a module with a `Tier` subclass, one entry in ORDER and its name in
order.PREFERENCE.

Cold path: holding the directory lock, build the tier the order will use (the first the manifest's policy asks
for), so the next process takes a fast path, and serve this load the same model the next one gets: a dense tier
is built from the cold tier's dequantized buffers, which serve this load (by default on a background thread that
holds the lock, after the load returns: background.py); a quantized tier is a repack of the store (only its other
tensors are dequantized), and this load reads it back. A process that waited on the lock re-checks the cache
tiers first and loads the one its predecessor built instead of building it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import warnings
from collections.abc import Collection
from pathlib import Path

import numpy as np

from ..environment import switch
from ..errors import FormatError, TierNotReadyError
from ..io.atomic import remove_stale_temps, sweeping_temps
from ..io.checksum import check_files
from ..io.lock import DirectoryLock
from ..io.sentinel import ABSENT, sentinel_says_damaged
from ..npydir import NpyDir
from . import background as background_build
from . import fastmem
from .base import Loaded, Tier
from .cold import ColdTier
from .finalized import FinalizedTier
from .int8 import Int8Tier
from .mlx import MlxTier
from .order import caches_by_default, ordered, reason
from .quantized import Int3Tier, Int4Tier

log = logging.getLogger("squishlike")
wait_for_builds = background_build.wait_for_builds

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
    return [t for t in [target(store)] if t is not None]


def choice(store: NpyDir) -> tuple[str, str]:
    """(the tier `load(store)` takes now, why), for `inspect`."""
    why = reason()
    ready = next((t for t in ordered(ORDER) if t.ready(store)[0] is not None), None)
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


def prune(store: NpyDir, keep: Collection[str]) -> dict[str, int]:
    """Remove every cache tier not named in `keep`, and temporaries a killed writer left, holding the directory
    lock (a load building a tier finishes first). The store itself is never touched; a later load that needs a
    removed tier rebuilds it. A process reading a tier's files keeps its open files (POSIX). Returns the bytes
    freed by tier."""
    unknown = set(keep) - {t.name for t in ORDER}
    if unknown:
        raise ValueError(f"unknown tier {', '.join(sorted(unknown))}; choose from {', '.join(t.name for t in ORDER)}")
    freed = {}
    with DirectoryLock(store.path):
        remove_stale_temps(store.path)
        for tier in ordered(ORDER):
            if tier.name not in keep:
                freed[tier.name] = sum(_bytes_under(store.path / rel) for rel in tier.paths)
                tier.remove(store)
    return freed


def _bytes_under(path: Path) -> int:
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


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
        return _cold_and_build(store, first_builds(store), lazy, recheck=not damaged, verify=verify,
                               background=background_build.background_wanted())
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
        candidates = [*ordered(ORDER), COLD] if tier is None else [t for t in TIERS if t.name == tier]
        chosen, payload = next(((t, p) for t in candidates if (p := t.ready(store)[0]) is not None), (None, None))
        if payload is None:
            return False  # an unknown tier or one that is not ready: load_weights says why
        files, nbytes = [store.path / rel for rel in payload.get("files", {})], chosen.nbytes(store)
    except (OSError, ValueError, KeyError):
        return False
    fastmem.prefetch(files)
    return fastmem.reserve(nbytes) if nbytes else False


def _load_forced(store: NpyDir, tier: str, lazy: bool = False, verify: bool = False) -> Loaded:
    """The named tier's weights; one the policy asks for but never built (no sentinel at all) is built now (cold
    path). Any other tier that is not ready is an error: a stale, damaged or foreign sentinel is never trusted and
    never silently replaced by a forced load."""
    if tier not in BY_NAME:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIER_NAMES)}")
    chosen = BY_NAME[tier]
    payload, why = chosen.ready(store)
    if payload is not None:
        _say_if_slower(store, chosen)
        if chosen is COLD:  # it checks the store's files as it loads them
            return COLD.load(store, verify=verify)
        if verify:
            _check_tier_files(store, chosen, payload)
        return chosen.load(store, lazy=lazy)
    if chosen is not COLD and chosen.wanted(store) and why == ABSENT:
        _cold_and_build(store, [chosen], lazy, verify=verify)
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


def _check_tier_files(store: NpyDir, tier: Tier, payload: dict) -> None:
    """IntegrityError naming the first file of a cache tier that differs from any hash its sentinel records."""
    check_files((store.path / tier.sentinel).parent, payload["files"], every=True)


def _first_ready(store: NpyDir, lazy: bool = False, damaged: list[str] | None = None,
                 verify: bool = False) -> Loaded | None:
    """The first ready tier's weights. With `damaged`, stop at the first tier whose files are damaged (missing,
    wrong size, unreadable header), name it there and return None, so the caller rebuilds it."""
    for tier in ordered(ORDER):
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
            if verify:
                _check_tier_files(store, tier, payload)
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


def _cold_and_build(store: NpyDir, goals: list[Tier], lazy: bool = False, recheck: bool = True,
                    verify: bool = False, background: bool = False) -> Loaded:
    """The cold path: build `goals` under the lock, and return the weights later loads get from the first of them
    (the tier they take): the dense buffers a dense tier was written from, or the quantized tier read back.
    `verify`: the store's files are checked against every hash recorded, not only the fast one. `background`:
    when the first goal is dense, return its buffers as soon as they are dequantized and checked, and build on
    a thread that holds the lock until it is done (background.py)."""
    if not goals:
        return COLD.load(store, verify=verify)  # the policy asks for no cache
    lock = DirectoryLock(store.path)
    try:
        lock.acquire()
    except OSError as e:  # read-only directory: load cold, build nothing
        log.warning("%s: cannot lock (%s); loading from the store without building caches", store.path, e)
        return COLD.load(store, verify=verify)
    handed_off = False
    try:
        for goal in goals:  # refused before any work, whether the build runs here or in the background
            goal.check_own_directory(store)
        first = goals[0]
        if recheck and first.ready(store)[0] is not None:  # built by the process we waited for
            return first.load(store, lazy=lazy)
        needed = set().union(*(t.needs_dense(store) for t in goals))
        dense_first = first.needs_dense(store) == set(store.entries)
        if background and dense_first:
            loaded, dense = COLD.load_dense(store, only=needed, verify=verify)  # a damaged store raises here
            handed_off = True  # first: once the thread runs, it owns the lock, whatever lands here (Ctrl-C)
            try:
                background_build.start(f"{store.path} tier {', '.join(t.name for t in goals)}",
                                       lambda: _build_and_release(store, dense, goals, lock))
            except Exception:  # no thread to hand it to
                handed_off = False
                raise
            return loaded
        with sweeping_temps(store.path), build_progress(store, goals) as progress:
            loaded, dense = COLD.load_dense(store, only=needed, verify=verify)
            progress.update()
            built = build_tiers(store, dense, goals, progress)
        say_built(store, built)  # after the progress bar, not inside it
        if dense_first:
            return loaded
        # A quantized tier: this load reads back what it built (page cache), as every later load will.
        if first.name in built:
            return dataclasses.replace(first.load(store, lazy=lazy), tier=COLD.name)
        return loaded if len(dense) == len(store.entries) else COLD.load(store, verify=verify)
    finally:
        if not handed_off:
            lock.release()


def _build_and_release(store: NpyDir, dense: dict[str, np.ndarray], goals: list[Tier], lock: DirectoryLock) -> None:
    """A background build (background.py): the tiers, then the lock the load took for them."""
    try:
        with sweeping_temps(store.path):
            say_built(store, build_tiers(store, dense, goals))
    finally:
        lock.release()


def build_tiers(store: NpyDir, dense: dict[str, np.ndarray], tiers: list[Tier], progress=None) -> list[str]:
    """Build those of `tiers` the policy wants that are not ready yet, from `dense` (canonical name -> the cold
    tier's buffer, for each tier's needs_dense). The caller holds the lock. Returns those built (say_built tells
    the user)."""
    built = []
    for tier in tiers:
        if not tier.wanted(store) or tier.ready(store)[0] is not None:
            continue
        try:
            tier.build(store, dense)
            built.append(tier.name)
        except OSError as e:  # disk full, read-only: the load still succeeds from the cold weights
            warnings.warn(f"{store.path}: could not build tier {tier.name} ({e}); it stays unbuilt")
        if progress is not None:
            progress.update()
    return built


def say_built(store: NpyDir, built: list[str]) -> None:
    """Say once what the tiers a load `built` added to the store's size on disk (a warning-level log line, which
    Python prints even where logging was never set up): a first load that grows a 0.9 GB store to 2.1 GB should
    not do it silently."""
    if built:
        added = sum(BY_NAME[name].disk_bytes(store) for name in built)
        log.warning("%s: wrote the cache tier %s for faster loads (%.1f MB more on disk); `squishlike prune %s` "
                    "removes it", store.path, " and ".join(built), added / 1e6, store.path)


@contextlib.contextmanager
def build_progress(store: NpyDir, goals: list[Tier]):
    """A progress bar on a terminal (stderr) over the first load's steps: dequantize, then build each tier."""
    from tqdm.auto import tqdm

    names = ", ".join(t.name for t in goals)
    with tqdm(total=1 + len(goals), desc=f"{store.path.name}: first load, building tier {names}", unit="step",
              disable=None, file=sys.stderr) as bar:
        yield bar


__all__ = ["ORDER", "COLD", "TIERS", "BY_NAME", "TIER_NAMES", "Loaded", "Tier", "load_weights", "build_tiers", "tier_status",
           "target", "first_builds", "choice", "ordered", "prune",
           "prepare_memory", "release_memory", "verify_wanted", "wait_for_builds"]
