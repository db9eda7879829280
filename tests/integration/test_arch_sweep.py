"""Any architecture mlx_lm builds loads and compresses: a sweep over tiny random-weight models of many families.

For each: squishlike.load(src) has mlx_lm.load(src)'s parameters bit for bit; an int8 and an int4 store load
bit-identically from every tier, and agree with the source model on the next token (INT4 as well as mlx_lm's own
4-bit quantization of the same model does). The default suite runs the
architectures in arch_sweep.DEFAULT; `pytest -m archsweep` runs the rest (scripts/test.sh runs both).

Agreement needs a model with opinions: the test models get trained-like spread in their embedding and output
rows (make_hf_model's row_spread); their layers still decide the top-1 (with the quantized weights zeroed,
agreement falls to 0-0.5 for most of them). INT4 uses the options for small models: groups of 32 and clip
search (a 128-wide row has only two groups of 64).
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from support.options import ROUND_TO_NEAREST
from support.arch_sweep import ARCH_CONFIGS, DEFAULT, KNOWN_FAILING, NOT_SWEPT, TEXT_ARGS, model_types
from support.tiny_models import assert_same_weights, flat_params, make_hf_model

import squishlike
from squishlike.model import quantizable_weights
from squishlike.npydir import NpyDir
from squishlike.tiers import ORDER

TOKENS = [(7 * i + 3) % 300 for i in range(96)]  # fixed, inside the tokenizer's 300 ids
# The least share of positions where a store's top-1 token is the source's: INT8 0.9; INT4 what mlx_lm's own 4-bit
# quantization of the same model (groups of 32, the same weights quantized) reaches, less 5 of the 96 positions.
# A tiny random model's 4-bit agreement depends on the family (0.7-1.0: near-one-hot attention in some), while a
# wrong rule (a misplaced or mis-scaled tensor) drops it to 0-0.5.
INT8_FLOOR = 0.9
INT4_SLACK = 5 / len(TOKENS)
# INT8 as compress does by default (embeddings and head quantized too: every family's quantized-embedding path).
# INT4 keeps them exact: a 4-bit embedding of a tiny random model flips its near-tied logits below the floor, which
# says nothing of the family; what the default INT4 store costs in accuracy is measured on SmolLM2
# (test_default_store.py).
OPTIONS = {"int8": {}, "int4": {**ROUND_TO_NEAREST, "group_size": 32, "clip_search": True, "quantize_embeddings": False}}
ROW_SPREAD = 1.5
ALL_TIERS = ("mlx", "finalized", "int4", "int3")

ARCHS = [
    pytest.param(arch, marks=[
        *(() if arch in DEFAULT else [pytest.mark.archsweep]),
        *([pytest.mark.xfail(reason=KNOWN_FAILING[arch], strict=True)] if arch in KNOWN_FAILING else []),
    ])
    for arch in ARCH_CONFIGS
]


@pytest.fixture(autouse=True)
def free_mlx_buffers():
    """mlx keeps freed buffers for reuse: over a hundred models in one process they added up to gigabytes."""
    yield
    mx.clear_cache()


def mlx_lm_4bit_agreement(model, expected: mx.array) -> float:
    """The top-1 agreement with `expected` of `model` quantized by mlx_lm (nn.quantize, 4 bits, groups of 32) where
    the INT4 store quantizes it to 4 bits (embeddings and head kept exact, as OPTIONS["int4"] asks). Quantizes
    `model` in place."""
    four_bit = {name for name, kind in quantizable_weights(model).items() if kind == "linear"}
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: f"{path}.weight" in four_bit
                and m.weight.shape[-1] % 32 == 0)
    return agreement(model, expected)


def top1(model) -> mx.array:
    return mx.argmax(model(mx.array([TOKENS]))[0], axis=-1)


def agreement(model, expected: mx.array) -> float:
    return mx.mean(top1(model) == expected).item()


def test_sweep_covers_the_issue():
    types = set(ARCH_CONFIGS)
    moe = {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss", "granitemoe"} & types
    ssm = {"mamba", "mamba2", "falcon_h1", "recurrent_gemma"} & types
    assert len(types) >= 25 and len(moe) >= 5 and len(ssm) >= 2 and {"gemma2", "phi3"} <= types
    assert set(TEXT_ARGS) <= types and {"gemma3", "qwen2_vl", "qwen3_5", "mistral3", "llama4"} <= set(TEXT_ARGS)
    assert set(DEFAULT) <= types and not types & set(NOT_SWEPT)


def test_every_mlx_lm_model_type_is_swept_or_listed():
    """A model type a new mlx_lm brings fails here until the sweep covers it or NOT_SWEPT says why not."""
    assert set(model_types()) - set(ARCH_CONFIGS) - set(NOT_SWEPT) == set()
    assert set(ARCH_CONFIGS) | set(NOT_SWEPT) <= set(model_types())  # no stale names


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_as_mlx_lm_and_compresses(arch, tmp_path, tokenizer_dir):
    src = make_hf_model(tmp_path / arch, ARCH_CONFIGS[arch], tokenizer_dir, row_spread=ROW_SPREAD)
    reference, _ = mlx_lm.load(str(src))
    loaded, _ = squishlike.load(src)
    expected, got = flat_params(reference), flat_params(loaded)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert value.dtype == got[name].dtype and mx.array_equal(value, got[name]).item(), name

    source_top1 = top1(reference)
    floors = {"int8": INT8_FLOOR, "int4": mlx_lm_4bit_agreement(reference, source_top1) - INT4_SLACK}
    for fmt, floor in floors.items():
        out = squishlike.compress(src, tmp_path / fmt, scheme=fmt, tiers=ALL_TIERS, **OPTIONS[fmt])
        store = NpyDir(out)
        assert any(e.kind.quantized for e in store.entries.values()), "the model has weights to quantize"
        cold, _ = squishlike.load(out)  # the first load: the cold path, building every tier the policy asks for
        built = {t.name for t in ORDER if t.ready(store)[0] is not None}
        assert built == {"mlx", "finalized", *({fmt} & {"int4"})}
        for tier in (*built, "cold"):
            assert_same_weights(cold, squishlike.load(out, tier=tier)[0])
        agreed = agreement(cold, source_top1)
        assert agreed >= floor, f"{fmt}: top-1 agreement {agreed:.2f} < {floor:.2f}"


def test_hf_layout_goes_through_the_models_sanitize(tmp_path, tokenizer_dir):
    """A Mixtral checkpoint in HF layout (one tensor per expert) is read as mlx_lm reads it: experts stacked by
    sanitize into SwitchLinear's 3-D weights, which compress quantizes; the store records mlx_lm naming."""
    mlx_dir = make_hf_model(tmp_path / "mlx", ARCH_CONFIGS["mixtral"], tokenizer_dir)
    hf_dir = tmp_path / "hf"
    shutil.copytree(mlx_dir, hf_dir)
    weights = mx.load(str(mlx_dir / "model.safetensors"))
    for name in [n for n in weights if ".switch_mlp." in n]:
        stacked = weights.pop(name)
        prefix, proj = name.split(".switch_mlp.")
        hf_proj = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj.removesuffix(".weight")]
        weights.update({f"{prefix}.experts.{e}.{hf_proj}.weight": stacked[e] for e in range(stacked.shape[0])})
    mx.save_safetensors(str(hf_dir / "model.safetensors"), weights, metadata={"format": "pt"})

    reference, _ = mlx_lm.load(str(hf_dir))
    assert_same_weights(reference, squishlike.load(hf_dir)[0])
    out = squishlike.compress(hf_dir, tmp_path / "int4", scheme="int4", **ROUND_TO_NEAREST)
    store = NpyDir(out)
    assert store.manifest.naming == "mlx"
    experts = store.entry("model.layers.0.block_sparse_moe.switch_mlp.gate_proj.weight")
    assert experts.shape == (4, 256, 128) and experts.scheme == "int4"
    schemes = {name: e.scheme for name, e in store.entries.items()}
    assert schemes["model.embed_tokens.weight"] == schemes["lm_head.weight"] == "int4"  # as mlx_lm.convert -q
    assert schemes["model.layers.0.input_layernorm.weight"] == "passthrough"
    assert schemes["model.layers.0.block_sparse_moe.gate.weight"] == "int4"  # mixtral asks nothing else
    assert_same_weights(squishlike.load(out)[0], squishlike.load(out, tier="int4")[0])


def test_the_models_quant_predicate_decides(tmp_path, tokenizer_dir):
    """qwen3_moe's quant_predicate keeps its routers at 8 bits: an INT4 store keeps them INT8."""
    src = make_hf_model(tmp_path / "qwen3_moe", ARCH_CONFIGS["qwen3_moe"], tokenizer_dir)
    store = NpyDir(squishlike.compress(src, tmp_path / "int4", scheme="int4", tiers=()))
    assert store.entry("model.layers.0.mlp.gate.weight").scheme == "int8"
    assert store.entry("model.layers.0.mlp.switch_mlp.up_proj.weight").scheme == "int4"


def test_table_families_keep_canonical_names(tmp_path, tokenizer_dir):
    src = make_hf_model(tmp_path / "llama", ARCH_CONFIGS["llama"], tokenizer_dir)
    store = NpyDir(squishlike.compress(src, tmp_path / "int8", tiers=()))
    assert store.manifest.naming == "canonical" and "layers.0.attention.q.weight" in store.entries


@pytest.mark.parametrize("arch, head", [("internlm2", "output.weight"), ("gpt_neox", "model.embed_out.weight")])
def test_output_heads_stay_exact_whatever_their_name(arch, head, tmp_path, tokenizer_dir):
    """The output head is known as the head under the family's own name for it: kept exact, as `lm_head` is, when
    embeddings and head are not quantized, and quantized with them by default."""
    src = make_hf_model(tmp_path / arch, ARCH_CONFIGS[arch], tokenizer_dir)
    kept = squishlike.compress(src, tmp_path / "kept", scheme="int4", tiers=(), quantize_embeddings=False,
                               **ROUND_TO_NEAREST)
    assert NpyDir(kept).entry(head).scheme == "passthrough"
    assert squishlike.compress(src, tmp_path / "all", scheme="int4", tiers=(), **ROUND_TO_NEAREST)
    assert NpyDir(tmp_path / "all").entry(head).scheme == "int4"
