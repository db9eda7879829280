"""The cold path: holding the directory lock, build the tier the order will use (the first the manifest's policy
asks for), so the next process takes a fast path, and serve this load the same model the next one gets.

A dense tier is built from the cold tier's dequantized buffers, which serve this load (by default on a background
thread that holds the lock, after the load returns: background.py); a quantized tier is a repack of the store (only
its other tensors are dequantized), and this load reads it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import warnings

import numpy as np

from ..io.atomic import sweeping_temps
from ..io.lock import DirectoryLock
from ..npydir import NpyDir
from . import BY_NAME, COLD
from . import background as background_build
from .base import Loaded, Tier

log = logging.getLogger("squishlike")


def cold_and_build(store: NpyDir, goals: list[Tier], lazy: bool = False, recheck: bool = True,
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
