"""Tier `rank`: one rank's share of a sharded load (squishlike.sharded_load), cached for the next launch.

`shards/{key}/weights.safetensors` holds exactly the weights the rank keeps (mlx_lm parameter names, the shapes
after `shard()`, only the layers of its pipeline stage), in the runtime dtype; `shards/{key}/.ready` is its
sentinel. The key names the layout: mode, world size and rank ("tensor-2-0", "pipeline-4-3",
"pipeline-2-1.tensor-2-0"), so ranks that share one directory never write the same files. The sentinel also
records the plan's fingerprint (every kept tensor, the axis it was cut along and the indices kept), so a model
code whose split changed, or another store, never serves stale slices. Built as the finalized tier is: filled
under a temporary name, published in one rename, under the layout's own lock. Loaded as the other safetensors
tiers are: its header checked first to be exactly the one written for the plan's shapes (check_layout), since
mx.load alone would read a header whose offsets overlap or whose shapes lie.

`inspect` and `verify` know no plan (it comes from a launch): they list every cached layout (`cached`) and judge
each by its sentinel against the store as it is now, whatever split made it. `prune` removes every layout's share
(`prune_shares`), each under its own lock.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..formats.safetensors import Tensor, write_safetensors
from ..io.atomic import make_temp_dir, publish_dir, remove_stale_temps, sweeping_temps
from ..io.lock import DirectoryLock
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir
from .base import Loaded, Tier, mlx_names
from .mlx import ALIGN, METADATA, load_safetensors

DIRECTORY = "shards"
WEIGHTS = "weights.safetensors"


class RankTier(Tier):
    name = "rank"

    def __init__(self, key: str, plan: str | None = None, shapes: dict[str, tuple[int, ...]] | None = None):
        self.key = key  # the layout: "tensor-2-0", "pipeline-2-1", ...
        self.plan = plan  # fingerprint of the kept slices; None: any split (inspect, verify, which never load it)
        self.shapes = shapes or {}  # mlx_lm name -> the shape of the rank's part of it, in the order the build writes
        self.sentinel = f"{DIRECTORY}/{key}/.ready"
        self.paths = (f"{DIRECTORY}/{key}",)

    @classmethod
    def cached(cls, store: NpyDir) -> list[RankTier]:
        """One tier, with no plan, per layout with a directory under shards/, ready or not (a build's temporary
        directory, named with a leading dot, left out)."""
        directory = store.path / DIRECTORY
        if not directory.is_dir():
            return []
        return [cls(p.name) for p in sorted(directory.iterdir()) if p.is_dir() and not p.name.startswith(".")]

    def wanted(self, store: NpyDir) -> bool:
        return True  # asked for by launching sharded

    def ready(self, store: NpyDir) -> tuple[dict | None, str]:
        payload, why = super().ready(store)
        if payload is not None and self.plan is not None and payload.get("plan") != self.plan:
            return None, "made for another split of the model"
        return payload, why

    def nbytes(self, store: NpyDir) -> int:
        return (store.path / DIRECTORY / self.key / WEIGHTS).stat().st_size

    def disk_bytes(self, store: NpyDir) -> int:
        """The bytes of the files in the share's directory, ready or not: nothing removes a share made for another
        manifest or layout, so a stale one still takes its space. A directory that is a link counts nothing."""
        directory = store.path / DIRECTORY / self.key
        if directory.is_symlink() or not directory.is_dir():
            return 0
        return sum(f.lstat().st_size for f in directory.iterdir() if f.is_file() and not f.is_symlink())

    def tensors(self, store: NpyDir) -> list[Tensor]:
        """What the share's file holds, in order: each kept part in the runtime dtype."""
        return [Tensor(name, store.runtime_dtype, shape, None) for name, shape in self.shapes.items()]

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        """The share; FormatError naming its file when the header is not the one written for `shapes`."""
        weights = load_safetensors(store.path / DIRECTORY / self.key / WEIGHTS, self.tensors(store), store.path,
                                   lazy=lazy)
        return Loaded(weights, store.config(), self.name)

    def lock(self, store: NpyDir) -> DirectoryLock:
        """The lock every writer of this layout's share holds (`build` needs it held): one per layout, not the
        store's, so the ranks of a launch sharing one directory build their shares at once, not one after the
        other (they write disjoint files: shards/KEY/ and its temporaries, .KEY.tmp-*). Never in a linked shards/."""
        self.check_own_directory(store)
        (store.path / DIRECTORY).mkdir(exist_ok=True)
        return DirectoryLock(store.path / DIRECTORY, f".{self.key}.lock")

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        """`dense`: the rank's slices by canonical name, runtime dtype (bf16 as uint16). The caller holds
        `self.lock(store)`."""
        self.invalidate(store)
        final = store.path / DIRECTORY / self.key
        final.parent.mkdir(exist_ok=True)
        with sweeping_temps(final.parent, self.key):  # the lock keeps out live builds of this key
            tmp = make_temp_dir(final)
            names = mlx_names(store)
            tensors = [Tensor(names[n], store.runtime_dtype, a.shape, a) for n, a in dense.items()]
            record = write_safetensors(tmp / WEIGHTS, tensors, METADATA, atomic=False, align=ALIGN)
            write_sentinel(tmp / ".ready", manifest_fingerprint=store.fingerprint, files={WEIGHTS: record},
                           tier=self.name, layout=self.key, plan=self.plan)
            publish_dir(tmp, final)


def prune_shares(store: NpyDir) -> int:
    """Remove every layout's share, ready, stale or half-built (`squishlike prune`): each under its layout's lock,
    so a launch building it finishes first, with its temporaries and, last, its lock file (unlinked while held: a
    launch waiting on it then locks the new file a later build creates, DirectoryLock.acquire). A linked shards/ is
    removed itself, never emptied. Returns the bytes freed; a later launch reads its part of the store again."""
    directory = store.path / DIRECTORY
    if directory.is_symlink():
        directory.unlink()
        return 0
    if not directory.is_dir():
        return 0
    keys = {p.name for p in directory.iterdir() if not p.name.startswith(".")}
    keys |= {p.name[1:-len(".lock")] for p in directory.glob(".*.lock")}
    freed = 0
    for key in sorted(keys):
        share = RankTier(key)
        with DirectoryLock(directory, f".{key}.lock", leave_no_file=True):
            remove_stale_temps(directory, key)
            freed += share.disk_bytes(store)
            share.remove(store)
    with contextlib.suppress(OSError):  # a file or directory squishlike did not write stays, and so does shards/
        directory.rmdir()
    return freed
