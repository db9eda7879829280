"""Rule tables, adapters and the config, checked against real mlx_lm models and llama.cpp's own formulas."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from support.fixtures.gguf_models import CONFIGS, random_model
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from squishlike.arch import Need, architecture_for, architecture_for_gguf
from squishlike.arch.llama import permute_for_gguf, unpermute_from_gguf
from squishlike.config import ModelConfig
from squishlike.errors import FormatError, UnsupportedArchitectureError
from squishlike.formats.gguf import config_from_metadata

FAMILIES = list(CONFIGS)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_config_json_is_accepted_by_mlx_lm_and_round_trips(model_type):
    config = ModelConfig.from_dict(CONFIGS[model_type])
    written = config.to_dict()
    model_class, args_class = _get_classes(written)
    args = args_class.from_dict(written)
    assert model_class(args) is not None
    assert ModelConfig.from_dict(written) == config
    assert set(written) == set(CONFIGS[model_type]) | {"head_dim", "num_key_value_heads"} | (
        {"tie_word_embeddings"} if model_type in ("gemma3_text", "gpt2") else set()
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rule_table_names_exactly_the_mlx_lm_parameters(model_type):
    model, config, _ = random_model(model_type)
    parameters = {name for name, _ in tree_flatten(model.parameters())}
    rules = architecture_for(model_type).expanded_rules(config.num_hidden_layers)
    mlx_names = [r.mlx for r in rules]
    assert len(set(mlx_names)) == len(mlx_names)
    assert len({r.canonical for r in rules}) == len(rules)
    assert parameters <= set(mlx_names), parameters - set(mlx_names)  # every parameter has a row
    always = {r.mlx for r in rules if r.need is Need.ALWAYS}
    assert always <= parameters, always - parameters  # every row the family must have is a parameter


def test_names_in_every_column():
    llama = architecture_for("llama")
    assert llama.hf_name("layers.7.attention.q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert llama.gguf_name("layers.7.attention.q.weight") == "blk.7.attn_q.weight"
    assert llama.mlx_name("layers.12.ffn.down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert llama.hf_name("output.weight") == "lm_head.weight"
    assert architecture_for("gemma3_text").hf_name("layers.0.ffn_norm.weight") == (
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    gpt2 = architecture_for("gpt2")
    assert gpt2.hf_name("layers.3.attention.qkv.bias") == "h.3.attn.c_attn.bias"
    assert gpt2.mlx_name("layers.3.attention.qkv.bias") == "model.h.3.attn.c_attn.bias"
    assert gpt2.gguf_name("position_embedding.weight") == "position_embd.weight"
    with pytest.raises(KeyError):
        llama.hf_name("layers.0.attention.qkv.weight")


def test_registry():
    assert architecture_for("mistral") is architecture_for("llama")
    assert architecture_for_gguf("gemma3") is architecture_for("gemma3_text")
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'"):
        architecture_for("mamba")
    with pytest.raises(UnsupportedArchitectureError, match="'rwkv6'"):
        architecture_for_gguf("rwkv6")


def test_qk_permutation_is_llama_cpps():
    # one head of 8 rows: HF rotates the halves (0..3 with 4..7), GGUF adjacent pairs: rows interleave
    rows = np.arange(8)
    assert permute_for_gguf(rows, heads=1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert permute_for_gguf(np.arange(16), heads=2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.parametrize("shape, heads", [((576, 64), 9), ((192, 64), 3), ((576,), 9), ((256, 32), 4)])
def test_qk_permutation_round_trips_on_numpy_and_mlx(shape, heads):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = permute_for_gguf(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_from_gguf(permuted, heads), w)
    np.testing.assert_array_equal(np.asarray(unpermute_from_gguf(mx.array(permuted), heads)), w)


def test_adapters_by_naming_and_name():
    _, config, weights = random_model("llama")
    llama = architecture_for("llama")
    q, k = weights["layers.1.attention.q.weight"], weights["layers.1.attention.k.weight"]
    # Q has 4 heads, K 2: the permutation must use each one's own count
    assert mx.array_equal(llama.from_canonical("gguf", "layers.1.attention.q.weight", q, config), permute_for_gguf(q, 4))
    assert mx.array_equal(llama.from_canonical("gguf", "layers.1.attention.k.weight", k, config), permute_for_gguf(k, 2))
    assert mx.array_equal(llama.to_canonical("hf", "layers.1.attention.q.weight", q, config), q)  # HF is canonical
    v = weights["layers.1.attention.v.weight"]
    assert mx.array_equal(llama.from_canonical("gguf", "layers.1.attention.v.weight", v, config), v)

    _, config, weights = random_model("qwen2")
    bias = weights["layers.0.attention.q.bias"]
    qwen = architecture_for("qwen2")
    assert mx.array_equal(qwen.from_canonical("gguf", "layers.0.attention.q.bias", bias, config), bias)  # not permuted

    _, config, weights = random_model("gemma3_text")
    gemma = architecture_for("gemma3_text")
    for name in ("layers.0.attention.q_norm.weight", "layers.1.post_ffn_norm.weight", "output_norm.weight"):
        stored = gemma.from_canonical("gguf", name, weights[name], config)
        assert mx.allclose(stored, weights[name] + 1)
        assert mx.allclose(gemma.to_canonical("gguf", name, stored, config), weights[name])
    q = weights["layers.0.attention.q.weight"]
    assert mx.array_equal(gemma.from_canonical("gguf", "layers.0.attention.q.weight", q, config), q)  # not permuted


def test_gpt2_hf_weights_become_what_mlx_lm_sanitize_makes():
    model, config, weights = random_model("gpt2")
    arch = architecture_for("gpt2")
    hf = {arch.hf_name(n): np.asarray(arch.from_canonical("hf", n, w, config)) for n, w in weights.items()}
    assert hf["h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D [in, out]
    hf["h.0.attn.bias"] = np.tril(np.ones((64, 64)))  # the causal-mask buffer HF checkpoints carry
    sanitized = model.sanitize({k: mx.array(v) for k, v in hf.items()})
    ours = {arch.mlx_name(n): arch.to_canonical("hf", n, mx.array(hf[arch.hf_name(n)]), config) for n in weights}
    assert sanitized.keys() == ours.keys()
    for name, value in ours.items():
        assert mx.array_equal(sanitized[name], value), name


def test_config_from_dict_keeps_every_other_key_and_reads_transformers_5():
    written_by_transformers_5 = {k: v for k, v in CONFIGS["qwen3"].items() if k != "rope_theta"}
    written_by_transformers_5.update(
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )
    config = ModelConfig.from_dict(written_by_transformers_5)
    assert config.rope_theta == 1e6 and config.torch_dtype == "bfloat16"
    assert config.extra["architectures"] == ["Qwen3ForCausalLM"]
    assert config.to_dict()["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}


def test_config_missing_keys_name_the_file_and_the_keys():
    broken = {k: v for k, v in CONFIGS["llama"].items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(FormatError, match=r"model/config\.json: .*hidden_size, vocab_size"):
        ModelConfig.from_dict(broken, "model/config.json")


@pytest.mark.parametrize("base, model_type", [("llama", "llama"), ("llama", "ministral3"), ("llama", "qwen2"),
                                               ("gemma3_text", "gemma3_text")])
def test_tie_default_is_mlx_lms_when_the_key_is_absent(base, model_type):
    """mlx_lm ties the head as its ModelArgs default says (llama, ministral3: tied), so a load does too; gemma3's
    ModelArgs has no such field: its head is always the embedding."""
    from mlx_lm.utils import _get_classes

    config = {k: v for k, v in CONFIGS[base].items() if k != "tie_word_embeddings"} | {"model_type": model_type}
    _, model_args = _get_classes(config)
    expected = getattr(model_args.from_dict(config), "tie_word_embeddings", True)
    assert ModelConfig.from_dict(config).tie_word_embeddings is expected


def test_config_from_gguf_metadata():
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": 576,
        "llama.block_count": 30,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "feed_forward_length": 1536,  # unprefixed: read when the prefixed key is absent
        "llama.feed_forward_length": 1536,
        "attention.layer_norm_rms_epsilon": 1.0,  # the prefixed key wins
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 100000.0,
        "llama.context_length": 8192,
        "tokenizer.ggml.tokens": ["a"] * 100,
    }
    config = config_from_metadata(metadata, ["token_embd.weight"])
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    assert (config.head_dim, config.vocab_size, config.rms_norm_eps) == (64, 100, 1e-5)
    assert config.tie_word_embeddings is True
    assert config_from_metadata(metadata, ["token_embd.weight", "output.weight"]).tie_word_embeddings is False
    del metadata["llama.feed_forward_length"]
    assert config_from_metadata(metadata, []).intermediate_size == 1536
    del metadata["llama.block_count"], metadata["tokenizer.ggml.tokens"]
    with pytest.raises(FormatError, match=r"x\.gguf: .*llama\.block_count.*llama\.vocab_size"):
        config_from_metadata(metadata, [], "x.gguf")
