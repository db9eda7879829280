"""Any architecture mlx_lm builds loads and compresses: a sweep over tiny random-weight models of many families.

For each: squishlike.load(src) has mlx_lm.load(src)'s parameters bit for bit; an INT8 and a mixed INT4 store (each
tensor at a width drawn at random from 2, 3, 4, 5, 6 and 8 bits and a group size from 64 and 128 where they split its
rows, seeded by the type: `bits=` rules) load
bit-identically from every tier, and each is mlx_lm's model of the source with weights no further from the
source's than mlx_lm's own quantization puts them:
- every weight, by name, is within the error mlx_lm's quantization of that tensor has at its width and group size in
  the store (`mx.quantize`; 10% slack, QUANTIZATION_SLACK), and exact (to float rounding) where it
  cannot take it;
- the store's model gives bit for bit the logits of mlx_lm's model of the source given the store's weights (the
  store's config builds the same model).
On the 121 swept types the INT4 store's weights are at most 0.97x mlx_lm's 4-bit error (clip search; 1.008x on
a weight of 4 groups at another seed), the INT8 store's equal to mlx_lm's 8-bit, while a wrong rule's weight (a
tensor of the next layer, a transposed one, one scaled by 2) is 14-24x it (test_the_check_names_a_wrong_tensor
shows the check failing on one). The default suite runs the architectures in arch_sweep.DEFAULT; `pytest -m
archsweep` runs the rest (scripts/test.sh runs both).

Not the model's next-token agreement with the source, which this sweep once compared with mlx_lm's own 4-bit of
the same model: a tiny random model's output is chaotic in its weights. Over every type and 3 seeds, the INT4
store's mean KL(source || store) over the 95 positions of a prompt, against mlx_lm's 4-bit's, is 0.70x at the
median, 1.8x at the 90th percentile, 31x at most (nemotron), with lower error on every tensor; top-1 agreement
differs by -0.21..+0.14. Yet a wrong tensor can move it less (a router of the next layer, a matrix before a norm:
0.02-1x), and tiny talkie's logits did not move at all (its head was zero, as mlx_lm initializes it).
"""

from __future__ import annotations

import glob
import random
import shutil

import mlx.core as mx
import mlx_lm
import pytest
from support.options import ROUND_TO_NEAREST
from support.arch_sweep import ARCH_CONFIGS, DEFAULT, KNOWN_FAILING, NOT_SWEPT, TEXT_ARGS, model_types
from support.tiny_models import assert_same_weights, flat_params, make_hf_model

import squishlike
from squishlike.npydir import NpyDir
from squishlike.quant.schemes import WIDTHS
from squishlike.tiers import ORDER
from squishlike.tiers.base import mlx_names

TOKENS = [(7 * i + 3) % 300 for i in range(96)]  # fixed, inside the tokenizer's 300 ids
# INT8 as compress does by default (embeddings and head quantized too: every family's quantized-embedding path).
# INT4 keeps them exact (--no-quantize-embeddings: every family's exact-head path) and uses the options for small
# models: groups of 32 and clip search (a 128-wide row has only two groups of 64).
OPTIONS = {"int8": {"group_size": 64},
           "int4": {**ROUND_TO_NEAREST, "group_size": 32, "clip_search": True, "quantize_embeddings": False}}
BITS = {"int8": 8, "int4": 4}
# Float rounding, relative to the weight: all the error allowed a weight that mlx_lm's quantization cannot take
# (its last axis does not divide into groups), such as rwkv7's one-column LoRA weights (stored INT8 per row: ~1e-8).
ROUNDING = 1e-6
# The store rounds as docs/format.md 4.2 says (the group's minimum as offset), mlx_lm its own way (zero exact): on a
# weight of a few groups the store's error can be the larger one (1.008x mlx_lm's, clip search included, on rwkv7's
# and olmo_hybrid's 4-group rows over seeds 0-3). A wrong tensor's is 13.7x or more.
QUANTIZATION_SLACK = 1.1
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


def rms(a: mx.array) -> float:
    return mx.sqrt(mx.mean(mx.square(a.astype(mx.float32)))).item()


def assert_within_quantization(weights: dict[str, mx.array], source: dict[str, mx.array], bits: int,
                               group_size: int, widths: dict[str, tuple[int, int]] | None = None) -> None:
    """Each of `weights` is `source`'s weight of its name within the RMS error mlx_lm's quantization of that
    tensor has (at its width and group size in `widths`, else `bits` and `group_size`; with QUANTIZATION_SLACK), or
    within float rounding where that quantization cannot take it."""
    assert weights.keys() == source.keys()
    for name, want in source.items():
        got = weights[name]
        assert got.dtype == want.dtype, name
        bound = ROUNDING * rms(want)
        bits, group_size = (widths or {}).get(name, (bits, group_size))
        if want.ndim >= 2 and want.shape[-1] % group_size == 0:
            quantized = mx.quantize(want, group_size=group_size, bits=bits)
            bound += QUANTIZATION_SLACK * rms(mx.dequantize(*quantized, group_size=group_size, bits=bits) - want)
        error = rms(got - want)
        assert error <= bound, f"{name}: RMS error {error:.3g} > {bound:.3g}, mlx_lm's {bits}-bit's with slack"


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
    src = make_hf_model(tmp_path / arch, ARCH_CONFIGS[arch], tokenizer_dir)
    reference, _ = mlx_lm.load(str(src))
    loaded, _ = squishlike.load(src)
    source, got = flat_params(reference), flat_params(loaded)
    assert source.keys() == got.keys()
    for name, value in source.items():
        assert value.dtype == got[name].dtype and mx.array_equal(value, got[name]).item(), name

    for fmt in ("int8", "int4"):
        bits = random_widths(src, arch) if fmt == "int4" else ()
        out = squishlike.compress(src, tmp_path / fmt, scheme=fmt, tiers=ALL_TIERS, bits=bits, **OPTIONS[fmt])
        store = NpyDir(out)
        assert any(e.kind.quantized for e in store.entries.values()), "the model has weights to quantize"
        first, _ = squishlike.load(out)  # the first load: the cold path, building every tier the policy asks for
        built = {t.name for t in ORDER if t.ready(store)[0] is not None}
        assert built == {"mlx", "finalized", *({fmt} & {"int4"})}
        dense, _ = squishlike.load(out, tier="cold")  # the store dequantized, a model of mlx_lm's dense layers
        for model in (*(squishlike.load(out, tier=tier)[0] for tier in built), dense):
            assert_same_weights(first, model)
        weights = flat_params(dense)
        widths = {mlx: (store.entries[name].kind.bits, store.entries[name].group_size)
                  for name, mlx in mlx_names(store).items()
                  if store.entries[name].kind.grouped}  # per-row INT8 (a router) is checked at the store's bits
        assert_within_quantization(weights, source, BITS[fmt], OPTIONS[fmt]["group_size"], widths)
        reference.load_weights(list(weights.items()))
        tokens = mx.array([TOKENS])
        assert mx.array_equal(dense(tokens), reference(tokens)).item(), f"{fmt}: the store's model is not mlx_lm's"


def random_widths(src, arch: str) -> tuple[tuple, ...]:
    """`bits=` rules giving each of the source's tensors a width drawn at random and a group size drawn from those of
    64 and 128 that split its rows (else the store's), seeded by the model type (the rules of tensors the store
    keeps exact, or per row at 8 bits, match nothing it quantizes)."""
    draw = random.Random(arch)
    rules = []
    with squishlike.open_weights(src) as provider:
        for name in provider.names():
            shape = provider.get(name).shape
            groups = [g for g in (64, 128) if shape and shape[-1] % g == 0]
            rules.append((glob.escape(name), draw.choice(list(WIDTHS)), *([draw.choice(groups)] if groups else [])))
    return tuple(rules)


# The dtype check's default-suite share: the sweep's, one type whose cast_predicate keeps a tensor in float32 of
# each kind (qwen3_5's A_log, deepseek_v3's router correction bias), and gemma3n (its forward recasts two).
DTYPE_DEFAULT = (*DEFAULT, "qwen3_5", "deepseek_v3", "gemma3n")


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=() if arch in DTYPE_DEFAULT else [pytest.mark.archsweep])
                                  for arch in ARCH_CONFIGS])
def test_every_parameter_has_mlx_lms_dtype(arch, tmp_path, tokenizer_dir):
    """A bfloat16 source as mlx_lm.convert writes one (every float cast, except what the model's cast_predicate
    keeps, such as qwen3_5's A_log in float32): the INT8 and INT4 stores' models hold each parameter in the dtype
    mlx_lm.load gives it. (gemma3n's AltUp casts its coefficients to float32 in its forward, in either model: the
    dtypes are compared before any forward.)"""
    source = make_hf_model(tmp_path / "f32", ARCH_CONFIGS[arch], tokenizer_dir)
    src = tmp_path / arch
    mlx_lm.convert(str(source), mlx_path=str(src), dtype="bfloat16")
    want = {name: value.dtype for name, value in flat_params(mlx_lm.load(str(src))[0]).items()}
    for fmt in ("int8", "int4"):
        out = squishlike.compress(src, tmp_path / fmt, scheme=fmt, tiers=(), **ROUND_TO_NEAREST)
        got = {name: value.dtype for name, value in flat_params(squishlike.load(out, tier="cold")[0]).items()}
        assert got.keys() == want.keys()
        assert {n: (want[n], got[n]) for n in want if got[n] != want[n]} == {}, fmt


@pytest.mark.parametrize("arch, tie", [("seed_oss", None), ("llama4_text", True)])
def test_a_head_that_multiplies_by_the_embedding_keeps_it_dense(arch, tie, tmp_path, tokenizer_dir):
    """seed_oss (tied by its ModelArgs default when config.json leaves tie_word_embeddings out) and llama4's text
    model, tied, compute their logits as `h @ embed_tokens.weight.T`: a quantized embedding's weight is its packed
    codes, and the first forward failed ([matmul] ... shape (16,384)). The INT8 and INT4 stores keep that embedding
    exact, and every tier's model runs, with the cold tier's weights."""
    config = {k: v for k, v in ARCH_CONFIGS[arch].items() if k != "tie_word_embeddings"}
    src = make_hf_model(tmp_path / arch, {**config, **({} if tie is None else {"tie_word_embeddings": tie})},
                        tokenizer_dir)
    assert not any(name.endswith("lm_head.weight") for name in flat_params(mlx_lm.load(str(src))[0]))
    tokens = mx.array([TOKENS])
    for fmt in ("int8", "int4"):
        out = squishlike.compress(src, tmp_path / fmt, scheme=fmt, **ROUND_TO_NEAREST)
        assert NpyDir(out).entry("model.embed_tokens.weight").scheme == "passthrough"
        dense, _ = squishlike.load(out, tier="cold")
        served, _ = squishlike.load(out)  # on CPU as on a GPU: the quantized tier, read from the store
        assert type(served.model.layers[0].self_attn.q_proj).__name__ != "Linear"
        assert_same_weights(dense, served)
        mx.eval(served(tokens), dense(tokens))


@pytest.mark.parametrize("wrong", ["of the next layer", "transposed", "doubled"])
def test_the_check_names_a_wrong_tensor(wrong, tmp_path, tokenizer_dir):
    """What a wrong rule does to a weight of the store's model fails the sweep's check, naming the weight."""
    src = make_hf_model(tmp_path / "llama", ARCH_CONFIGS["llama"], tokenizer_dir)
    source = flat_params(mlx_lm.load(str(src))[0])
    out = squishlike.compress(src, tmp_path / "int4", scheme="int4", tiers=(), **OPTIONS["int4"])
    weights = flat_params(squishlike.load(out, tier="cold")[0])
    quantization = BITS["int4"], OPTIONS["int4"]["group_size"]
    assert_within_quantization(weights, source, *quantization)
    name = "model.layers.0.self_attn.o_proj.weight"
    weights[name] = {"of the next layer": weights[name.replace(".0.", ".1.")], "transposed": weights[name].T,
                     "doubled": 2 * weights[name]}[wrong]
    with pytest.raises(AssertionError, match=f"{name}: RMS error"):
        assert_within_quantization(weights, source, *quantization)


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
