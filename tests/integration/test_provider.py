"""The WeightProvider over real files of several formats: canonical names, needed tensors, fusion, listing."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.fixtures.gguf_models import CONFIGS, random_model, write_gguf
from mlx.utils import tree_flatten
from test_gguf import TOKENS, model_from

import squishlike
from squishlike.arch import architecture_for
from squishlike.errors import MissingTensorError, UnknownFormatError, UnsupportedArchitectureError
from squishlike.formats.base import QuantizedTensor
from squishlike.provider import WeightProvider, open_weights


@pytest.fixture
def llama_gguf(tmp_path):
    _, config, weights = random_model("llama")
    return write_gguf(tmp_path / "llama.gguf", config, weights), weights


def test_names_in_model_order_and_bindings(llama_gguf):
    path, weights = llama_gguf
    with open_weights(path) as provider:
        names = provider.names()
        assert set(names) == set(weights)
        assert names[:3] == ["token_embedding.weight", "layers.0.attention_norm.weight", "layers.0.attention.q.weight"]
        assert names[-2:] == ["output_norm.weight", "output.weight"]
        assert names.index("layers.0.ffn.down.weight") < names.index("layers.1.attention_norm.weight")
        assert provider.has("layers.1.attention.k.weight") and not provider.has("layers.2.attention.k.weight")
        assert not provider.has("layers.0.attention.q.bias")  # optional rows appear only where the file has them
        assert provider.source_name("layers.1.attention.k.weight") == "blk.1.attn_k.weight"
        assert provider.mlx_name("layers.1.attention.k.weight") == "model.layers.1.self_attn.k_proj.weight"
        assert provider.get_quantized("layers.1.attention.v.weight") is None  # GGUF holds no MLX triples
        with pytest.raises(MissingTensorError, match=r"llama\.gguf: layers\.5\.attention\.q\.weight"):
            provider.get("layers.5.attention.q.weight")


def test_listing_rows(llama_gguf):
    path, _ = llama_gguf
    with open_weights(path) as provider:
        rows = provider.listing()
    assert [r["canonical"] for r in rows] == provider.names()
    assert rows[0] == {
        "canonical": "token_embedding.weight", "source": "token_embd.weight", "dtype": "float32",
        "shape": (256, 256), "nbytes": 256 * 256 * 4,
    }


def test_fuse_stacks_rows(llama_gguf):
    path, weights = llama_gguf
    names = [f"layers.0.attention.{x}.weight" for x in "qkv"]
    with open_weights(path) as provider:
        fused = provider.fuse(*names)
    assert fused.shape == (256 + 128 + 128, 256)
    assert mx.array_equal(fused, mx.concatenate([weights[n] for n in names]))


def test_a_needed_tensor_missing_is_named(tmp_path):
    _, config, weights = random_model("llama")
    del weights["layers.1.ffn.up.weight"]
    path = write_gguf(tmp_path / "holey.gguf", config, weights)
    with pytest.raises(MissingTensorError, match=r"holey\.gguf: layers\.1\.ffn\.up\.weight: .*blk\.1\.ffn_up\.weight"):
        open_weights(path)


def test_untied_model_without_lm_head_is_refused(tmp_path):
    _, config, weights = random_model("llama")
    del weights["output.weight"]
    write_hf(tmp_path, config.to_dict(), {architecture_for("llama").hf_name(n): w for n, w in weights.items()})
    with pytest.raises(MissingTensorError, match="output.weight"):
        open_weights(tmp_path)
    config.tie_word_embeddings = True  # tied, the same files are a complete model
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with open_weights(tmp_path) as provider:
        assert not provider.has("output.weight")


def write_hf(directory, config: dict, tensors: dict) -> None:
    mx.save_safetensors(str(directory / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    (directory / "config.json").write_text(json.dumps(config))


def test_gpt2_hf_checkpoint(tmp_path):
    """HF GPT-2: Conv1D weights [in, out], causal-mask buffers, no lm_head: the model's own logits come back."""
    model, config, weights = random_model("gpt2")
    arch = architecture_for("gpt2")
    tensors = {arch.hf_name(n): arch.from_canonical("hf", n, w, config) for n, w in weights.items()}
    tensors |= {f"h.{n}.attn.bias": mx.tril(mx.ones((1, 1, 64, 64))) for n in range(2)}
    write_hf(tmp_path, CONFIGS["gpt2"], tensors)
    with open_weights(tmp_path) as provider:
        assert provider.format == "hf"
        assert provider.get("layers.0.attention.qkv.weight").shape == (192, 64)
        assert len(provider.names()) == len(weights)
        assert mx.allclose(model_from(provider)(mx.array(TOKENS)), model(mx.array(TOKENS)), atol=1e-5)


def test_quantized_triples_and_their_fusion(tmp_path):
    model, config, _ = random_model("qwen2")
    nn.quantize(model, group_size=64, bits=4)
    write_hf(tmp_path, config.to_dict() | {"quantization": {"group_size": 64, "bits": 4}},
             dict(tree_flatten(model.parameters())))
    names = [f"layers.1.attention.{x}.weight" for x in "qkv"]
    with open_weights(tmp_path) as provider:
        assert provider.format == "mlx"
        q = provider.get_quantized(names[0])
        assert isinstance(q, QuantizedTensor) and (q.bits, q.group_size) == (4, 64)
        assert mx.array_equal(q.weight, model.model.layers[1].self_attn.q_proj.weight)
        fused = provider.fuse_quantized(*names)
        assert fused.weight.shape == (512, 256 * 4 // 32) and fused.scales.shape == fused.biases.shape == (512, 4)
        assert mx.array_equal(fused.dequantize(), provider.fuse(*names))
        # a bias is no triple: nothing to fuse quantized
        assert provider.fuse_quantized("layers.1.attention.q.bias", "layers.1.attention.k.bias") is None
        assert mx.allclose(model_from(provider)(mx.array(TOKENS)), model(mx.array(TOKENS)), atol=1e-4)


def test_unsupported_architecture_and_unknown_paths(tmp_path):
    _, config, weights = random_model("llama")
    unknown = {"backbone.embeddings.weight": weights["token_embedding.weight"]}
    write_hf(tmp_path, config.to_dict() | {"model_type": "not_an_mlx_lm_model"}, unknown)
    with pytest.raises(UnsupportedArchitectureError, match=rf"{tmp_path}.*Model type not_an_mlx_lm_model not supported"):
        open_weights(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownFormatError):
        WeightProvider.open(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nosuchmodel:latest"):
        WeightProvider.open("nosuchmodel:latest", ollama_root=tmp_path)


def test_ollama_name_resolves_through_the_store(tmp_path, llama_gguf):
    path, weights = llama_gguf
    squishlike.export(path, "ollama", tmp_path / "store", ollama_name="tiny:v1")
    with WeightProvider.open("tiny:v1", ollama_root=tmp_path / "store") as provider:
        assert provider.format == "ollama"
        assert set(provider.names()) == set(weights)
        np.testing.assert_allclose(
            np.asarray(provider.get("layers.1.attention.q.weight").astype(mx.float32)),
            np.asarray(weights["layers.1.attention.q.weight"]), rtol=1e-2, atol=1e-3,
        )
