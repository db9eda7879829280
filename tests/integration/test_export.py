"""Exports to HF and MLX directories read back exactly, and load in mlx_lm like mlx_lm's own conversions."""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

import squishlike
import squishlike.exporter
from squishlike.cli.export import add_arguments as add_export_arguments
from squishlike.cli.export import run as run_export
from squishlike.errors import OutputExistsError, QuantizationError
from squishlike.exporter import export
from squishlike.formats import detect_format, open_reader
from squishlike.formats.mlx import MLXReader
from squishlike.formats.safetensors import HFReader
from squishlike.provider import WeightProvider
from test_formats_hf_mlx import LLAMA, PROMPT, assert_bit_equal, hf_llama


def parameters(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_hf_export_is_exact(tmp_path, tokenizer_dir, dtype):
    weights = hf_llama(tmp_path / "src", tokenizer_dir, dtype, shards=2)
    out = export(tmp_path / "src", "hf", tmp_path / "out")
    assert detect_format(out) is HFReader
    with open_reader(out) as reader:
        assert set(reader.tensors()) == set(weights)
        for name, expected in weights.items():
            assert_bit_equal(reader.read(name), expected)
        assert reader.config()["hidden_size"] == LLAMA["hidden_size"]
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tokenizer.json").read_bytes()


def test_hf_export_of_an_mlx_quantized_model_is_its_dequantized_weights(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "hf", tokenizer_dir)
    mlx_lm.convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), quantize=True, q_bits=4, q_group_size=64)
    out = export(tmp_path / "mlx", "hf", tmp_path / "out")
    assert detect_format(out) is HFReader  # no "quantization" left in config.json
    with MLXReader(tmp_path / "mlx") as source, HFReader(out) as exported:
        assert set(exported.tensors()) == set(source.tensors())
        for name in source.tensors():
            assert_bit_equal(exported.read(name), source.read(name))


def test_mlx_export_loads_in_mlx_lm_with_the_same_weights_and_logits(tmp_path, tokenizer_dir):
    weights = hf_llama(tmp_path / "src", tokenizer_dir)
    out = export(tmp_path / "src", "mlx", tmp_path / "out")
    model, tokenizer = mlx_lm.load(str(out))
    reference, reference_tokenizer = mlx_lm.load(str(tmp_path / "src"))
    exported = parameters(model)
    assert set(exported) == set(weights)
    for name, expected in weights.items():
        assert_bit_equal(exported[name], expected)
    assert mx.array_equal(model(PROMPT), reference(PROMPT)).item()
    assert tokenizer.encode("The capital of France") == reference_tokenizer.encode("The capital of France")


@pytest.mark.parametrize("mode, bits, group_size", [("affine", 4, 64), ("affine", 8, 32), ("mxfp4", None, None)])
def test_quantized_mlx_export_matches_mlx_lm_convert(tmp_path, tokenizer_dir, mode, bits, group_size):
    hf_llama(tmp_path / "src", tokenizer_dir)
    out = export(tmp_path / "src", "mlx", tmp_path / "out", quantize=True, q_bits=bits, q_group_size=group_size,
                 q_mode=mode)
    mlx_lm.convert(str(tmp_path / "src"), str(tmp_path / "ref"), quantize=True, q_bits=bits, q_group_size=group_size,
                   q_mode=mode)
    config, reference_config = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "ref"))
    assert config["quantization"] == reference_config["quantization"]
    assert detect_format(out) is MLXReader

    model, _ = mlx_lm.load(str(out))
    reference, _ = mlx_lm.load(str(tmp_path / "ref"))
    ours, theirs = parameters(model), parameters(reference)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert_bit_equal(ours[name], theirs[name])
    assert mx.array_equal(model(PROMPT), reference(PROMPT)).item()


def test_exports_past_the_shard_size(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(squishlike.exporter, "MAX_SHARD_BYTES", 100_000)
    weights = hf_llama(tmp_path / "src", tokenizer_dir)
    out = export(tmp_path / "src", "hf", tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    with HFReader(out) as reader:
        for name, expected in weights.items():
            assert_bit_equal(reader.read(name), expected)
    model, _ = mlx_lm.load(str(export(tmp_path / "src", "mlx", tmp_path / "mlx")))
    assert len(list((tmp_path / "mlx").glob("model-*.safetensors"))) > 2
    assert_bit_equal(parameters(model)["model.norm.weight"], weights["model.norm.weight"])


def test_export_refuses_a_non_empty_destination(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "src", tokenizer_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        export(tmp_path / "src", "hf", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    export(tmp_path / "src", "hf", tmp_path / "out", force=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()
    (tmp_path / "empty").mkdir()
    export(tmp_path / "src", "hf", tmp_path / "empty")  # an empty directory is fine


def test_failed_export_leaves_nothing(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "src", tokenizer_dir)
    with pytest.raises(ValueError):  # mxfp4 has groups of 32 only: mx.quantize refuses mid-export
        export(tmp_path / "src", "mlx", tmp_path / "out", quantize=True, q_mode="mxfp4", q_group_size=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_hf_export_refuses_quantization(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "src", tokenizer_dir)
    with pytest.raises(QuantizationError):
        export(tmp_path / "src", "hf", tmp_path / "out", quantize=True)
    assert not (tmp_path / "out").exists()


def test_command_line_arguments(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "src", tokenizer_dir)
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args([str(tmp_path / "src"), "--to", "mlx", "-o", str(tmp_path / "out"), "-q",
                              "--q-bits", "8", "--q-group-size", "32"])
    assert run_export(args) == 0
    quantization = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert quantization == {"group_size": 32, "bits": 8, "mode": "affine"}


@pytest.mark.smollm
def test_smollm_gguf_exports_losslessly_and_still_answers(tmp_path, smollm_gguf):
    """The embedded SmolLM2 GGUF: the HF export holds exactly the provider's tensors; the MLX export answers."""
    gguf = smollm_gguf
    with WeightProvider.open(gguf) as source, WeightProvider.open(export(gguf, "hf", tmp_path / "hf")) as exported:
        assert exported.names() == source.names()
        for name in source.names():
            assert_bit_equal(exported.get(name), source.get(name))

    model, tokenizer = mlx_lm.load(str(export(gguf, "mlx", tmp_path / "mlx")))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "Paris" in mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int8_store_exports_the_bytes_of_mlx_lm_convert(tmp_path, tokenizer_dir, dtype, group_size):
    """A group-wise INT8 store exported with -q --q-bits 8 is, tensor for tensor and byte for byte, what
    mlx_lm.convert -q --q-bits 8 writes from the values the store was compressed from."""
    hf_llama(tmp_path / "src", tokenizer_dir, dtype)
    store = squishlike.compress(tmp_path / "src", tmp_path / "store", scheme="int8", group_size=group_size)
    out = export(store, "mlx", tmp_path / "out", quantize=True, q_bits=8, q_group_size=group_size)
    mlx_lm.convert(str(tmp_path / "src"), str(tmp_path / "ref"), quantize=True, q_bits=8, q_group_size=group_size,
                   dtype=str(dtype).removeprefix("mlx.core."))  # the tiny model's config says float32
    config, reference_config = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "ref"))
    assert config["quantization"] == reference_config["quantization"]
    ours, theirs = mx.load(str(out / "model.safetensors")), mx.load(str(tmp_path / "ref" / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name in theirs:
        assert_bit_equal(ours[name], theirs[name])


def test_int8_store_exports_its_own_triples(tmp_path, tokenizer_dir):
    """With clip search the store's scales differ from what mx.quantize would choose: the export keeps the
    store's q, scales and offsets as they are (a lossless repack), not a requantization of its values."""
    hf_llama(tmp_path / "src", tokenizer_dir, mx.bfloat16)
    store = squishlike.compress(tmp_path / "src", tmp_path / "store", scheme="int8", clip_search=True)
    out = export(store, "mlx", tmp_path / "out", quantize=True, q_bits=8, q_group_size=64)
    exported = mx.load(str(out / "model.safetensors"))
    repacked = 0
    with WeightProvider.open(store) as provider:
        for canonical in provider.names():
            triple = provider.get_quantized(canonical)
            if triple is None:
                continue
            layer = provider.mlx_name(canonical).removesuffix(".weight")
            for part, stored in (("weight", triple.weight), ("scales", triple.scales), ("biases", triple.biases)):
                assert_bit_equal(exported[f"{layer}.{part}"], stored)
            repacked += 1
    assert repacked == 2 * 7 + 2  # every linear of both layers, the embedding and the head (quantized by default)
