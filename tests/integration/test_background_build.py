"""The default first load: it returns once the store is dequantized and checked, and writes the dense tier it
will take on a background thread that holds the store's lock until the tier is published
(squishlike/tiers/background.py). The rest of the suite sets SQUISHLIKE_BACKGROUND_BUILD=0 (conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from support.tiny_models import assert_same_weights

import squishlike
from squishlike.errors import IntegrityError
from squishlike.io.lock import DirectoryLock
from squishlike.npydir import NpyDir
from squishlike.tiers import BY_NAME, background
from squishlike.tiers.background import wait_for_builds

WRITE = "before-rename:squish_weights.safetensors"  # the mlx tier's file, written and about to be published


@pytest.fixture
def store(tiny_llama, tmp_path):
    return squishlike.compress(tiny_llama, tmp_path / "int8", tiers=("mlx",))  # named: built on CPU too


@pytest.fixture
def in_background(monkeypatch):
    monkeypatch.setenv("SQUISHLIKE_BACKGROUND_BUILD", "1")
    monkeypatch.setattr("squishlike.io.fault._hits", 0)
    yield
    assert wait_for_builds(timeout=120), "a background build outlived its test"


def fault(monkeypatch, at: str, action: str) -> None:
    monkeypatch.setenv("SQUISHLIKE_FAULT_AT", at)
    monkeypatch.setenv("SQUISHLIKE_FAULT_ACTION", action)


def mlx_tier_ready(store) -> bool:
    return BY_NAME["mlx"].ready(NpyDir(store))[0] is not None


def lock_is_free(store) -> bool:
    lock = DirectoryLock(store)
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def names(store) -> set[str]:
    return {p.name for p in store.iterdir()} - {".squishlike.lock"}


def test_the_first_load_returns_before_its_build_and_later_loads_wait_for_it(store, in_background, monkeypatch):
    fault(monkeypatch, WRITE, "pause:1.5")
    first, _ = squishlike.load(store)
    assert background.pending() and not mlx_tier_ready(store)
    assert not lock_is_free(store), "the build holds the store's lock"
    monkeypatch.delenv("SQUISHLIKE_FAULT_AT")
    second, _ = squishlike.load(store)  # waits on the lock, then takes the tier the build published
    assert mlx_tier_ready(store) and not background.pending() and lock_is_free(store)
    assert_same_weights(first, second)
    assert_same_weights(first, squishlike.load(store, tier="mlx")[0])


def test_a_script_that_loads_and_exits_leaves_the_tier_built(store):
    env = {**os.environ, "SQUISHLIKE_BACKGROUND_BUILD": "1", "SQUISHLIKE_FAULT_AT": WRITE,
           "SQUISHLIKE_FAULT_ACTION": "pause:1"}
    code = "import sys, squishlike; from squishlike.tiers import background; squishlike.load(sys.argv[1]); " \
           "print(background.pending())"
    run = subprocess.run([sys.executable, "-c", code, str(store)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "tier mlx" in run.stdout, "still building when load returned"
    assert mlx_tier_ready(store) and not [n for n in names(store) if ".tmp" in n]


def test_a_failed_build_leaves_the_load_good_and_the_store_as_it_was(store, in_background, monkeypatch):
    before = names(store)
    fault(monkeypatch, WRITE, "enospc")
    with pytest.warns(UserWarning, match="could not build tier mlx"):
        model, _ = squishlike.load(store)
        assert wait_for_builds(timeout=120)
    assert names(store) == before and lock_is_free(store)
    assert_same_weights(model, squishlike.load(store, tier="cold")[0])
    monkeypatch.delenv("SQUISHLIKE_FAULT_AT")
    squishlike.load(store)  # the next first load builds it
    assert wait_for_builds(timeout=120) and mlx_tier_ready(store)


def test_a_process_killed_during_its_build_leaves_temps_the_next_load_removes(store):
    env = {**os.environ, "SQUISHLIKE_BACKGROUND_BUILD": "1", "SQUISHLIKE_FAULT_AT": WRITE,
           "SQUISHLIKE_FAULT_ACTION": "kill"}
    run = subprocess.run([sys.executable, "-c", "import sys, squishlike; squishlike.load(sys.argv[1])", str(store)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr
    assert not mlx_tier_ready(store) and [n for n in names(store) if ".tmp" in n]
    squishlike.load(store)  # this suite waits for its builds (conftest.py)
    assert mlx_tier_ready(store) and not [n for n in names(store) if ".tmp" in n]


def test_a_damaged_store_fails_its_first_load_and_starts_no_build(store, in_background):
    part = next(p for p in sorted((store / "tensors").iterdir()) if p.stat().st_size > 4096)
    data = bytearray(part.read_bytes())
    data[-2:] = bytes(255 - b for b in data[-2:])
    part.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=part.name):
        squishlike.load(store)
    assert not background.pending() and lock_is_free(store) and not mlx_tier_ready(store)
    assert np.all([".tmp" not in n for n in names(store)])
