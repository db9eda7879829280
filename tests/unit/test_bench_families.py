"""The family benchmarks: each bench_families seed is another random model of the type, the per-type summary the
geometric mean of its seeds' KL ratios; attribute_family's roundings of the input embedding and the paths that
carry their errors."""

from __future__ import annotations

import json
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


def test_a_config_override_shapes_the_source_and_names_its_rows(tmp_path):
    """`--config` widens deepseek_v3's heads to a group of 64 (where mlx_lm's GPTQ can run); each row names it."""
    over = {"qk_nope_head_dim": 64, "v_head_dim": 64}
    src = build_source("deepseek_v3", tmp_path / "wide", make_tokenizer(tmp_path / "tokenizer"), 0, over)
    config = json.loads((src / "config.json").read_text())
    assert {k: config[k] for k in over} == over
    weights = mx.load(str(src / "model.safetensors"))
    shape = (config["num_attention_heads"], config["kv_lora_rank"], 64)  # mlx_lm's per-head stacks, as written
    assert weights["model.layers.0.self_attn.embed_q.weight"].shape == shape
    assert weights["model.layers.0.self_attn.unembed_out.weight"].shape == (shape[0], 64, shape[1])
    row = {"type": "deepseek_v3", "seed": 0, "config": over, "squishlike": {"kl": 0.1}, "mlx_lm_gptq": {"kl": 0.2},
           "convert_q": {"kl": 0.3}, "kl_ratio": 0.5}
    assert table([row]).splitlines()[2].startswith("| deepseek_v3 (qk_nope_head_dim 64, v_head_dim 64) | 0.1 | 0.2 |")


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


def test_embedding_roundings_of_a_tiny_llama(tmp_path, capsys):
    """attribute_family's roundings of the input embedding are 4-bit grids in groups of 64, the clip search's
    with the least squared error of the three roundings to nearest (docs/design.md §7.5), and the GPTQ on the first
    layer's q, k, v (with the identity, or the head) is offered where that layer exists. Their errors put everywhere
    cost what the store's KL is (the paths' split: embedding_paths)."""
    from mlx.utils import tree_flatten

    from benchmarks.attribute_family import PATHS, embedding_paths, embedding_roundings
    from squishlike import evaluation as ev

    model, tokenizer = ev.load_float32(build_source("llama", tmp_path / "llama", make_tokenizer(tmp_path / "tok")))
    source = dict(tree_flatten(model.parameters()))
    w = source["model.embed_tokens.weight"]
    found = embedding_roundings(w, source, "llama")
    assert set(found) == {"clip search", "min-max", "mx.quantize", "GPTQ on the first layer's q, k, v",
                          "GPTQ on the first layer's q, k, v and the head"}
    windows = ev.token_windows(tokenizer, ev.load_text("eval_prose"), max_tokens=128)
    cache = ev.ReferenceCache(model, windows)
    embedding_paths(model, windows, w, {"clip search": found["clip search"], "exact": w})
    rounded, unrounded = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert set(rounded) == {"embedding's error only", *PATHS} and all(rounded[p] > 0 for p in PATHS)
    assert all(unrounded[p] == 0 for p in PATHS)
    model.load_weights([("model.embed_tokens.weight", found["clip search"])], strict=False)
    assert abs(rounded["everywhere"] - ev.compare(model, cache, windows)["kl_mean"]) < 1e-4
    model.load_weights([("model.embed_tokens.weight", w)], strict=False)
    exact = w.astype(mx.bfloat16).astype(mx.float32)
    errors = {label: mx.sum(mx.square(v - exact)).item() for label, v in found.items()}
    assert 0 < errors["clip search"] < min(errors["min-max"], errors["mx.quantize"])
    for v in found.values():
        assert v.shape == w.shape
        assert max(len(set(group.tolist())) for group in v.reshape(-1, 64)) <= 16
    assert "GPTQ on the first layer's q, k, v" not in embedding_roundings(w, {}, "llama")
