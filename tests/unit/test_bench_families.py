"""The family benchmark's seeds: each seed is another random model of the type, and the per-type summary is the
geometric mean of its seeds' KL ratios (benchmarks/bench_families.py)."""

from __future__ import annotations

import math

import mlx.core as mx
from support.tiny_models import make_tokenizer

from benchmarks.bench_families import build_source, by_type, table


def test_each_seed_is_another_model(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    first, again, other = (mx.load(str(build_source("llama", tmp_path / name, tokenizer, seed) / "model.safetensors"))
                           for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert first.keys() == other.keys()
    for name in first:
        assert first[name].dtype == mx.bfloat16 and mx.array_equal(first[name], again[name]), name
    assert not any(mx.array_equal(first[n], other[n]) for n in first)


def test_summary_is_the_geometric_mean_of_the_seeds():
    def row(seed, ratio):
        return {"type": "llama", "seed": seed, "squishlike": {"kl": ratio}, "mlx_lm_gptq": {"kl": 1.0},
                "convert_q": {"error": "not run"}, "kl_ratio": ratio}

    rows = [row(0, 1.44), row(1, 0.25), {**row(0, 2.0), "type": "phi"}]
    summary = by_type(rows).splitlines()
    assert summary[2] == f"| llama | 1.44, 0.25 | {math.sqrt(1.44 * 0.25):.3f} |"
    assert summary[3] == "| phi | 2.0 | 2.000 |"
    assert "| llama | 1 | 0.25 | 1.0 | not run | 0.25 |" in table(rows)
    assert "| phi | 2.0 | 1.0 |" in table([rows[2]])  # one seed: no seed column
