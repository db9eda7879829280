"""Fixtures shared by the suite. The builders themselves live in tests/support/tiny_models.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_hub import FakeHub
from support.tiny_models import TINY_CONFIGS, make_hf_model, make_tokenizer

# The suite checks what a first load builds as soon as the load returns (and its subprocesses inherit this):
# first loads wait for their builds here. tests/integration/test_background_build.py tests the default, where a
# dense tier is written on a background thread.
os.environ["SQUISHLIKE_BACKGROUND_BUILD"] = "0"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_model(request, tmp_path, tokenizer_dir) -> Path:
    """One tiny HF model directory per architecture."""
    return make_hf_model(tmp_path / request.param, TINY_CONFIGS[request.param], tokenizer_dir)


@pytest.fixture
def tiny_llama(tmp_path, tokenizer_dir) -> Path:
    return make_hf_model(tmp_path / "llama", TINY_CONFIGS["llama"], tokenizer_dir)


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    """A fake Hugging Face Hub on 127.0.0.1 (tests/support/fake_hub.py), stopped after the test."""
    with FakeHub() as hub:
        yield hub


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from squishlike.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:  # scripts/install.sh installs it; without it these tests cannot run
        pytest.fail(str(e))


def pytest_collection_modifyitems(config, items):
    """Tests marked `archsweep` run only when asked for (`-m archsweep`, as scripts/test.sh does); tests marked
    `long` (the real model's slowest measurements, which a tiny model's test covers in the default run) only with
    SQUISHLIKE_LONG=1 or `-m long`."""
    asked = config.getoption("markexpr") or ""
    long_runs = os.environ.get("SQUISHLIKE_LONG") == "1" or "long" in asked
    skips = {"archsweep": (pytest.mark.skip(reason="part of the whole architecture sweep: run with -m archsweep"),
                           "archsweep" not in asked),
             "long": (pytest.mark.skip(reason="a long test: run with SQUISHLIKE_LONG=1"), not long_runs)}
    for item in items:
        for marker, (skip, skipped) in skips.items():
            if skipped and marker in item.keywords:
                item.add_marker(skip)
