"""Every format version written before stays readable (docs/format.md §2): the store the format-1 writer wrote,
kept as a fixture, loads to the very weights its tensors give when written now (format 2), by every path a load
takes, and `verify` and `inspect` name its version."""

from __future__ import annotations

import pytest
from support.fixtures import FORMAT1_STORE
from support.tiny_models import assert_same_weights, logits

import squishlike
from squishlike.info import inspect_model, verify_report
from squishlike.npydir import NpyDir

TOKENS = [1, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def format2(tmp_path_factory):
    """The fixture's tensors written by today's writer: an INT4 npy-dir source is repacked, never rounded again."""
    out = tmp_path_factory.mktemp("format2") / "store"
    return squishlike.compress(FORMAT1_STORE, out, scheme="int4", group_size=32, awq=False, gptq=False,
                               clip_search=False)


def test_the_fixture_is_format_1_and_today_writes_format_2(format2):
    assert NpyDir(FORMAT1_STORE).version == 1 and NpyDir(format2).version == 2
    assert len(list((FORMAT1_STORE / "tensors").glob("*.npy"))) == sum(
        len(e.files) for e in NpyDir(FORMAT1_STORE).entries.values())
    assert sorted(p.name for p in (format2 / "tensors").iterdir()) == [f"pack-0000{i}.safetensors" for i in range(4)]


@pytest.mark.parametrize("tier", [None, "int4", "cold"], ids=["default", "int4 from the store", "cold"])
def test_a_format_1_store_loads_the_same_weights(format2, tier):
    old, _ = squishlike.load(FORMAT1_STORE, tier=tier)
    new, _ = squishlike.load(format2, tier=tier)
    assert_same_weights(old, new)
    assert (logits(old, TOKENS) == logits(new, TOKENS)).all()


def test_verify_and_inspect_name_the_version(format2):
    for store, version in ((FORMAT1_STORE, 1), (format2, 2)):
        report = verify_report(store)
        assert report["problems"] == [] and report["format_version"] == version
        assert inspect_model(store)["store"]["format_version"] == version
    assert not [p for p in FORMAT1_STORE.iterdir() if p.name.startswith((".", "squish_"))]  # nothing written there
