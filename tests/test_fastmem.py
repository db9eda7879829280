"""The fast-memory path of a load (tiers/fastmem.py, loader.load): memory faulted in ahead on a background thread,
MLX's buffers carved from it, the tokenizer built beside the weights. It changes where bytes land, never what they
are; and a fresh process that loads, generates and exits must exit cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_models import assert_same_weights

import squishlike
from squishlike.tiers import fastmem

TIERS = ("int4", "mlx", "finalized", "cold")


@pytest.fixture
def int4_store(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "int4", format="int4", tiers=("mlx", "finalized", "int4"))
    squishlike.load(out)  # first load builds the caches
    return out


@pytest.mark.skipif(fastmem._glibc() is None, reason="huge-page arena needs Linux glibc with THP not disabled")
def test_prefaulted_arena_loads_identical_weights(int4_store, monkeypatch):
    # The tiny model is far below the size where the arena pays; lower the bar so this load takes that path.
    reference = {tier: squishlike.load(int4_store, tier=tier) for tier in TIERS}
    monkeypatch.setattr(fastmem, "MIN_ARENA", 0)
    for tier in TIERS:
        fastmem.last_populate.clear()
        model, tokenizer = squishlike.load(int4_store, tier=tier)
        assert fastmem.last_populate.get("bytes", 0) > 0, f"{tier}: the load did not use a pre-faulted arena"
        assert_same_weights(reference[tier][0], model)
        text = "The capital of France"
        assert tokenizer.encode(text) == reference[tier][1].encode(text)
        assert tokenizer.eos_token_ids == reference[tier][1].eos_token_ids
    assert fastmem._pending is None  # every reservation was used or given back


@pytest.mark.skipif(fastmem._glibc() is None, reason="huge-page arena needs Linux glibc with THP not disabled")
def test_reservation_released_when_the_load_fails(int4_store, monkeypatch):
    monkeypatch.setattr(fastmem, "MIN_ARENA", 0)
    (int4_store / "tokenizer.json").write_text("{not json")
    with pytest.raises(squishlike.errors.FormatError, match="tokenizer"):
        squishlike.load(int4_store, tier="mlx")
    assert fastmem._pending is None


@pytest.mark.parametrize("tier", ["mlx", "cold"])
def test_fresh_process_loads_generates_and_exits_cleanly(int4_store, tier):
    # mlx_lm is imported by load itself here, not before it: its import creates an MLX stream, which must be made
    # on the main thread (one made on a worker thread aborted the process at exit, in most runs, not all: so 3).
    load = f"import sys, squishlike\nmodel, tokenizer = squishlike.load(sys.argv[1], tier={tier!r})\n"
    generate = "import mlx_lm\nprint(repr(mlx_lm.generate(model, tokenizer, 'The capital of France is', max_tokens=4)))\n"
    for script in (load, load, load, load + generate):
        done = subprocess.run([sys.executable, "-c", script, str(int4_store)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("'")
