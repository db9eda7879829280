"""Ollama stores written by squishlike's exporter (and blob by blob for expert groups) read back and verified."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import pytest
from safetensors import safe_open

from squishlike.errors import FormatError, IntegrityError, OutputExistsError
from squishlike.exporter import export, write_ollama_model
from squishlike.formats import detect_format
from squishlike.formats.mlx import QuantParams
from squishlike.formats.ollama import TENSOR_MEDIA_TYPE, OllamaReader
from squishlike.provider import WeightProvider
from test_formats_hf_mlx import LLAMA, assert_bit_equal, hf_llama

QUANTIZATIONS = {
    "float": None,
    "int4": QuantParams(64, 4, "affine"),
    "int8": QuantParams(64, 8, "affine"),
    "mxfp4": QuantParams(32, 4, "mxfp4"),
}


def blob(root: Path, layer: dict) -> Path:
    return root / "blobs" / layer["digest"].replace(":", "-")


def exported(tmp_path: Path, tokenizer_dir: Path, quant_type: str = "int4") -> tuple[Path, Path, dict]:
    """(store root, manifest, HF weights) for a tiny llama exported as tiny:<quant_type>."""
    weights = hf_llama(tmp_path / "hf", tokenizer_dir)
    params = QUANTIZATIONS[quant_type]
    quantize = {} if params is None else dict(quantize=True, q_bits=params.bits, q_mode=params.mode)
    manifest = export(tmp_path / "hf", "ollama", tmp_path / "store", ollama_name=f"tiny:{quant_type}", **quantize)
    return tmp_path / "store", manifest, weights


@pytest.mark.parametrize("quant_type", QUANTIZATIONS)
def test_exported_store_reads_back(tmp_path, tokenizer_dir, quant_type):
    root, manifest_path, weights = exported(tmp_path, tokenizer_dir, quant_type)
    params = QUANTIZATIONS[quant_type]
    manifest = json.loads(manifest_path.read_text())
    assert manifest["schemaVersion"] == 2
    for layer in [manifest["config"], *manifest["layers"]]:
        data = blob(root, layer).read_bytes()
        assert layer["digest"] == "sha256:" + hashlib.sha256(data).hexdigest() and layer["size"] == len(data)
    assert {layer["name"] for layer in manifest["layers"] if layer["mediaType"] != TENSOR_MEDIA_TYPE} >= {
        "config.json", "tokenizer.json", "tokenizer_config.json"
    }

    assert detect_format(manifest_path) is OllamaReader
    with OllamaReader(manifest_path) as reader:
        infos = reader.tensors()
        assert set(infos) == set(weights)
        for name, expected in weights.items():
            assert infos[name].shape == expected.shape
            triple = reader.read_quantized(name)
            if triple is None:
                assert_bit_equal(reader.read(name), expected)
                continue
            assert params is not None and infos[name].dtype == params.dtype
            parts = mx.quantize(expected, group_size=params.group_size, bits=params.bits, mode=params.mode)
            assert_bit_equal(triple.weight, parts[0])
            assert_bit_equal(triple.scales, parts[1])
            assert (triple.biases is None) == (params.mode != "affine")
            assert (triple.group_size, triple.bits, triple.mode) == (params.group_size, params.bits, params.mode)
            assert_bit_equal(reader.read(name), mx.dequantize(*parts, group_size=params.group_size,
                                                              bits=params.bits, mode=params.mode))
        assert reader.config()["hidden_size"] == LLAMA["hidden_size"]

    quantized = {name for name, info in infos.items() if info.quantized}
    if params is None:
        assert not quantized
    else:  # Ollama's rule: Linear weights; never the embedding or norms
        assert quantized == {n for n, w in weights.items() if w.ndim == 2 and "embed" not in n}
        layer = next(x for x in manifest["layers"] if x["name"] == "model.layers.0.mlp.up_proj.weight")
        with safe_open(str(blob(root, layer)), framework="numpy") as f:
            assert f.metadata() == {"quant_type": quant_type, "group_size": str(params.group_size)}


@pytest.mark.parametrize("where", ["data", "header"])
def test_corrupted_blob_is_an_integrity_error_naming_it(tmp_path, tokenizer_dir, where):
    root, manifest_path, _ = exported(tmp_path, tokenizer_dir)
    layers = json.loads(manifest_path.read_text())["layers"]
    layer = next(x for x in layers if x["name"].endswith("v_proj.weight"))
    path = blob(root, layer)
    data = bytearray(path.read_bytes())
    data[-1 if where == "data" else 12] ^= 0xFF  # the last tensor byte, or inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as error:
        with OllamaReader(manifest_path) as reader:
            reader.read("model.layers.0.self_attn.q_proj.weight")  # other blobs are fine
            reader.read(layer["name"])
    assert str(path) in str(error.value) and layer["digest"] in str(error.value)


def test_manifest_naming_a_missing_blob_is_a_format_error(tmp_path, tokenizer_dir):
    root, manifest_path, _ = exported(tmp_path, tokenizer_dir)
    layer = json.loads(manifest_path.read_text())["layers"][3]
    blob(root, layer).unlink()
    with pytest.raises(FormatError) as error:
        OllamaReader(manifest_path)
    assert str(manifest_path) in str(error.value) and str(blob(root, layer)) in str(error.value)


def test_resolve_model_references(tmp_path, monkeypatch):
    root = tmp_path / "store"
    manifests = root / "manifests"
    for path in ["registry.ollama.ai/library/tiny/q4", "registry.ollama.ai/library/tiny/latest",
                 "registry.ollama.ai/someone/model/v1", "localhost:5000/team/model/latest"]:
        (manifests / path).parent.mkdir(parents=True, exist_ok=True)
        (manifests / path).write_text("{}")
    resolve = OllamaReader.resolve
    assert resolve("tiny:q4", root) == manifests / "registry.ollama.ai/library/tiny/q4"
    assert resolve("tiny", root) == manifests / "registry.ollama.ai/library/tiny/latest"
    assert resolve("library/tiny:q4", root) == manifests / "registry.ollama.ai/library/tiny/q4"
    assert resolve("registry.ollama.ai/library/tiny:q4", root) == manifests / "registry.ollama.ai/library/tiny/q4"
    assert resolve("someone/model:v1", root) == manifests / "registry.ollama.ai/someone/model/v1"
    assert resolve("localhost:5000/team/model", root) == manifests / "localhost:5000/team/model/latest"
    for absent in ["tiny:q8", "other", "../tiny:q4", "a/b/c/d:e", "tiny:../../x", ""]:
        assert resolve(absent, root) is None, absent
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    assert resolve("tiny:q4") == manifests / "registry.ollama.ai/library/tiny/q4"


def test_provider_opens_an_ollama_name(tmp_path, tokenizer_dir):
    root, _, weights = exported(tmp_path, tokenizer_dir, "int8")
    with WeightProvider.open("tiny:int8", ollama_root=root) as provider:
        assert provider.format == "ollama"
        assert_bit_equal(provider.get("output_norm.weight"), weights["model.norm.weight"])
        assert provider.get_quantized("layers.1.ffn.down.weight").bits == 8


def test_expert_group_shares_one_blob(tmp_path):
    """Four experts' gate/up/down projections of one layer land in one blob with per-tensor quantization."""
    mx.random.seed(1)
    shapes = {"gate": (128, 64), "up": (128, 64), "down": (64, 128)}
    experts = {
        f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight": mx.random.normal(shape)
        for e in range(4) for proj, shape in shapes.items()
    }
    tensors = {"model.layers.0.mlp.gate.weight": mx.random.normal((4, 64)), **experts}
    side = tmp_path / "side"
    side.mkdir()
    (side / "config.json").write_text("{}")
    params = QuantParams(64, 4, "affine")
    manifest_path = write_ollama_model(tmp_path / "store", "moe:int4", list(tensors), tensors.__getitem__, side, params)

    layers = [x for x in json.loads(manifest_path.read_text())["layers"] if x["mediaType"] == TENSOR_MEDIA_TYPE]
    assert [x["name"] for x in layers] == ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts"]
    with safe_open(str(blob(tmp_path / "store", layers[1])), framework="numpy") as f:
        assert len(f.keys()) == 3 * len(experts)  # weight, scale, bias of each
        assert f.metadata()[f"{next(iter(experts))}.quant_type"] == "int4"

    with OllamaReader(manifest_path) as reader:
        infos = reader.tensors()
        assert set(infos) == set(tensors)
        assert not infos["model.layers.0.mlp.gate.weight"].quantized  # a router gate stays float
        assert_bit_equal(reader.read("model.layers.0.mlp.gate.weight"), tensors["model.layers.0.mlp.gate.weight"])
        for name, value in experts.items():
            assert infos[name].shape == value.shape and infos[name].dtype == "affine4"
            expected = mx.dequantize(*mx.quantize(value, group_size=64, bits=4), group_size=64, bits=4)
            assert_bit_equal(reader.read(name), expected)


def test_export_refuses_an_existing_model_without_force(tmp_path, tokenizer_dir):
    root, manifest_path, _ = exported(tmp_path, tokenizer_dir, "float")
    before = manifest_path.read_bytes()
    with pytest.raises(OutputExistsError):
        export(tmp_path / "hf", "ollama", root, ollama_name="tiny:float", quantize=True)
    assert manifest_path.read_bytes() == before
    export(tmp_path / "hf", "ollama", root, ollama_name="tiny:float", quantize=True, force=True)
    assert manifest_path.read_bytes() != before


def test_failed_export_leaves_no_manifest(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "hf", tokenizer_dir)
    with pytest.raises(ValueError):  # mxfp4 has groups of 32 only: mx.quantize refuses mid-export
        export(tmp_path / "hf", "ollama", tmp_path / "store", ollama_name="tiny:bad",
               quantize=True, q_mode="mxfp4", q_group_size=64)
    assert not (tmp_path / "store" / "manifests").exists()
    assert not list((tmp_path / "store" / "blobs").glob(".partial-*"))
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["blobs"]  # no side-file temp dir left
