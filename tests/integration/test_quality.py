"""Quantization quality machinery on tiny real-architecture models: AWQ folding, the stored form after
scaling in every tier, mixed-precision entries in every tier, and the INT3 accuracy gate both ways.

The quality targets themselves (SmolLM2-135M) are measured by benchmarks/quality.py, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_tiers import ALL, TOKENS
from support.tiny_models import TINY_CONFIGS, assert_same_weights, cosine, logits, make_hf_model

import squishlike
from squishlike import calibration as calibrate
from mlx.utils import tree_flatten
from support.arch_sweep import ARCH_CONFIGS

from squishlike.calibration.linears import input_groups
from squishlike.calibration.stats import sample_positions
from squishlike.errors import AccuracyGateError, TierNotReadyError, UnsupportedArchitectureError
from squishlike.evaluation import prepare_for_eval
from squishlike.model import new_model
from squishlike.npydir import NpyDir
from squishlike.info import inspect_model
from squishlike.provider import WeightProvider
from squishlike.tiers import target
from squishlike.tiers.load import load_weights

CALIB_TOKENS = 512  # keep the float32 passes of the tests short


def amplified(path, factor: float):
    """Scale every matrix of the HF model at `path` by `factor`: confident predictions that quantization hurts."""
    file = path / "model.safetensors"
    params = mx.load(str(file))
    mx.save_safetensors(str(file), {k: v * factor if v.ndim == 2 else v for k, v in params.items()},
                        metadata={"format": "pt"})
    return path


@pytest.fixture
def loud_llama(tmp_path, tokenizer_dir):
    return amplified(make_hf_model(tmp_path / "loud", TINY_CONFIGS["llama"], tokenizer_dir), 4.0)


def float_model(provider):
    """The whole source model in float32: for checking the block-by-block pass, on tiny models only."""
    model, tokenizer, _ = provider.build_model()
    return prepare_for_eval(model), tokenizer


def source_weights(provider):
    canonical = {provider.mlx_name(n): n for n in provider.names()}
    return list(canonical), lambda names: ((n, provider.get(canonical[n])) for n in names)


# Besides the plain families: layers that take the hidden state second (talkie: the embeddings first) or by keyword
# (gptj), and layers that hand back more than the hidden state (a tuple), which the model hands on to later layers:
# rwkv7's first layer's values every later layer mixes in, gemma4's and hunyuan's keys and values a later layer
# attends to (shared keys: 2 of 4 layers; hunyuan's CLA: every second layer).
BLOCKWISE = {**{arch: TINY_CONFIGS.get(arch) or ARCH_CONFIGS[arch] for arch in
                ("llama", "qwen2", "qwen3", "gemma3_text", "talkie", "gptj", "rwkv7", "gemma4", "gemma4_text",
                 "hunyuan", "kimi_k3")},
             "gemma4_text shared keys": {**ARCH_CONFIGS["gemma4_text"], "num_hidden_layers": 4,
                                         "num_kv_shared_layers": 2},
             "hunyuan cla": {**ARCH_CONFIGS["hunyuan"], "num_hidden_layers": 4, "use_cla": True}}


def block_by_block(tmp_path, tokenizer_dir, config, trial=None):
    """Each block of the model made from `config` run alone over calibration windows, one block's weights loaded at
    a time, its outputs the next block's inputs (after `trial(runner, i)`, where given): for each window, the
    largest difference of the logits to the whole float32 model's, relative to their largest."""
    src = make_hf_model(tmp_path / "model", config, tokenizer_dir)
    with WeightProvider.open(src) as provider:
        model, tokenizer = float_model(provider)
        windows = calibrate.calibration_windows(tokenizer, max_tokens=200, window=64)
        runner = calibrate.BlockRunner(new_model(provider.dense_config()), *source_weights(provider), windows)
        hidden = runner.hidden
        for i in range(len(runner)):
            loaded = runner.load(i)
            assert all(a.dtype == mx.float32 for _, a in tree_flatten(loaded.parameters()))
            hidden = runner.run(i, hidden)
            if trial is not None:
                trial(runner, i)
            runner.release(i)
        differences = []
        for w, h in zip(windows, hidden):
            want = model(mx.array(w.tokens[:-1])[None])[0].astype(mx.float32)
            differences.append(mx.abs(runner.logits(h, w) - want).max().item() / max(1.0, mx.abs(want).max().item()))
        return differences


@pytest.mark.parametrize("arch", sorted(BLOCKWISE))
def test_blocks_one_at_a_time_give_the_whole_models_logits(tmp_path, tokenizer_dir, arch):
    """The block-by-block pass computes what the whole float32 model computes (gemma3's layers take masks of two
    kinds, sliding and global; what a layer hands on to later layers is its own run's), with one block's weights
    loaded at a time."""
    assert max(block_by_block(tmp_path, tokenizer_dir, BLOCKWISE[arch])) <= 1e-4


def test_a_blocks_trial_runs_do_not_change_what_later_blocks_take(tmp_path, tokenizer_dir):
    """rwkv7's later layers take values its first layer hands on. Runs of a block with other weights after its
    float run (AWQ's trials, mixed precision's rounded weights) leave the later blocks what the float run made."""
    def trial(runner, i):
        weights = [(runner.slots[i].prefix + n, a * 2) for n, a in tree_flatten(runner.block(i).parameters())]
        runner.set_weights(i, weights)
        runner.evaluate(i, [runner.forward(i, w, h) for w, h in enumerate(runner.hidden)])
        runner.set_weights(i, [(n, a / 2) for n, a in weights])

    config = {**ARCH_CONFIGS["rwkv7"], "num_hidden_layers": 3}
    assert max(block_by_block(tmp_path, tokenizer_dir, config, trial)) <= 1e-4


@pytest.mark.parametrize("arch,config,why", [
    ("afm7", ARCH_CONFIGS["afm7"], "layer 0 is handed a ConcatenateKVCache"),
    ("deepseek_v41", ARCH_CONFIGS["deepseek_v41"], "layer 0 is handed a LayerCache"),
    ("iquestloopcoder", ARCH_CONFIGS["iquestloopcoder"], "does not call every layer once"),
    ("kimi_k3", {**ARCH_CONFIGS["kimi_k3"], "text_config": {**ARCH_CONFIGS["kimi_k3"]["text_config"],
                                                            "attn_res_block_size": 1}},
     "its layers hand on a ResidualBlocks"),
])
def test_models_whose_layers_cannot_run_alone_are_refused_saying_why(tmp_path, tokenizer_dir, arch, config, why):
    """Layers that exchange state through objects (a cache the model reads keys from after the layer ran, a list
    each layer appends to), or whose weights the model uses without calling the layer: a typed error naming it."""
    src = make_hf_model(tmp_path / arch, config, tokenizer_dir)
    with WeightProvider.open(src) as provider:
        _, tokenizer = float_model(provider)
        windows = calibrate.calibration_windows(tokenizer, max_tokens=200, window=64)
        with pytest.raises(UnsupportedArchitectureError, match=f"{arch}: cannot run one layer at a time: .*{why}"):
            calibrate.BlockRunner(new_model(provider.dense_config()), *source_weights(provider), windows)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_windows_side_by_side_compute_what_one_window_at_a_time_does(tmp_path, tokenizer_dir, arch):
    """A block's windows run on their own streams, evaluated together: bit for bit the outputs of one window after
    another."""
    src = make_hf_model(tmp_path / arch, TINY_CONFIGS[arch], tokenizer_dir)
    with WeightProvider.open(src) as provider:
        _, tokenizer = float_model(provider)
        windows = calibrate.calibration_windows(tokenizer, max_tokens=200, window=64)
        runner = calibrate.BlockRunner(new_model(provider.dense_config()), *source_weights(provider), windows)
        assert len(windows) > 2
        runner.load(0)
        together = runner.run(0)
        for w, h in enumerate(runner.hidden):
            alone = runner.forward(0, w, h)
            runner.evaluate(0, [alone])
            assert mx.array_equal(alone, together[w]).item(), w


def test_a_model_whose_layers_cannot_run_alone_is_compressed_uncalibrated(tmp_path, tokenizer_dir):
    """afm7's last layers attend to keys the model reads out of an earlier layer's cache: no block can be run
    alone, so compress rounds to nearest and says why in the manifest."""
    src = make_hf_model(tmp_path / "afm7", ARCH_CONFIGS["afm7"], tokenizer_dir)
    with pytest.warns(UserWarning, match="calibration stopped"):
        out = squishlike.compress(src, tmp_path / "t4", scheme="int4", calibration_max_tokens=128)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "is handed a ConcatenateKVCache" in manifest["calibration"]["stopped"]
    assert manifest["gptq"]["applied"] is False
    squishlike.load(out)


def test_a_model_whose_layers_hand_back_more_than_the_hidden_state_is_calibrated(tmp_path, tokenizer_dir):
    """gemma4's layers return (hidden state, keys and values, offset): run one at a time, calibrated all through."""
    src = make_hf_model(tmp_path / "gemma4", ARCH_CONFIGS["gemma4_text"], tokenizer_dir)
    out = squishlike.compress(src, tmp_path / "g4", scheme="int4", calibration_max_tokens=128)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "stopped" not in manifest["calibration"]
    assert manifest["gptq"]["applied"] is True
    squishlike.load(out)


# model type -> (AWQ groups a layer, readers a layer with no exact fold). phi: attention and MLP read one LayerNorm
# (with bias), dense folds into v, fc2 reads a GELU. gpt2: c_attn (q, k, v fused) and c_fc read LayerNorms, the
# attention's c_proj folds into c_attn's last third of rows, the MLP's reads a GELU. phi3: qkv_proj and gate_up_proj
# are fused, o and down fold into their slices. gemma3: norms that scale by 1 + w.
FOLDS = {"llama": (4, 0), "qwen2": (4, 0), "qwen3": (4, 0), "gemma3_text": (4, 0), "phi": (2, 1), "gpt2": (3, 1),
         "phi3": (4, 0)}


@pytest.mark.parametrize("arch", sorted(FOLDS))
def test_awq_folds_found_from_the_model_are_exact_in_float(tmp_path, tokenizer_dir, arch):
    """The folds AWQ finds by trying them (awq.fold_groups): scaling columns and folding 1/s into the norms (their
    bias too; (1 + w) for Gemma's), v rows (GQA-tied) and up rows changes nothing in float, at alpha = 1."""
    config = TINY_CONFIGS.get(arch) or ARCH_CONFIGS[arch]
    src = make_hf_model(tmp_path / arch, config, tokenizer_dir)
    with WeightProvider.open(src) as provider:
        model, tokenizer = float_model(provider)
        names, weights = source_weights(provider)
        canonical = {provider.mlx_name(n): n for n in provider.names()}
        windows = calibrate.calibration_windows(tokenizer, max_tokens=CALIB_TOKENS)
        runner = calibrate.BlockRunner(new_model(provider.dense_config()), names, weights, windows)
        transform, verified, layers = calibrate.Transform(), {}, len(runner)
        for i in range(layers):
            runner.load(i)
            readers, _ = input_groups(runner, i, canonical, lambda name: True)
            groups, no_fold = calibrate.fold_groups(runner, i, canonical, readers, provider.config, verified)
            assert (len(groups), len(no_fold)) == FOLDS[arch], (groups, no_fold)
            calib, runner.hidden = calibrate.record(runner, i, groups, sample_positions(windows, 64))
            for g in groups:  # alpha = 1: the strongest scaling the search can pick
                calibrate.add_scales(transform, g, calibrate.group_scales(g, calib.abs_mean[g.name], 1.0))
            runner.release(i)
        spread = max(float(s.max() / s.min()) for s in transform.col.values())
        assert spread > 2.0  # a real rescaling, not the identity
        folded, _ = float_model(provider)
        folded.load_weights([
            (provider.mlx_name(n), mx.array(transform.apply(n, np.array(provider.get(n), np.float32))))
            for n in provider.names()
        ])
    a, b = logits(model, TOKENS), logits(folded, TOKENS)
    assert mx.abs(a - b).max().item() <= 1e-4 * max(1.0, mx.abs(a).max().item())
    before, after = (dict(tree_flatten(m.parameters())) for m in (model, folded))
    norms = [n for n in before if n.endswith("layers.0.input_layernorm.weight") or n.endswith("h.0.ln_1.weight")]
    assert norms and not np.allclose(np.array(before[norms[0]]), np.array(after[norms[0]]))  # 1/s lives there


def test_a_gemma_store_keeps_its_norms_offset_through_the_awq_search(tmp_path, tokenizer_dir):
    """Gemma's norms scale by 1 + w: the search's folds must carry that offset into the store. A trained Gemma's
    norm weights are far from 0 (a real Gemma 3's 1 + w spans 0 to 150) and its activations have outlier channels,
    so a fold taken as w / s instead of (1 + w) / s - 1 changed a real Gemma 3's function (KL 18.8); at INT8 an
    exact fold leaves the store as close to the source as plain rounding."""
    src = make_hf_model(tmp_path / "gemma", TINY_CONFIGS["gemma3_text"], tokenizer_dir)
    file = src / "model.safetensors"
    params = mx.load(str(file))
    mx.random.seed(3)
    for k, v in params.items():
        if k.endswith("layernorm.weight"):  # 1 + w from 0.1 to 10, log-normal, as a trained model's
            params[k] = mx.exp(mx.random.normal(v.shape)) - 1.0
        elif k.endswith("embed_tokens.weight"):  # a few loud channels
            params[k] = v * mx.where(mx.arange(v.shape[1]) % 16 == 0, 8.0, 1.0)
    mx.save_safetensors(str(file), params, metadata={"format": "pt"})
    with WeightProvider.open(src) as provider:
        model, _ = float_model(provider)
    reference = logits(model, TOKENS)
    errors = {}
    for awq in (True, False):
        out = squishlike.compress(src, tmp_path / f"awq-{awq}", scheme="int8", awq=awq, gptq=False,
                                  clip_search=False, calibration_max_tokens=CALIB_TOKENS)
        if awq:
            groups = json.loads((out / "manifest.json").read_text())["awq"]["groups"]
            assert any(g["alpha"] > 0 for g in groups.values())  # the norms' folds were taken
        store, _ = squishlike.load(out, tier="cold")
        errors[awq] = mx.abs(logits(store, TOKENS) - reference).max().item()
    assert errors[True] <= 2 * errors[False], errors


@pytest.mark.parametrize("fmt,scheme,native", [("int4", "int4", "int4"), ("int8", "int8g", "int8")])
def test_awq_store_is_plain_and_identical_in_every_tier(loud_llama, tmp_path, fmt, scheme, native):
    out = squishlike.compress(loud_llama, tmp_path / "awq", scheme=fmt, awq=True, clip_search=True,
                              calibration_max_tokens=CALIB_TOKENS, tiers=ALL)
    manifest = json.loads((out / "manifest.json").read_text())
    awq = manifest["awq"]
    assert awq["applied"] and len(awq["groups"]) == 8
    assert all(0 <= g["alpha"] <= 1 and g["error_ratio"] <= 1.0 for g in awq["groups"].values())
    assert any(g["alpha"] > 0 for g in awq["groups"].values())
    assert manifest["calibration"]["text"] == "calibration" and manifest["calibration"]["tokens"] <= CALIB_TOKENS
    store = NpyDir(out)
    assert {e.scheme for n, e in store.entries.items() if n.endswith("attention.q.weight")} == {scheme}

    cold, _ = squishlike.load(out)  # builds every tier from the store
    assert load_weights(store).tier == target(store).name
    quantized, _ = squishlike.load(out, tier=native)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in quantized.named_modules())
    for tier in (native, "mlx", "finalized", "cold"):
        assert_same_weights(cold, squishlike.load(out, tier=tier)[0])
    reference, _ = squishlike.load(loud_llama)
    # still the same model, roughly: on this random model the 4-bit store's logits have cosine 0.84-0.94 to the
    # source's by seed (0.89 and 0.90 at seed 0 with the embedding GPTQ'd and not); a wrong tier gives about 0
    assert cosine(logits(cold, TOKENS), logits(reference, TOKENS)) > 0.8


@pytest.mark.parametrize("fmt,scheme,kept,options", [
    ("int4", "int4", "int8", {}),
    ("int8", "int8g", "passthrough", {}),
    # kept exact in the runtime dtype, not float32
    ("int8", "int8", "passthrough", {"awq": True, "dtype": "bfloat16", "group_size": "row"}),
])
def test_mixed_precision_entries_load_in_every_tier(loud_llama, tmp_path, fmt, scheme, kept, options):
    """INT4/INT3 stores keep the most sensitive tensors at INT8; INT8 stores keep them exact (passthrough)."""
    out = squishlike.compress(loud_llama, tmp_path / "mixed", scheme=fmt, mixed_precision=0.25,
                              calibration_max_tokens=CALIB_TOKENS, tiers=ALL, **options)
    manifest = json.loads((out / "manifest.json").read_text())
    report = manifest["mixed_precision"]
    promoted = report["tensors"]
    assert promoted and report["extra_bytes"] <= 0.25 * report["base_bytes"] and report["promoted_to"] == kept
    assert report["estimated_loss_increase"]["mixed"] < report["estimated_loss_increase"]["all_base"]
    entries = manifest["tensors"]
    for name, e in entries.items():
        if name in promoted:
            assert e["scheme"] == kept and e["reason"].startswith("mixed precision"), name
            assert ("error" in e) == (kept != "passthrough")
        elif name.startswith("layers.") and name.endswith(".weight") and "norm" not in name:
            assert e["scheme"] == scheme, name
    store = NpyDir(out)
    cold, _ = squishlike.load(out)
    if kept == "passthrough":  # exact: stored in the runtime dtype, what the budget counted
        assert all(entries[name]["stored_dtype"] == store.runtime_dtype for name in promoted)
        if not options:  # float32 source and runtime, no scaling: the source's own values
            with WeightProvider.open(loud_llama) as provider:
                for name in promoted:
                    assert np.array_equal(store.dequantize(name), np.array(provider.get(name))), name
        tiers = ("int8", "mlx", "finalized", "cold") if scheme == "int8g" else ("mlx", "finalized", "cold")
    else:
        int4, _ = squishlike.load(out, tier="int4")
        modules = dict(int4.named_modules())
        for name in promoted:  # the 4-bit tier holds the INT8 tensors dense (linears, or the embedding)
            assert type(modules[store.entries[name].source_name.removesuffix(".weight")]) in (nn.Linear, nn.Embedding)
        assert any(isinstance(m, nn.QuantizedLinear) for m in modules.values())
        tiers = ("int4", "mlx", "finalized", "cold")
    for tier in tiers:
        assert_same_weights(cold, squishlike.load(out, tier=tier)[0])


def _int3(src, out, bound: float):
    return squishlike.compress(src, out, scheme="int3", group_size=32, awq=True, int3_max_ppl_increase=bound,
                               calibration_max_tokens=CALIB_TOKENS)


def test_int3_gate_passes_with_a_loose_bound(tiny_llama, tmp_path):
    out = _int3(tiny_llama, tmp_path / "loose", 1.0)
    gate = NpyDir(out).manifest.int3_gate
    assert gate["passed"] is True and gate["bound"] == 1.0 and gate["text"] == "calibration"
    assert gate["candidate_ppl"] > 0 and gate["reference_ppl"] > 0 and gate["tokens"] == CALIB_TOKENS - 1
    assert gate["increase"] == pytest.approx(gate["candidate_ppl"] / gate["reference_ppl"] - 1, abs=1e-5)
    assert "within the bound" in gate["reason"]
    cold, _ = squishlike.load(out, tier="cold")
    int3, _ = squishlike.load(out)  # the 3-bit tier, read from the store: the gate passed
    assert any(isinstance(m, nn.QuantizedLinear) and m.bits == 3 for _, m in int3.named_modules())
    assert_same_weights(cold, int3)


def test_int3_gate_fails_with_a_tight_bound(tiny_llama, tmp_path):
    """The same store measured again (compress is deterministic) against a bound just under its measured increase:
    it is not written, and nothing is left beside where it would have gone."""
    measured = NpyDir(_int3(tiny_llama, tmp_path / "first", 1.0)).manifest.int3_gate["increase"]
    with pytest.raises(AccuracyGateError, match="fails its accuracy gate") as failed:
        _int3(tiny_llama, tmp_path / "tight", measured - 0.005)
    assert "over the bound" in str(failed.value) and "scheme=int4" in str(failed.value)
    assert not (tmp_path / "tight").exists() and not list(tmp_path.glob(".tight*"))
    assert NpyDir(_int3(tiny_llama, tmp_path / "just", measured + 0.005)).manifest.int3_gate["passed"] is True


def test_int3_gate_skipped_writes_the_store_without_its_tier(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "skipped", scheme="int3", group_size=32, int3_gate=False)
    gate = NpyDir(out).manifest.int3_gate
    assert gate["passed"] is False and "skipped" in gate["reason"]
    squishlike.load(out)  # the cold path builds what the policy wants: not the 3-bit tier
    with pytest.raises(TierNotReadyError, match="did not pass the INT3 accuracy gate"):
        squishlike.load(out, tier="int3")
    assert inspect_model(out)["store"]["int3_gate"]["reason"] == gate["reason"]
    shown = subprocess.run([sys.executable, "-m", "squishlike", "inspect", str(out)], capture_output=True, text=True)
    assert shown.returncode == 0 and "no 3-bit tier: the INT3 accuracy gate was skipped" in shown.stdout


def test_cli_int3_gate_failure_exits_1_and_names_the_options(tiny_llama, tmp_path):
    measured = NpyDir(_int3(tiny_llama, tmp_path / "first", 1.0)).manifest.int3_gate["increase"]
    out = tmp_path / "cli3"
    bound = f"{measured - 0.005:.6f}"
    done = subprocess.run(
        [sys.executable, "-m", "squishlike", "compress", str(tiny_llama), "-o", str(out), "--scheme", "int3",
         "--group-size", "32", "--awq", "--int3-max-ppl-increase", bound, "--calibration-tokens", str(CALIB_TOKENS)],
        capture_output=True, text=True,
    )
    assert done.returncode == 1, done.stderr
    error = done.stderr.splitlines()[-1]
    assert error.startswith(f"squishlike compress: error: {out}: not written: the INT3 store fails its accuracy gate")
    for option in ("--scheme int4", "--mixed-precision 0.1", f"--int3-max-ppl-increase {float(bound)}"):
        assert option in error, error
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["first", "llama"]


def test_awq_scales_a_family_outside_the_rule_tables(tmp_path, tokenizer_dir):
    """phi3 (mlx_lm's names, fused qkv and gate_up projections): AWQ folds found from the model, applied; a MoE's
    groups without a fold are named, with why."""
    src = make_hf_model(tmp_path / "phi3", ARCH_CONFIGS["phi3"], tokenizer_dir)
    out = squishlike.compress(src, tmp_path / "p4", scheme="int4", calibration_max_tokens=CALIB_TOKENS)
    awq = NpyDir(out).manifest.extra["awq"]
    assert awq["applied"] and len(awq["groups"]) == 4 * ARCH_CONFIGS["phi3"]["num_hidden_layers"]
    assert awq["no_fold"] == {}
    moe = make_hf_model(tmp_path / "moe", ARCH_CONFIGS["qwen3_moe"], tokenizer_dir)
    out = squishlike.compress(moe, tmp_path / "m4", scheme="int4", calibration_max_tokens=CALIB_TOKENS)
    awq = NpyDir(out).manifest.extra["awq"]
    # The router reads the MoE block's norm, which the expert stacks read too: no fold into it is exact
    assert awq["applied"] and {n.rsplit(".", 1)[-1]: why for n, why in awq["no_fold"].items()} == {
        "gate": "no module whose output it reads takes 1/s exactly", "up_proj": "an expert stack: not scaled",
        "down_proj": "an expert stack: not scaled"}
