"""Removing cache tiers (`squishlike prune`): each tier's declared files (base.Tier.paths), under the directory lock,
and the rank shares (rank.prune_shares), each under its layout's lock."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from ..io.atomic import remove_stale_temps
from ..io.lock import DirectoryLock
from ..npydir import NpyDir
from . import ORDER
from .order import ordered
from .rank import RankTier, prune_shares

SHARES = RankTier.name  # what `keep` names to keep every rank share


def prune(store: NpyDir, keep: Collection[str]) -> dict[str, int]:
    """Remove every cache tier not named in `keep`, and temporaries a killed writer left, holding the directory
    lock (a load building a tier finishes first); and every rank share, unless `keep` names "rank". The store
    itself is never touched; a later load that needs a removed tier rebuilds it, a later launch its share. A process
    reading a tier's files keeps its open files (POSIX). Returns the bytes freed by tier ("rank": all shares)."""
    known = [t.name for t in ORDER] + [SHARES]
    unknown = set(keep) - set(known)
    if unknown:
        raise ValueError(f"unknown tier {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    freed = {}
    with DirectoryLock(store.path):
        remove_stale_temps(store.path)
        for tier in ordered(ORDER):
            if tier.name not in keep:
                freed[tier.name] = sum(_bytes_under(store.path / rel) for rel in tier.paths)
                tier.remove(store)
        if SHARES not in keep:
            freed[SHARES] = prune_shares(store)
    return freed


def _bytes_under(path: Path) -> int:
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
