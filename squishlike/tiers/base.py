"""What every tier is: a sentinel that says "ready", a way to load, a way to build from the store.

A tier declares its files once: `sentinel` and `paths`. Its readiness (a sentinel that records only files of the
tier), `verify`, `inspect` (disk_bytes), `prune` (remove) and the refusal of linked tier directories all derive
from that declaration, so a new tier cannot forget one of them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from pathlib import Path
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from ..arch import architecture_for
from ..dtypes import MX_DTYPES, NP_STORAGE, to_mx
from ..errors import FormatError
from ..io import checksum
from ..io.checksum import verify_files
from ..io.lock import DirectoryLock
from ..io.sentinel import moved, read_sentinel, rebind
from ..npydir import NpyDir

log = logging.getLogger("squishlike")


@dataclass
class Loaded:
    """Weights by mlx_lm parameter name, the config.json dict to build the model with, and who served them."""

    weights: dict[str, mx.array]
    config: dict
    tier: str


class Tier(ABC):
    name: ClassVar[str]
    sentinel: ClassVar[str]  # path of the sentinel file, relative to the npy-dir
    paths: ClassVar[tuple[str, ...]]  # every other file and directory the tier writes, relative to the npy-dir

    def wanted(self, store: NpyDir) -> bool:
        """Whether the store's cache policy asks for this tier (and the store can feed it)."""
        return self.name in store.manifest.policy.tiers and self.unavailable(store) is None

    def unavailable(self, store: NpyDir) -> str | None:
        """Why this store can never feed this tier, whatever its policy; None when it can."""
        return None

    def serves_from_store(self, store: NpyDir) -> bool:
        """Whether loads on this device read this tier straight from the store (a quantized tier: quantized.py),
        so it is never built by default."""
        return False

    def from_store(self, store: NpyDir, lazy: bool = False, verify: bool = False) -> Loaded:
        raise NotImplementedError(f"tier {self.name} is always built, never read from the store")

    def ready(self, store: NpyDir) -> tuple[dict | None, str]:
        link = self.link_on_the_way(store)
        if link is not None:
            return None, f"{link.relative_to(store.path)} is a symbolic link out of the directory"
        payload, why = read_sentinel(store.path / self.sentinel, store.fingerprint)
        base = Path(self.sentinel).parent
        stranger = next((rel for rel in (payload or {}).get("files", {}) if not self.owns(base / rel)), None)
        if stranger is not None:
            return None, f"it records {stranger}, which is not a file of tier {self.name}"
        return payload, why

    def owns(self, rel: str | Path) -> bool:
        """Whether `rel` (relative to the npy-dir) is one of the tier's files: its sentinel, or under its paths."""
        rel = Path(rel)
        return rel == Path(self.sentinel) or any(rel == Path(p) or Path(p) in rel.parents for p in self.paths)

    def link_on_the_way(self, store: NpyDir) -> Path | None:
        """The first directory between the store and the tier's sentinel that is a symbolic link (a tier
        directory leading elsewhere), or None."""
        path = store.path
        for part in Path(self.sentinel).parent.parts:
            path = path / part
            if path.is_symlink():
                return path
        return None

    def check_files(self, store: NpyDir, payload: dict, verify: bool = False) -> None:
        """Before a ready tier (`payload`: its sentinel, as ready() read it) is served: IntegrityError naming the
        first of its files whose bytes are not the ones its sentinel records. Without `verify`, only the files
        whose identity is not the one recorded (io/sentinel.py: replaced since, or the store copied) are hashed,
        with the fast hash; the others cost a stat. With `verify`, every file and every hash. Files found intact
        have their identity recorded again, when the tier's lock is free, so the next load only stats them."""
        sentinel = store.path / self.sentinel
        found = moved(sentinel, payload)
        files = payload["files"] if verify else {rel: record for rel, (record, _) in found.items()}
        if not files:
            return
        checksum.check_files(sentinel.parent, files, every=verify)
        if found:
            self._rebind(store, payload, found)

    def _rebind(self, store: NpyDir, payload: dict, checked: dict) -> None:
        """Record the identities of files just checked, under the tier's lock, never waiting for it: a writer holding
        it (a build, a background build of this process) may be replacing the tier. Where it cannot be taken (a
        read-only store), each load hashes those files again."""
        try:
            lock = self.lock(store)
            if not lock.acquire(blocking=False):
                return
        except (OSError, FormatError) as e:
            log.info("%s: cannot record tier %s's files as checked (%s); each load hashes them", store.path,
                     self.name, e)
            return
        try:
            if self.ready(store)[0] == payload:  # not rebuilt or removed since it was read
                rebind(store.path / self.sentinel, payload, checked)
        except OSError as e:
            log.info("%s: cannot record tier %s's files as checked (%s)", store.path, self.name, e)
        finally:
            lock.release()

    def lock(self, store: NpyDir) -> DirectoryLock:
        """The lock every writer of this tier holds: the store's directory lock."""
        return DirectoryLock(store.path)

    def check_own_directory(self, store: NpyDir) -> None:
        """FormatError naming a tier directory that is a symbolic link: nothing is written, emptied or unlinked
        through one, so a planted link never leads a build or a prune outside the store."""
        link = self.link_on_the_way(store)
        if link is not None:
            raise FormatError(link, f"is a symbolic link; squishlike writes tiers of {store.path} only inside it")

    def nbytes(self, store: NpyDir) -> int:
        """About how many bytes of memory a load from this tier fills (to reserve them ahead, squishlike/memory.py)."""
        return runtime_bytes(store)

    def needs_dense(self, store: NpyDir) -> set[str]:
        """The canonical names whose dequantized buffers build() reads: every tensor, unless the tier repacks some."""
        return set(store.entries)

    def verify(self, store: NpyDir) -> list[str]:
        """For `verify`: each file of the tier that differs from any hash its sentinel records, or why a sentinel
        that is there does not count; [] when all is well or the tier was never built."""
        sentinel = store.path / self.sentinel
        payload, why = read_sentinel(sentinel, store.fingerprint)
        if payload is not None:
            return [f"tier {self.name}: {p}" for p in verify_files(sentinel.parent, payload["files"])]
        return [f"tier {self.name}: {sentinel} does not count ({why})"] if sentinel.exists() else []

    def disk_bytes(self, store: NpyDir) -> int:
        """The bytes of the tier's files on disk, as its sentinel records them; 0 when it is not ready."""
        payload, _ = self.ready(store)
        return sum(record["size"] for record in payload["files"].values()) if payload else 0

    def remove(self, store: NpyDir) -> None:
        """Delete the tier's sentinel, then its files (`paths`); a path that is a link, the link itself, never
        what it leads to. The caller holds the directory lock."""
        for rel in self.paths:
            if (store.path / rel).is_symlink():
                (store.path / rel).unlink()
        self.invalidate(store)
        for rel in self.paths:
            path = store.path / rel
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def invalidate(self, store: NpyDir) -> None:
        """Remove the sentinel first, so the tier never counts as ready while its files are being replaced; never
        through a linked tier directory (check_own_directory)."""
        self.check_own_directory(store)
        with contextlib.suppress(FileNotFoundError):
            (store.path / self.sentinel).unlink()

    @abstractmethod
    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        """The tier's weights, evaluated (in memory) unless `lazy`, as mlx_lm.load(lazy=...) leaves them."""

    @abstractmethod
    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        """Build from the cold tier's dequantized tensors (canonical name -> runtime dtype, bf16 as uint16)."""


def runtime_bytes(store: NpyDir) -> int:
    """The bytes of every tensor of the store in the runtime dtype: what the dense tiers hold in memory."""
    itemsize = np.dtype(NP_STORAGE[store.runtime_dtype]).itemsize
    return sum(math.prod(e.shape) * itemsize for e in store.entries.values())


def mlx_names(store: NpyDir) -> dict[str, str]:
    """canonical name -> mlx_lm parameter name, for every tensor of the store."""
    if store.manifest.naming == "mlx":
        return {name: name for name in store.entries}
    arch = architecture_for(store.manifest.model_type)
    return {name: arch.mlx_name(name) for name in store.entries}


def keep_uncast(model, store: NpyDir, lazy: bool = False, kept: dict | None = None) -> None:
    """Give `model` (built from any tier of `store`) the parameters its own `cast_predicate` keeps out of the model's
    dtype in their stored dtype, as mlx_lm.load of the source gives them: mlx_lm.convert casts every float but those
    (qwen3_5's A_log, MoE routers' correction biases stay float32). Every tier holds the runtime dtype; the store
    keeps a passthrough tensor's exact source values in its source dtype (docs/format.md §5), so those few small
    tensors are read back from it. `kept`: a rank's share (sharded.Plan.kept, mlx_lm name -> None for the whole
    tensor or (axis, indices) for the part kept), whose parameters take only their part."""
    predicate = getattr(model, "cast_predicate", None)
    if predicate is None:
        return
    exact = []
    for name, mlx_name in mlx_names(store).items():
        entry = store.entries[name]
        if (entry.kind.quantized or entry.stored_dtype == store.runtime_dtype or entry.stored_dtype not in MX_DTYPES
                or predicate(mlx_name) or (kept is not None and mlx_name not in kept)):
            continue
        values = np.asarray(store.load_part(name, entry.kind.suffixes[0]))
        if kept is not None and kept[mlx_name] is not None:
            axis, index = kept[mlx_name]
            values = values.take(index, axis=axis)
        exact.append((mlx_name, to_mx(np.ascontiguousarray(values), entry.stored_dtype)))
    if exact:
        model.load_weights(exact, strict=False)
        if not lazy:
            mx.eval([array for _, array in exact])
