"""GPTQ on every architecture the block runner runs, found from the model: the linears grouped by the input they
read, expert stacks GPTQ'd expert by expert on the rows routed to each, the output head found from the model.
The quality against mlx_lm's GPTQ, family by family, is measured by benchmarks/bench_families.py."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from support.arch_sweep import HAND
from support.tiny_models import TINY_CONFIGS, make_hf_model

import squishlike
from squishlike import calibration as calibrate, quant
from squishlike.calibration.gptq import EXPERT_MIN_ROWS, expert_factors, gptq, inverse_hessian_factor
from squishlike.calibration.linears import input_groups, vocabulary
from squishlike.calibration.lookup import RESIDUAL_PATHS, LookupProbe
from squishlike.calibration.plan import Calibrator
from squishlike.calibration.quantizer import Quantizer
from squishlike.compress_options import CompressOptions
from squishlike.calibration.stats import record, record_head, sample_positions
from squishlike.model import new_model
from squishlike.npydir import NpyDir
from squishlike.provider import WeightProvider

CALIB_TOKENS = 512


def runner_of(src):
    provider = WeightProvider.open(src)
    canonical = {provider.mlx_name(n): n for n in provider.names()}
    _, tokenizer, _ = provider.build_model()
    windows = calibrate.calibration_windows(tokenizer, max_tokens=CALIB_TOKENS)
    runner = calibrate.BlockRunner(new_model(provider.dense_config()), list(canonical),
                                   lambda names: ((n, provider.get(canonical[n])) for n in names), windows)
    return runner, canonical


def test_linears_are_grouped_by_the_input_they_read(tmp_path, tokenizer_dir):
    runner, canonical = runner_of(make_hf_model(tmp_path / "llama", TINY_CONFIGS["llama"], tokenizer_dir))
    runner.load(0)
    groups, left_out = input_groups(runner, 0, canonical, lambda name: True)
    assert [sorted(g.members) for g in groups] == [
        ["layers.0.attention.k.weight", "layers.0.attention.q.weight", "layers.0.attention.v.weight"],
        ["layers.0.attention.output.weight"],
        ["layers.0.ffn.gate.weight", "layers.0.ffn.up.weight"],
        ["layers.0.ffn.down.weight"],
    ]
    assert {g.kind for g in groups} == {"linears"} and left_out == {}


def test_an_expert_stack_is_one_group_recorded_with_each_rows_expert(tmp_path, tokenizer_dir):
    config = HAND["qwen3_moe"]
    runner, canonical = runner_of(make_hf_model(tmp_path / "moe", config, tokenizer_dir))
    runner.load(0)
    groups, _ = input_groups(runner, 0, canonical, lambda name: True)
    stacks = [g for g in groups if g.kind == "experts"]
    assert [sorted(m.rsplit(".", 2)[-2] for m in g.members) for g in stacks] == [["gate_proj", "up_proj"],
                                                                                  ["down_proj"]]
    calib, _ = record(runner, 0, stacks, sample_positions(runner.windows, 64))
    tokens = sum(len(w.tokens) - 1 for w in runner.windows)
    for g in stacks:  # every routed row is kept, whatever the picks: tokens x experts per token
        assert len(calib.samples[g.name]) == tokens * config["num_experts_per_tok"]
        assert calib.experts[g.name].shape == (len(calib.samples[g.name]),)
        assert set(np.unique(calib.experts[g.name])) == set(range(config["num_experts"]))


def test_the_heads_input_is_what_the_model_hands_it(tmp_path, tokenizer_dir):
    """The head, found from the model (its own linear, or the tied embedding's as_linear), records what the model's
    tail hands it: for llama, the final norm's output."""
    for config in (TINY_CONFIGS["llama"], TINY_CONFIGS["qwen2"]):  # own head; tied to the embedding
        runner, canonical = runner_of(make_hf_model(tmp_path / config["model_type"], config, tokenizer_dir))
        embedding, head = vocabulary(runner.model, canonical)
        assert embedding == "token_embedding.weight"
        assert head.members == ("output.weight" if "lm_head" in head.module else "token_embedding.weight",)
        for i in range(len(runner)):
            runner.load(i)
            runner.hidden = runner.run(i)
        picks = sample_positions(runner.windows, 10**6)
        got = record_head(runner, head, picks).samples["head"]
        norm = runner.module("model.norm")
        runner._load_outside(runner.vocabulary)
        want = np.concatenate([np.array(norm(h)).reshape(-1, got.shape[1]) for h in runner.hidden])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_gemma3_without_a_head_of_its_own_is_calibrated_tied(tmp_path, tokenizer_dir):
    """gemma3_text builds an lm_head and drops it in sanitize when the weights have none (a real Gemma 3's): the
    calibration model does the same, so the tied matrix is GPTQ'd for its use as the head, on what the final norm
    hands it, not left to the lookup's Hessian alone with the logits computed by a random head."""
    src = make_hf_model(tmp_path / "gemma", TINY_CONFIGS["gemma3_text"], tokenizer_dir, row_spread=1.0)
    params = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(src / "model.safetensors"), {k: v for k, v in params.items() if "lm_head" not in k},
                        metadata={"format": "pt"})
    provider = WeightProvider.open(src)
    calibrator = Calibrator(provider, CompressOptions(scheme="int4"), src)
    assert "lm_head" not in calibrator.model and calibrator.model.tie_word_embeddings
    assert calibrator.head.members == (calibrator.embedding,) == ("token_embedding.weight",)
    out = squishlike.compress(src, tmp_path / "int4", scheme="int4", calibration_max_tokens=CALIB_TOKENS)
    store = NpyDir(out)
    reason = store.entries["token_embedding.weight"].reason
    assert "compensated on the calibration inputs" in reason and "first layer" in reason
    assert store.manifest.extra["gptq"]["lookup"]["weight"]["lookup_to_head"] > 0
    model, _ = squishlike.load(out, tier="cold")
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3, 4]])))).item()


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_the_lookup_probe_measures_what_an_error_in_the_rows_costs_the_whole_model(tmp_path, tokenizer_dir,
                                                                                   model_type):
    """The probe, carried block by block beside the float pass, gives the KL that mlx_lm's whole model shows with
    the same error added to the rows its first window looks up, before the model's own scaling of a row (Gemma's
    sqrt(width), which the probe finds from the hidden state)."""
    src = make_hf_model(tmp_path / model_type, TINY_CONFIGS[model_type], tokenizer_dir, row_spread=1.0)
    runner, canonical = runner_of(src)
    embedding, _ = vocabulary(runner.model, canonical)
    rows = np.array(WeightProvider.open(src).get(embedding).astype(mx.float32))
    inputs = runner.windows[0].tokens[:-1]
    probe = LookupProbe.start(runner.hidden[0], rows[np.array(inputs)])
    for i in range(len(runner)):
        runner.load(i)
        runner.hidden = runner.run(i)
        probe.step(runner, i)
        runner.release(i)
    measured = probe.fisher_trace(runner)

    model, _ = mlx_lm.load(str(src))
    model.set_dtype(mx.float32)
    ids = mx.array(inputs)[None]
    clean = nn.log_softmax(model(ids), axis=-1)
    error = mx.array(np.random.default_rng(0).standard_normal((len(inputs), rows.shape[1])) * probe.sigma,
                     dtype=mx.float32)
    embed = model.model.embed_tokens

    class WithError(nn.Module):
        def __call__(self, x):
            return embed(x) + error

        def as_linear(self, x):
            return embed.as_linear(x)

    model.model.embed_tokens = WithError()
    noisy = nn.log_softmax(model(ids), axis=-1)
    kl = mx.mean(mx.sum(mx.exp(clean) * (clean - noisy), axis=-1)).item()
    assert measured > 0 and measured == pytest.approx(2 * kl / probe.sigma ** 2, rel=0.05)


def test_an_untied_embeddings_residual_path_is_the_one_whose_rounding_moves_the_logits_least(tmp_path, tokenizer_dir):
    """An untied embedding is GPTQ'd with the residual path's Hessian whose rounding, carried through every layer
    on the first calibration window, moved the logits least; the KL recorded for it is what mlx_lm's float32 model
    shows with the store's embedding in place of its own (every other weight float), on the same window."""
    src = make_hf_model(tmp_path / "llama", TINY_CONFIGS["llama"], tokenizer_dir, row_spread=1.0)
    store = NpyDir(squishlike.compress(src, tmp_path / "int4", scheme="int4", calibration_max_tokens=CALIB_TOKENS))
    record = store.manifest.extra["gptq"]["lookup"]["residual_path"]
    assert sorted(record["kl"]) == sorted(RESIDUAL_PATHS) and record["chosen"] == min(record["kl"], key=record["kl"].get)
    assert "what reads a looked-up row in the first layer" in store.entries["token_embedding.weight"].reason

    model, _ = mlx_lm.load(str(src))
    model.set_dtype(mx.float32)
    runner, _ = runner_of(src)
    ids = mx.array(runner.windows[0].tokens[:-1])[None]
    clean = nn.log_softmax(model(ids), axis=-1)
    stored, _ = squishlike.load(store.path, tier="cold")
    model.model.embed_tokens.weight = stored.model.embed_tokens.weight.astype(mx.float32)
    noisy = nn.log_softmax(model(ids), axis=-1)
    kl = mx.mean(mx.sum(mx.exp(clean) * (clean - noisy), axis=-1)).item()
    assert kl == pytest.approx(record["kl"][record["chosen"]], rel=0.01)  # the others are 20-140 % apart here


def test_a_rare_expert_is_pooled_with_its_stack():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 64)).astype(np.float32) * np.exp(rng.standard_normal(64)).astype(np.float32)
    experts = np.where(np.arange(400) < 3, 1, 0)  # expert 1 sees 3 rows, expert 2 none
    factors = expert_factors(x, experts, 3)
    mean = mx.array(x.T @ x / len(x))
    want = {0: inverse_hessian_factor(x[experts == 0]),  # over EXPERT_MIN_ROWS: its own rows alone
            1: inverse_hessian_factor(x[:3], prior=mean * (EXPERT_MIN_ROWS - 3)),
            2: inverse_hessian_factor(x[:0], prior=mean * EXPERT_MIN_ROWS)}
    for e, spans in want.items():
        np.testing.assert_allclose(factors[e][0].u, spans[0].u, rtol=1e-4, atol=1e-6)
    assert not np.allclose(factors[1][0].u, inverse_hessian_factor(x[:3])[0].u, atol=1e-3)


def test_each_expert_is_compensated_on_its_own_rows():
    """GPTQ of one expert on the rows routed to it lowers that expert's output error on them below rounding to
    nearest, and below GPTQ on the whole stack's rows."""
    rng = np.random.default_rng(1)
    mixing = [rng.standard_normal((16, 128)) * np.exp(rng.standard_normal(128)) for _ in range(2)]
    x = np.concatenate([rng.standard_normal((600, 16)) @ m for m in mixing]).astype(np.float32)
    experts = np.repeat([0, 1], 600)
    w = (rng.standard_normal((64, 128)) * 0.05).astype(np.float32)
    qz = Quantizer("int4", 64, "float32", clip_search=True)

    def error(parts, rows):
        w_hat = quant.dequantize("int4", *parts, group_size=64, scale_dtype="float32", out_dtype="float32")
        d = rows @ (w - w_hat).T
        return float(np.sum(d * d))

    own = x[experts == 1]
    per_expert = error(gptq(w, "float32", qz, expert_factors(x, experts, 2)[1]), own)
    pooled = error(gptq(w, "float32", qz, inverse_hessian_factor(x)), own)
    nearest = error(quant.quantize("int4", w, src_dtype="float32", group_size=64, scale_dtype="float32",
                                   clip_search=True), own)
    assert per_expert < 0.8 * pooled < 0.8 * nearest


def test_a_per_head_stack_whose_heads_read_one_input_is_gptqd_on_it(tmp_path, tokenizer_dir):
    """MLA's per-head stacks (deepseek_v3): `unembed_out`, every head reading the latent, takes its Hessian and
    GPTQ's rounding moves its output on the calibration latents less than rounding to nearest; `embed_q`, called
    transposed on the latent, is left out, saying why."""
    config = {**HAND["deepseek_v3"], "qk_nope_head_dim": 64, "v_head_dim": 64}  # every weight in groups of 64
    src = make_hf_model(tmp_path / "deepseek", config, tokenizer_dir, row_spread=1.0)
    unembed, embed_q = (f"model.layers.0.self_attn.{m}.weight" for m in ("unembed_out", "embed_q"))
    runner, canonical = runner_of(src)
    runner.load(0)
    groups, left_out = input_groups(runner, 0, canonical, lambda name: True)
    heads = [g for g in groups if g.kind == "heads"]
    assert [g.members for g in heads] == [(unembed,)]
    assert "called transposed" in left_out[embed_q]
    latents = record(runner, 0, heads, sample_positions(runner.windows, 10**6))[0].samples[heads[0].name]

    out = squishlike.compress(src, tmp_path / "int4", scheme="int4", calibration_max_tokens=CALIB_TOKENS)
    store = NpyDir(out)
    assert "GPTQ (" in store.entries[unembed].reason and "GPTQ" not in store.entries[embed_q].reason
    assert "called transposed" in store.manifest.extra["gptq"]["left_out"][embed_q]
    w = np.array(WeightProvider.open(src).get(unembed).astype(mx.float32))
    stored = np.array(WeightProvider.open(out).get(unembed).astype(mx.float32))
    nearest = Quantizer("int4", 64, "bfloat16", clip_search=True)(w.reshape(-1, w.shape[-1])).reshape(w.shape)

    def error(w_hat):  # every head's output error on the latents
        d = np.einsum("ni,hoi->nho", latents, w - w_hat)
        return float(np.sum(d * d))

    assert error(stored) < 0.8 * error(nearest)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe"])
def test_default_compress_gptqs_every_linear_of_any_family(tmp_path, tokenizer_dir, model_type):
    """gemma3 (once rounded to nearest: outside AWQ's family list) and a MoE."""
    config = TINY_CONFIGS.get(model_type) or HAND[model_type]
    src = make_hf_model(tmp_path / model_type, config, tokenizer_dir, row_spread=1.0)
    out = squishlike.compress(src, tmp_path / "int4", scheme="int4", calibration_max_tokens=CALIB_TOKENS)
    store = NpyDir(out)
    gptq_record = store.manifest.extra["gptq"]
    assert gptq_record["applied"] and gptq_record["left_out"] == {}
    quantized = {n: e for n, e in store.manifest.tensors.items() if e.scheme == "int4"}
    embedding, _ = vocabulary(new_model(WeightProvider.open(src).dense_config()),
                              {n: n for n in store.manifest.tensors})
    # Every int4 tensor but the input embedding (a lookup table, not a linear) is GPTQ'd
    assert {n for n, e in quantized.items() if "GPTQ" not in e.reason} <= {embedding, "token_embedding.weight"}
    stacks = {n for n, e in quantized.items() if len(e.shape) == 3}
    assert {n for n, e in quantized.items() if "GPTQ per expert" in e.reason} == stacks
    assert sorted(gptq_record.get("experts", {}).get("stacks", [])) == sorted(stacks)
    if model_type == "qwen3_moe":
        assert len(stacks) == 3 * config["num_hidden_layers"]
    model, _ = squishlike.load(out, tier="cold")
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3, 4]])))).item()


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True)])
def test_the_embedding_is_gptqd_on_what_reads_it_in_the_first_layer(tmp_path, tokenizer_dir, model_type, tied):
    """The token embedding is GPTQ'd along its width on the Hessian of what reads a looked-up row in the first
    layer (q, k and v through the input norm, found from the model): alone when untied, added to the head's inputs
    when tied. The manifest says so, the store loads, and without the option the embedding is rounded as before."""
    src = make_hf_model(tmp_path / model_type, TINY_CONFIGS[model_type], tokenizer_dir)
    option = "gptq_tied_lookup" if tied else "gptq_embedding"
    stores = {on: NpyDir(squishlike.compress(src, tmp_path / f"{model_type}-{on}", scheme="int4",
                                             calibration_max_tokens=CALIB_TOKENS, **{option: on}))
              for on in (True, False)}
    gptq_record = stores[True].manifest.extra["gptq"]["lookup"]
    assert sorted(gptq_record["readers"]) == [f"layers.0.attention.{x}.weight" for x in "kqv"]
    reason = stores[True].entries["token_embedding.weight"].reason
    assert "what reads a looked-up row in the first layer" in reason
    assert ("compensated on the calibration inputs" in reason) == tied
    assert "first layer" not in stores[False].entries["token_embedding.weight"].reason
    assert ("GPTQ" in stores[False].entries["token_embedding.weight"].reason) == tied
    codes = stores[True].entries["token_embedding.weight"].kind.suffixes[0]
    assert not np.array_equal(*(np.array(s.load_part("token_embedding.weight", codes)) for s in stores.values()))
    model, _ = squishlike.load(stores[True].path)
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))).item()


@pytest.mark.parametrize("options,message", [
    ({"gptq_embedding": "yes"}, "gptq_embedding='yes' is not True or False"),
    ({"gptq_tied_lookup": True, "gptq": False}, "gptq_tied_lookup=True is a GPTQ of the embedding, and GPTQ is off"),
])
def test_bad_lookup_options_are_refused_before_anything_is_written(tmp_path, tokenizer_dir, options, message):
    src = make_hf_model(tmp_path / "llama", TINY_CONFIGS["llama"], tokenizer_dir)
    with pytest.raises(ValueError, match=message):
        squishlike.compress(src, tmp_path / "out", scheme="int4", **options)
    assert not (tmp_path / "out").exists()


def test_the_command_s_lookup_flags_reach_the_manifest(tmp_path, tokenizer_dir):
    """`--no-gptq-embedding` and `--gptq-tied-lookup` are compress's options (a tied qwen2: the second applies, its
    readers are found); either without GPTQ is refused, named as the flag, before anything is written."""
    src = make_hf_model(tmp_path / "qwen2", TINY_CONFIGS["qwen2"], tokenizer_dir)

    def command(*flags):
        return subprocess.run([sys.executable, "-m", "squishlike", "compress", str(src), "-o", str(tmp_path / "out"),
                               "--scheme", "int4", "--no-awq", "--calibration-tokens", str(CALIB_TOKENS), *flags],
                              capture_output=True, text=True)

    for flag in ("--gptq-embedding", "--gptq-tied-lookup"):
        refused = command(flag, "--no-gptq")
        assert refused.returncode == 2 and f"{flag} is a GPTQ of the embedding, and GPTQ is off" in refused.stderr
        assert not (tmp_path / "out").exists()
    done = command("--no-gptq-embedding", "--gptq-tied-lookup")
    assert done.returncode == 0, done.stderr
    lookup = NpyDir(tmp_path / "out").manifest.extra["gptq"]["lookup"]
    weight = lookup.pop("weight")
    assert {**lookup, "readers": sorted(lookup["readers"])} == {
        "embedding": False, "tied": True, "readers": [f"layers.0.attention.{x}.weight" for x in "kqv"]}
    assert weight["lookup_to_head"] == pytest.approx(weight["lookup"] / weight["head"], rel=1e-3)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_first_block_is_read_once_when_the_embedding_is_gptqd(tmp_path, tokenizer_dir, monkeypatch, model_type):
    """The embedding's lookup probes block 0 in the first unit and leaves it loaded for the second, which runs it;
    its readers' Hessian is held for the tail, where the embedding (untied) or the tied matrix is GPTQ'd: the
    source's first block is read once per compress, as every other block is."""
    src = make_hf_model(tmp_path / model_type, TINY_CONFIGS[model_type], tokenizer_dir)
    reads = Counter()
    weights = Calibrator._weights

    def counted(self, names):
        reads.update(names)
        return weights(self, names)

    monkeypatch.setattr(Calibrator, "_weights", counted)
    store = NpyDir(squishlike.compress(src, tmp_path / "int4", scheme="int4", calibration_max_tokens=CALIB_TOKENS))
    assert store.manifest.extra["gptq"]["lookup"]["readers"]
    blocks = {n: c for n, c in reads.items() if n.startswith("model.layers.")}
    assert {n.split(".")[2] for n in blocks} == {"0", "1"} and set(blocks.values()) == {1}
