"""The fast-memory path of a load (squishlike/memory.py, loader.load): memory faulted in ahead on a background thread
while mlx_lm imports, MLX's buffers carved from it. It changes where bytes land, never what they are; and a fresh
process that loads, generates and exits must exit cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import squishlike
from benchmarks.loadbench.pagecache import evict
from squishlike import memory as fastmem

TIERS = ("int4", "mlx", "finalized", "cold")


@pytest.fixture
def int4_store(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", tiers=("mlx", "finalized", "int4"))
    squishlike.load(out)  # first load builds the caches
    return out


# One fresh process per load, as a user's load runs: the arena carves MLX's buffers from a block only when the
# heap lets it put a guard right behind that block, which a long-lived heap (pytest's, or one that already holds
# another model) often does not; then the load simply runs without it.
_DIGESTS = """
import hashlib, json, logging, sys
import mlx.core as mx
import numpy as np
import squishlike
from mlx.utils import tree_flatten
from squishlike import memory as fastmem
fastmem.MIN_ARENA = 0  # the tiny model is far below the size where the arena pays: take that path anyway
arena = {}
class ArenaLog(logging.Handler):  # the arena's figures, from squishlike's debug log
    def emit(self, record):
        arena.update(getattr(record, "load_phases", {}).get("populate", {}))
logging.getLogger("squishlike").addHandler(ArenaLog())
logging.getLogger("squishlike").setLevel(logging.DEBUG)
model, tokenizer = squishlike.load(sys.argv[1], tier=sys.argv[2])
h = hashlib.sha256()
for name, value in sorted(tree_flatten(model.parameters())):
    raw = value.view(mx.uint16) if value.dtype == mx.bfloat16 else value  # NumPy has no bfloat16
    h.update(name.encode() + str(value.dtype).encode() + np.array(raw).tobytes())
print(json.dumps({"weights": h.hexdigest(), "tokens": tokenizer.encode("The capital of France"),
                  "arena_bytes": arena.get("bytes", 0), "pending": fastmem.reserved(),
                  "small_pages_slow": fastmem.small_pages_slow()}))
"""


def _digests(store, env: dict, evicted: bool = False) -> dict:
    out = {}
    for tier in TIERS:
        if evicted:  # then load() also asks the kernel to read the tier's files ahead (fastmem.prefetch)
            evict([f for f in store.rglob("*") if f.is_file()])
        done = subprocess.run([sys.executable, "-c", _DIGESTS, str(store), tier], capture_output=True, text=True,
                              timeout=300, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr[-2000:]
        out[tier] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not fastmem.available(), reason="huge-page arena needs Linux glibc with THP not disabled")
def test_prefaulted_arena_loads_identical_weights(int4_store):
    plain = _digests(int4_store, {"SQUISHLIKE_HUGEPAGES": "0"})
    arena = _digests(int4_store, {"SQUISHLIKE_HUGEPAGES": "1"}, evicted=True)
    for tier in TIERS:
        assert plain[tier]["arena_bytes"] == 0
        assert arena[tier]["arena_bytes"] > 0, f"{tier}: the load did not use a pre-faulted arena"
        assert arena[tier]["weights"] == plain[tier]["weights"], f"{tier}: the arena changed the weights"
        assert arena[tier]["tokens"] == plain[tier]["tokens"]
        assert not arena[tier]["pending"]  # every reservation was used or given back


@pytest.mark.skipif(not fastmem.available(), reason="huge-page arena needs Linux glibc with THP not disabled")
def test_unset_the_arena_is_used_where_the_process_measured_small_pages_slow(int4_store):
    measured = _digests(int4_store, {"SQUISHLIKE_HUGEPAGES": ""})
    forced = _digests(int4_store, {"SQUISHLIKE_HUGEPAGES": "1"})
    for tier in TIERS:
        slow = measured[tier]["small_pages_slow"]
        assert (measured[tier]["arena_bytes"] > 0) == slow, f"{tier}: small pages slow={slow}, the arena not so"
        assert measured[tier]["weights"] == forced[tier]["weights"]
        assert not measured[tier]["pending"]


@pytest.mark.skipif(not fastmem.available(), reason="huge-page arena needs Linux glibc with THP not disabled")
def test_reservation_released_when_the_load_fails(int4_store, monkeypatch):
    monkeypatch.setattr(fastmem, "MIN_ARENA", 0)
    monkeypatch.setenv("SQUISHLIKE_HUGEPAGES", "1")
    (int4_store / "tokenizer.json").write_text("{not json")
    with pytest.raises(squishlike.errors.FormatError, match="tokenizer"):
        squishlike.load(int4_store, tier="mlx")
    assert not fastmem.reserved()


@pytest.mark.parametrize("tier", ["mlx", "cold"])
def test_fresh_process_loads_generates_and_exits_cleanly(int4_store, tier):
    # mlx_lm is imported by load itself here, not before it: its import creates an MLX stream, which must be made
    # on the main thread (one made on a worker thread aborted the process at exit, in most runs, not all: so 3).
    load = f"import sys, squishlike\nmodel, tokenizer = squishlike.load(sys.argv[1], tier={tier!r})\n"
    generate = ("import mlx_lm\n"
                "print(repr(mlx_lm.generate(model, tokenizer, 'The capital of France is', max_tokens=4)))\n")
    for script in (load, load, load, load + generate):
        done = subprocess.run([sys.executable, "-c", script, str(int4_store)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("'")


def test_loads_on_other_threads_than_the_first(int4_store):
    """MLX streams belong to the thread that made them: a second load on another thread (a server loads each
    model away from its main thread) gets its own, and the same weights."""
    import threading

    from mlx.utils import tree_flatten

    first, _ = squishlike.load(int4_store)
    loaded = {}
    thread = threading.Thread(target=lambda: loaded.update(model=squishlike.load(int4_store)[0]))
    thread.start()
    thread.join(timeout=300)
    assert "model" in loaded
    expected = dict(tree_flatten(first.parameters()))
    for name, value in tree_flatten(loaded["model"].parameters()):
        assert (value == expected[name]).all().item(), name
