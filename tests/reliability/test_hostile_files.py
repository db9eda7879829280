"""Hostile input: every crafted file of tests/support/hostile_corpus.py gets a typed error (squishlike.errors)
that names the file, and nothing in any of them is executed (no pickle, no model code, no tokenizer code)."""

from __future__ import annotations

import signal
from pathlib import Path

import mlx.core as mx
import pytest
from support.hostile_corpus import CASES, MARKER, build_base, fill

import squishlike
from squishlike.errors import SquishError, TierNotReadyError
from squishlike.npydir import NpyDir
from squishlike.provider import WeightProvider
from squishlike import tiers


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    return build_base(tmp_path_factory.mktemp("hostile-base"), tokenizer_dir)


def act(action: str, target: Path, scratch: Path) -> None:
    if action == "open":
        with WeightProvider.open(target) as provider:
            for name in provider.names():
                mx.eval(provider.get(name))
            provider.write_side_files(scratch / "side")
    elif action == "npydir":
        store = NpyDir(target)
        for name in store.entries:
            store.dequantize(name)
    elif action == "load":
        squishlike.load(target)
    elif action.startswith("sentinel:"):
        squishlike.load(target, tier=action.split(":", 1)[1])
    else:
        raise ValueError(action)


def test_the_corpus_is_big_enough():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)


@pytest.fixture
def no_hang():
    """A hostile file must not make squishlike block forever (a FIFO, an endless read): fail after 60 s."""
    def alarm(*_):
        raise TimeoutError("squishlike hung on a hostile file")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_file_gets_a_typed_error_naming_it(case, base, tmp_path, no_hang):
    target = case.build(base, tmp_path)
    must_name = fill(case.names, target, tmp_path, base)
    with pytest.raises(SquishError) as error:
        act(case.action, target, tmp_path)
    assert isinstance(error.value, case.expect), f"{type(error.value).__name__}: {error.value}"
    assert must_name in str(error.value), str(error.value)
    assert not list(tmp_path.rglob(MARKER)), "a hostile file executed code"
    if case.action.startswith("sentinel:"):
        # Never trusted: the default load ignores (or rebuilds) the tier and returns the clean weights; it reaches
        # (and warns about) a lying tier when it is the first of this device's order.
        from support.crash_harness import load_in_process

        reached = tiers.target(NpyDir(target)).name == case.action.split(":", 1)[1]
        with pytest.warns(UserWarning, match="damaged") if "lies" in case.name and reached else _nothing():
            _, digest = load_in_process(target)
        assert digest == base.weights_digest


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_trust_remote_code_is_off_unless_asked(base, tmp_path):
    """mlx_lm's own loader honours model_file only with trust_remote_code=True; so do we, and by default the
    custom code neither runs nor is imported, on any path (HF directory, npy-dir)."""
    for case in (c for c in CASES if "custom" in c.name):
        d = tmp_path / case.name
        d.mkdir()
        target = case.build(base, d)
        with pytest.raises(SquishError):
            squishlike.load(target)
        with pytest.raises(SquishError):
            squishlike.load(target, trust_remote_code=False)
        assert not list(d.rglob(MARKER))
