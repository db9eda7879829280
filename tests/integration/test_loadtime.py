"""The timed child the benchmark runs (squishlike.loadtime): the in-process and time-to-first-token figures."""

from __future__ import annotations

import pytest

import squishlike
from squishlike.loadtime import GENERATION_PROMPT_TOKENS, measure_load


@pytest.mark.parametrize("loader", ["squishlike", "mlx_lm"])
def test_in_process_load_and_time_to_first_token(tiny_llama, tmp_path, loader):
    path = tiny_llama
    if loader == "squishlike":
        path = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4")
        squishlike.load(path)
    dropped = 256 << 20  # the model a process switching models drops before this load
    report = measure_load(path, loader=loader, in_process=True, dropped_bytes=dropped, generate=4)
    # mlx_lm was imported before the load's clock started: the load is a small part of the whole process.
    assert 0 < report["load_s"] < report["wall_s"] and report["import_s"] > 0
    assert report["rss_peak_dropped"] >= dropped > report["rss_after_import"]  # held, then given back before the load
    # The peak is the load's own, from its start: not the dropped model's
    assert report["rss_peak_reset"] and report["rss_after_import"] <= report["rss_peak"] < dropped
    assert report["generated"] == 4 and report["tokens_per_s"] > 0
    assert report["wall_s"] < report["first_token_s"] < report["exit_s"]
    if loader == "squishlike":
        assert report["tier"] == "int4"  # read from the store: the default store needs no cache
    assert GENERATION_PROMPT_TOKENS == 64
