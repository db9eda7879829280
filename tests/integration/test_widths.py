"""Mixed stores (issue 33): tensors at any width in {2, 3, 4, 5, 6, 8} bits, asked for by `bits=` rules, written
and served by every load path (cold, the dense tiers, the quantized tier read from the store or built, CPU layers,
sharded_load), exported for plain mlx_lm.load, and counted by inspect's bits per weight."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.utils import compute_bits_per_weight
from support.options import ROUND_TO_NEAREST
from support.tiny_models import assert_same_weights, assert_serves_as_store, cosine, dense_params, logits

import squishlike
from squishlike.compress_options import CompressOptions, choose_scheme
from squishlike.cpu_layers import CpuQuantizedLinear
from squishlike.exporter import export
from squishlike.info import inspect_model
from squishlike.npydir import NpyDir, bits_per_weight
from squishlike.load.sharded import sharded_load
from squishlike.tiers import order

TOKENS = [1, 5, 9, 20, 33, 7, 100, 250, 3, 42]
# Every width, on the projections of a llama; the rest (o, v, embedding, head) at the store's own 4 bits
RULES = (("*.ffn.down.*", 6), ("*.attention.q.*", 2), ("*.ffn.up.*", 5), ("*.ffn.gate.*", 8), ("*.attention.k.*", 3))
WIDTH_OF = {"down_proj": 6, "q_proj": 2, "up_proj": 5, "gate_proj": 8, "k_proj": 3}


def widths(model: nn.Module) -> dict[str, int]:
    return {path: module.bits for path, module in model.named_modules() if isinstance(module, nn.QuantizedLinear)}


def expected_width(path: str) -> int:
    return WIDTH_OF.get(path.rsplit(".", 1)[-1], 4)


@pytest.fixture
def mixed(tiny_llama, tmp_path):
    return squishlike.compress(tiny_llama, tmp_path / "mixed", scheme="int4", bits=RULES, **ROUND_TO_NEAREST)


def test_rules_choose_each_tensors_width(mixed):
    store = NpyDir(mixed)
    schemes = {name: entry.scheme for name, entry in store.entries.items()}
    assert {schemes[f"layers.1.{part}.weight"] for part in ("ffn.down", "attention.q", "ffn.up", "ffn.gate",
                                                            "attention.k", "attention.v")} == {
        "int6", "int2", "int5", "int8g", "int3", "int4"}
    assert schemes["token_embedding.weight"] == schemes["output.weight"] == "int4"
    assert store.entries["layers.0.ffn.down.weight"].reason == "matches --bits *.ffn.down.*=6"
    assert {e.group_size for e in store.entries.values() if e.kind.grouped} == {64}  # the store's, every width
    assert store.manifest.scheme == "int4" and store.manifest.policy.tiers == ("mlx", "int8", "int4", "int3")


def test_first_match_wins_and_the_models_8_bits_stay():
    opts = CompressOptions(scheme="int4", bits=(("layers.0.*", 2), ("*", 6)))
    assert choose_scheme("layers.0.ffn.up.weight", (64, 128), opts, "linear")[0] == "int2"
    assert choose_scheme("layers.1.ffn.up.weight", (64, 128), opts, "linear")[0] == "int6"
    assert choose_scheme("layers.0.mlp.gate.weight", (8, 128), opts, "int8")[0] == "int8"  # a router
    assert choose_scheme("layers.0.ffn_norm.weight", (128,), opts, None)[0] == "passthrough"
    assert choose_scheme("layers.0.ffn.up.weight", (64, 96), opts, "linear")[0] == "passthrough"


@pytest.mark.parametrize("bits, group_size, message", [
    ((("*", 7),), 64, r"^bits=\*=7 is not a width; choose bits from 2, 3, 4, 5, 6, 8"),
    ((("*", "4"),), 64, r"^bits= holds \('\*', '4'\), not a \(pattern, bits\) pair"),
    ((("*", 4),), "row", r"^bits=\*=4 needs group_size=row to be one of 32, 64, 128"),
])
def test_rules_are_validated(tiny_llama, tmp_path, bits, group_size, message):
    with pytest.raises(ValueError, match=message):
        squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8", group_size=group_size, bits=bits)
    assert not (tmp_path / "out").exists()


def test_cli_takes_rules_and_inspect_shows_the_widths(tiny_llama, tmp_path):
    def cli(*args: object, rc: int = 0) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "squishlike", *map(str, args)], capture_output=True, text=True)
        assert done.returncode == rc, done.stderr
        return done

    out = tmp_path / "out"
    cli("compress", tiny_llama, "-o", out, "--scheme", "int4", "--bits", "*.ffn.down.*=6", "--bits", "*=3",
        "--no-awq", "--no-gptq")
    store = NpyDir(out)
    assert {e.scheme for e in store.entries.values()} == {"int6", "int3", "passthrough"}
    summary = cli("inspect", out).stdout
    assert f"21 tensors (5 passthrough, 2 int6, 14 int3), {store.manifest.bits_per_weight():.3f} bits per weight" in summary
    # A tier of a width that only a rule gives is the user's to ask for: the int8 tier holds the store's
    # group-wise tensors (8-bit down projections, 4-bit the rest) natively.
    out8 = tmp_path / "out8"
    cli("compress", tiny_llama, "-o", out8, "--scheme", "int4", "--bits", "*.ffn.down.*=8", "--tiers", "mlx,int8",
        "--no-awq", "--no-gptq")
    assert NpyDir(out8).manifest.policy.tiers == ("mlx", "int8")
    squishlike.load(out8, tier="int8")
    assert (out8 / ".squish_8bit_ready").exists()
    for bad, problem in (("*=7", "--bits *=7 is not a width"), ("down=six", "argument --bits: 'down=six' is not")):
        done = cli("compress", tiny_llama, "-o", tmp_path / "bad", "--scheme", "int4", "--bits", bad, rc=2)
        assert problem in done.stderr.splitlines()[-1]


def test_every_tier_serves_each_tensor_at_its_width(mixed):
    cold, _ = squishlike.load(mixed, tier="cold")
    quantized, _ = squishlike.load(mixed)  # the int4 tier, read straight from the store
    assert widths(quantized) == {path: expected_width(path) for path in widths(quantized)}
    assert len(widths(quantized)) == 2 * 7 + 1  # the head too; the embedding is a QuantizedEmbedding
    assert_same_weights(cold, quantized)
    for tier in ("mlx", "int8"):  # a dense tier, and the other quantized tier the policy names
        model, _ = squishlike.load(mixed, tier=tier)
        assert_same_weights(cold, model)
    if order.device_kind() == "cpu":  # the store's quantized layers on a CPU, at every width
        assert {type(m) for _, m in quantized.named_modules() if isinstance(m, nn.QuantizedLinear)} == {
            CpuQuantizedLinear}
        assert cosine(logits(quantized, TOKENS), logits(cold, TOKENS)) > 0.999


def test_built_tier_is_an_mlx_lm_model_with_per_layer_widths(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "mixed", scheme="int4", bits=RULES, tiers=("int4", "finalized"),
                              **ROUND_TO_NEAREST)
    cold, _ = squishlike.load(out)  # builds both
    config = json.loads((out / "squish_4bit" / "config.json").read_text())
    quantization = config["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 64)
    assert quantization["model.layers.0.mlp.down_proj"] == {"group_size": 64, "bits": 6, "mode": "affine"}
    assert "model.layers.0.self_attn.v_proj" not in quantization  # at the top level's width
    tier, _ = squishlike.load(out, tier="int4")
    via_mlx_lm, _ = mlx_lm.load(str(out / "squish_4bit"))
    assert widths(via_mlx_lm) == widths(tier) == {path: expected_width(path) for path in widths(tier)}
    for model in (tier, via_mlx_lm, squishlike.load(out, tier="finalized")[0]):
        assert_same_weights(cold, model)
    assert_serves_as_store(via_mlx_lm, tier, TOKENS)


def test_sharded_load_reads_every_width(mixed):
    cold, _ = squishlike.load(mixed, tier="cold")
    shared, _ = sharded_load(mixed)
    assert_same_weights(cold, shared)


def test_export_keeps_each_width_for_mlx_lm(mixed, tmp_path):
    """-q without --q-bits: each layer at the width the store holds it, as per-layer entries; mlx_lm.load of the
    directory has the store's weights and the quantized tier's outputs. Without -q, the dense weights."""
    store_model, _ = squishlike.load(mixed)
    exported = export(mixed, "mlx", tmp_path / "mlx", quantize=True)
    config = json.loads((exported / "config.json").read_text())
    assert config["quantization"]["model.layers.1.self_attn.q_proj"] == {"group_size": 64, "bits": 2, "mode": "affine"}
    assert "model.layers.1.self_attn.v_proj" not in config["quantization"]  # at -q's 4 bits
    model, _ = mlx_lm.load(str(exported))
    assert_serves_as_store(model, store_model, TOKENS)
    dense, _ = mlx_lm.load(str(export(mixed, "mlx", tmp_path / "dense")))
    for name, value in dense_params(store_model).items():
        assert mx.array_equal(dense_params(dense)[name], value).item(), name
    # The same bytes as the store's tensors (its runtime dtype is the tiny model's float32): the same bits per weight
    assert compute_bits_per_weight(model) == pytest.approx(NpyDir(mixed).manifest.bits_per_weight(), rel=1e-12)


def test_inspect_shows_widths_and_bits_per_weight(mixed):
    store = NpyDir(mixed)
    on_disk = sum(record.size for entry in store.entries.values() for record in entry.files.values())
    parameters = sum(int(np.prod(entry.shape)) for entry in store.entries.values())
    report = inspect_model(mixed)["store"]
    assert report["bits_per_weight"] == store.manifest.bits_per_weight() == 8 * on_disk / parameters
    assert bits_per_weight(store.entries.values()) == report["bits_per_weight"]  # the helper, for any entries
    assert report["widths"] == {"passthrough": 5, "int8g": 2, "int6": 2, "int5": 2, "int4": 6, "int3": 2, "int2": 2}


# SmolLM2-135M (the real model): 4 bits with the value and down projections and the first layer at 6, as mlx_lm's
# mixed recipes favour them, and a layer at each other width.
SMOLLM_RULES = (("layers.0.*", 6), ("*.attention.v.*", 6), ("*.ffn.down.*", 6), ("layers.1.*", 8),
                ("layers.2.*", 5), ("layers.3.*", 3), ("layers.4.ffn.up.*", 2))


@pytest.fixture(scope="module")
def smollm2_mixed(smollm_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-mixed")
    return squishlike.compress(smollm_gguf, root / "mixed", scheme="int4", bits=SMOLLM_RULES, **ROUND_TO_NEAREST)


def test_smollm2_mixed_store_loads_as_its_dense_dequantization(smollm2_mixed):
    store = NpyDir(smollm2_mixed)
    counts = inspect_model(smollm2_mixed)["store"]["widths"]
    assert counts.keys() == {"passthrough", "int8g", "int6", "int5", "int4", "int3", "int2"}
    assert 4.5 < store.manifest.bits_per_weight() < 5.5  # 4.5 at 4 bits with bf16 scales and biases
    quantized, _ = squishlike.load(smollm2_mixed)
    dense, _ = squishlike.load(smollm2_mixed, tier="mlx")
    assert_same_weights(dense, quantized)
    assert_same_weights(dense, squishlike.load(smollm2_mixed, tier="cold")[0])
    # the quantized layers (float32 products on a CPU) against the dense bf16 model of the same weights
    assert cosine(logits(quantized, TOKENS), logits(dense, TOKENS)) > 0.999


def test_calibrated_default_with_rules(tiny_llama, tmp_path):
    """AWQ and GPTQ (the INT4 default) with rules: the store's tensors at its own width get GPTQ, those at another
    width are rounded to nearest on their grid (calibration/plan.py quantizes only the store's scheme so far), and
    every tier serves the mixed store."""
    out = squishlike.compress(tiny_llama, tmp_path / "calibrated", scheme="int4", bits=(("*.ffn.down.*", 5),),
                              calibration_max_tokens=256)
    store = NpyDir(out)
    down, up = store.entries["layers.0.ffn.down.weight"], store.entries["layers.0.ffn.up.weight"]
    assert (down.scheme, up.scheme) == ("int5", "int4")
    assert "GPTQ" in up.reason and "GPTQ" not in down.reason
    assert_same_weights(squishlike.load(out, tier="cold")[0], squishlike.load(out)[0])
