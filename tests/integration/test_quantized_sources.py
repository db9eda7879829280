"""MLX-quantized sources stay quantized: `squishlike.load` returns what `mlx_lm.load` returns (same module classes,
the same parameters bit for bit), `compress` at matching bits repacks the source's values without a second
rounding, and `export --to mlx -q` of a quantized store writes the store's own values."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

import squishlike
from squishlike.compressor import compress
from squishlike.cpu_layers import use_cpu_kernels
from squishlike.exporter import export
from squishlike.npydir import NpyDir
from squishlike.tiers import order
from squishlike.tiers.base import mlx_names
from support.tiny_models import TINY_CONFIGS, assert_same_weights, mlx_quantized

PROMPT = [1, 5, 9, 200, 3, 77, 41, 12]

# (mode, bits, group size): every mode mlx_lm.convert writes on this MLX version.
MODES = [
    *[("affine", bits, 64) for bits in (2, 3, 4, 5, 6, 8)],
    ("mxfp4", 4, 32),
    ("mxfp8", 8, 32),
    ("nvfp4", 4, 16),
]


def bits_of(a: mx.array) -> mx.array:
    return a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size])


def assert_same_model(model, reference) -> None:
    """The same module class at every path and every parameter bit for bit, the same logits and greedy tokens."""
    classes = {path: type(m) for path, m in model.named_modules()}
    assert classes == {path: type(m) for path, m in reference.named_modules()}
    params, expected = dict(tree_flatten(model.parameters())), dict(tree_flatten(reference.parameters()))
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        assert params[name].dtype == value.dtype and params[name].shape == value.shape, name
        assert mx.array_equal(bits_of(params[name]), bits_of(value)).item(), name
    logits, reference_logits = model(mx.array([PROMPT])), reference(mx.array([PROMPT]))
    assert mx.array_equal(logits, reference_logits).item()
    assert logits.argmax(-1).tolist() == reference_logits.argmax(-1).tolist()


@pytest.mark.parametrize("mode, bits, group_size", MODES, ids=[f"{m}{b}" if m == "affine" else m for m, b, _ in MODES])
def test_load_keeps_every_mode_quantized(tmp_path, tokenizer_dir, mode, bits, group_size):
    source = mlx_quantized(tmp_path, tokenizer_dir, q_mode=mode, q_bits=bits, q_group_size=group_size)
    model, _, config = squishlike.load(source, return_config=True)
    reference, _, reference_config = mlx_lm.load(str(source), return_config=True)
    assert_same_model(model, reference)
    assert config["quantization"] == reference_config["quantization"]
    quantized = [m for _, m in model.named_modules() if hasattr(m, "scales")]
    assert quantized and all((m.mode, m.bits, m.group_size) == (mode, bits, group_size) for m in quantized)


def test_load_keeps_per_layer_overrides(tmp_path, tokenizer_dir):
    def predicate(path, module, config=None):
        if path == "model.layers.0.mlp.down_proj":
            return {"group_size": 32, "bits": 8}
        if path == "model.layers.1.self_attn.q_proj":
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return path != "model.layers.1.self_attn.v_proj"  # left dense

    source = mlx_quantized(tmp_path, tokenizer_dir, q_bits=4, q_group_size=64, quant_predicate=predicate)
    model, _ = squishlike.load(source)
    reference, _ = mlx_lm.load(str(source))
    assert_same_model(model, reference)
    layers = model.model.layers
    assert (layers[0].mlp.down_proj.bits, layers[0].mlp.down_proj.group_size) == (8, 32)
    assert layers[1].self_attn.q_proj.mode == "mxfp4"
    assert type(layers[1].self_attn.v_proj).__name__ == "Linear"
    assert type(model.model.embed_tokens).__name__ == "QuantizedEmbedding"


def test_load_keeps_expert_stacks_quantized(tmp_path, tokenizer_dir):
    mixtral = {**TINY_CONFIGS["llama"], "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    source = mlx_quantized(tmp_path, tokenizer_dir, mixtral, q_bits=4, q_group_size=64)
    reference, _ = mlx_lm.load(str(source))
    assert "QuantizedSwitchLinear" in {type(m).__name__ for _, m in reference.named_modules()}
    assert_same_model(squishlike.load(source)[0], reference)


def store_triple(store: NpyDir, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The store's own codes (as MLX words), scales and offsets of `name`, as NumPy bits."""
    triple = store.quantized(name)
    return tuple(np.array(p.view(mx.uint16) if p.dtype == mx.bfloat16 else p) for p in
                 (triple.weight, triple.scales, triple.biases))


def source_triples(source: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every affine triple of an MLX directory, keyed by its weight's name, as NumPy bits."""
    raw = mx.load(str(source / "model.safetensors"))
    bits = {k: np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v) for k, v in raw.items()}
    layers = [name.removesuffix(".scales") for name in raw if name.endswith(".scales")]
    return {f"{layer}.weight": tuple(bits[f"{layer}.{part}"] for part in ("weight", "scales", "biases"))
            for layer in layers}


@pytest.mark.parametrize("fmt, scheme, bits", [("int4", "int4", 4), ("int8", "int8g", 8), ("int3", "int3", 3)])
def test_compress_at_matching_bits_keeps_the_source_values(tmp_path, tokenizer_dir, fmt, scheme, bits):
    # bf16 as mlx-community models are (scales in the runtime dtype); group 32 where compress is asked for 64
    source = mlx_quantized(tmp_path, tokenizer_dir, dtype="bfloat16", q_bits=bits, q_group_size=32)
    out = compress(source, tmp_path / "store", scheme=fmt, group_size=64, quantize_embeddings=True,
                   int3_gate=False)
    store = NpyDir(out)
    expected = source_triples(source)
    repacked = {name: e for name, e in store.entries.items() if e.scheme == scheme}
    assert {e.source_name for e in repacked.values()} == set(expected)
    for name, entry in repacked.items():
        assert entry.group_size == 32 and entry.error.rel_error == 0 and "repacked" in entry.reason
        for got, want in zip(store_triple(store, name), expected[entry.source_name]):
            assert np.array_equal(got, want), name

    reference, _ = mlx_lm.load(str(source))
    cold, _ = squishlike.load(out, tier="cold")  # the Rust kernels dequantize
    assert_same_weights(cold, reference)
    if fmt != "int3":  # the native tier (int4, int8), read from the store, is mlx_lm's own model again
        if order.device_kind() == "cpu":
            use_cpu_kernels(reference)  # with the layers a store's model takes on mlx[cpu] (cpu_layers.py)
        assert_same_model(squishlike.load(out)[0], reference)


@pytest.mark.parametrize("dtype, repacked", [("bfloat16", False), ("float32", True)])
def test_compress_requantizes_scales_of_another_dtype(tmp_path, tokenizer_dir, dtype, repacked):
    """float32 scales cannot be stored in a bfloat16 store as they are: those tensors are quantized afresh."""
    source = mlx_quantized(tmp_path, tokenizer_dir, q_bits=4, q_group_size=64)  # float32 scales
    store = NpyDir(compress(source, tmp_path / "store", scheme="int4", dtype=dtype))
    entries = [e for e in store.entries.values() if e.scheme == "int4"]
    assert entries and all(("repacked" in e.reason) == repacked for e in entries)
    assert all((e.error.rel_error == 0) == repacked for e in entries)


def test_quantized_mlx_export_of_an_int4_store_writes_the_store_values(tmp_path, tiny_llama):
    store = NpyDir(compress(tiny_llama, tmp_path / "store", scheme="int4", group_size=64, dtype="bfloat16"))
    out = export(store.path, "mlx", tmp_path / "mlx", quantize=True, q_bits=4, q_group_size=64)
    exported, names = source_triples(out), mlx_names(store)
    int4 = [name for name, e in store.entries.items() if e.scheme == "int4"]
    assert int4
    for name in int4:
        for got, want in zip(exported[names[name]], store_triple(store, name)):
            assert np.array_equal(got, want), name
