"""Getting memory ready for a load ahead of it (squishlike/memory.py does the work), for a caller with other work to
do first: loader.load imports mlx_lm and builds the tokenizer meanwhile."""

from __future__ import annotations

from .. import memory
from ..npydir import NpyDir
from . import COLD, ORDER, TIERS
from .order import ordered


def release_memory() -> None:
    """Drop a prepare_memory() reservation when the load it was made for will not happen (an error before it)."""
    memory.release()


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
        # A tier read from the store has no sentinel payload: its read prefetches its parts itself.
        chosen, payload = next(((t, p or {}) for t in candidates
                                if (p := t.ready(store)[0]) is not None or t.serves_from_store(store)), (None, None))
        if chosen is None:
            return False  # an unknown tier or one that is not ready: load_weights says why
        files, nbytes = [store.path / rel for rel in payload.get("files", {})], chosen.nbytes(store)
    except (OSError, ValueError, KeyError):
        return False
    memory.prefetch(files)
    return memory.reserve(nbytes) if nbytes else False
