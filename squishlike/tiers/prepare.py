"""Getting memory ready for a load ahead of it (squishlike/memory.py does the work), for a caller with other work to
do first: loader.load imports mlx_lm and builds the tokenizer meanwhile."""

from __future__ import annotations

from .. import memory
from ..npydir import NpyDir
from . import Plan, decide


def release_memory() -> None:
    """Drop a prepare_memory() reservation when the load it was made for will not happen (an error before it)."""
    memory.release()


def prepare_memory(store: NpyDir, tier: str | None = None, lazy: bool = False, plan: Plan | None = None) -> bool:
    """Get ready, on background threads, for load_weights(store, tier) (or for `plan`, the load's own): fault in
    the memory it will fill, and ask the kernel to read ahead the files it will read if they are not in the page
    cache.

    For a caller with other work to do first (importing mlx_lm and transformers, building the tokenizer: ~1 s):
    getting fresh memory is most of a warm load, and reading the disk most of a cold one (docs/design.md §3.1);
    both can run beside that work instead of after it. load_weights then uses the reservation (or releases it).
    Cheap: it only reads sentinels (none, given the plan). Returns whether memory was reserved."""
    if lazy:
        return False
    try:
        plan = plan if plan is not None else decide(store, tier)
        files, nbytes = plan.files(store), plan.nbytes(store)
    except (OSError, ValueError, KeyError):  # an unknown tier, an unreadable sentinel: load_weights says why
        return False
    memory.prefetch(files, store.path)
    return memory.reserve(nbytes) if nbytes else False
