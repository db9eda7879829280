"""compress --rotate (squishlike/calibration/rotate.py): the rotated float model computes what the source does, on
real mlx_lm architectures; a rotated store loads through squishlike.load and, exported, through stock mlx_lm.load
with the same logits; bad values are refused before anything is written."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from support.tiny_models import TINY_CONFIGS, logits, make_hf_model

import squishlike
from squishlike.calibration.rotate import random_hadamard, rotate_source
from squishlike.cli import main
from squishlike.errors import FormatError
from squishlike.exporter import export
from squishlike.npydir import NpyDir
from squishlike.provider import WeightProvider

TOKENS = list(range(3, 60))


def test_random_hadamard_is_orthogonal_and_spreads_every_channel():
    for n in (64, 576, 96):
        q = random_hadamard(n, np.random.default_rng(0))
        assert np.abs(q @ q.T - np.eye(n)).max() < 1e-12
        assert np.abs(q).min() > 0  # an outlier channel lands on every rotated channel


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_the_rotated_float_model_has_the_source_logits(tmp_path, tokenizer_dir, arch):
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS[arch], tokenizer_dir, row_spread=0.5)
    rotated = tmp_path / "rotated"
    rotated.mkdir()
    with WeightProvider.open(source) as provider:
        record = rotate_source(provider, rotated)
    model, _ = mlx_lm.load(str(source))
    rotated_model, _ = mlx_lm.load(str(rotated))
    expected, got = logits(model, TOKENS), logits(rotated_model, TOKENS)
    assert mx.abs(got - expected).max().item() < 1e-4 * mx.abs(expected).max().item()
    assert record["heads"]["layers"] == TINY_CONFIGS[arch]["num_hidden_layers"]
    assert record["heads_pair"] == "self_attn.v_proj -> self_attn.o_proj"
    if arch == "gemma3_text":  # its norms on o's and down's outputs do not commute with a rotation
        assert not record["residual"]["applied"] and "layer 0" in record["residual"]["why_not"]
        assert mx.array_equal(model.model.embed_tokens.weight, rotated_model.model.embed_tokens.weight).item()
        return
    assert record["residual"]["applied"]
    weights = dict(mx.load(str(rotated / "model-layer-00000.safetensors")))
    assert mx.array_equal(weights["model.layers.0.input_layernorm.weight"], mx.ones(128)).item()  # folded
    config = json.loads((rotated / "config.json").read_text())
    tied = TINY_CONFIGS[arch]["tie_word_embeddings"]  # a tied head took the final norm: it is no longer the embedding
    assert record.get("untied_head") == ("lm_head.weight" if tied else None)
    assert config["tie_word_embeddings"] is False


def test_a_rotated_store_loads_and_exports_with_equal_logits(tmp_path, tokenizer_dir):
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS["qwen2"], tokenizer_dir, row_spread=0.5)
    store = squishlike.compress(source, tmp_path / "store", scheme="int4", awq=False, gptq=False,
                                rotate="hadamard")
    manifest = NpyDir(store).manifest
    rotation = manifest.extra["rotation"]
    assert rotation["residual"]["applied"] and rotation["untied_head"] == "lm_head.weight"
    assert manifest.source.path == str(source.absolute())  # the source named, not the rotated copy
    assert not list(tmp_path.glob(".store.tmp-rotated-*"))  # the rotated copy is gone
    model, _ = squishlike.load(store)
    exported = export(store, "mlx", tmp_path / "mlx", quantize=True, q_bits=4, q_group_size=64)
    stock, _ = mlx_lm.load(str(exported))
    ours, theirs = logits(model, TOKENS), logits(stock, TOKENS)
    assert mx.abs(ours - theirs).max().item() < 1e-4 * mx.abs(theirs).max().item()
    # and the rotation helped nothing break: the store is close to the source model
    reference, _ = mlx_lm.load(str(source))
    assert mx.mean(mx.argmax(ours, -1) == mx.argmax(logits(reference, TOKENS), -1)).item() > 0.5


def test_a_bad_rotation_is_refused_before_anything_is_written(tmp_path, tokenizer_dir, capsys):
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS["llama"], tokenizer_dir)
    with pytest.raises(ValueError, match=r"rotate='givens' is not a rotation compress offers; choose one of none, "
                                         r"hadamard, heads"):
        squishlike.compress(source, tmp_path / "out", rotate="givens")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit:
        main(["compress", str(source), "-o", str(tmp_path / "out"), "--rotate", "givens"])
    assert exit.value.code == 2 and "invalid choice: 'givens'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_heads_alone_keeps_a_tied_head_tied(tmp_path, tokenizer_dir):
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS["qwen2"], tokenizer_dir, row_spread=0.5)
    rotated = tmp_path / "rotated"
    rotated.mkdir()
    with WeightProvider.open(source) as provider:
        record = rotate_source(provider, rotated, "heads")
    assert not record["residual"]["applied"] and record["heads"]["layers"] == 2 and "untied_head" not in record
    assert json.loads((rotated / "config.json").read_text())["tie_word_embeddings"] is True
    model, _ = mlx_lm.load(str(source))
    rotated_model, _ = mlx_lm.load(str(rotated))
    expected, got = logits(model, TOKENS), logits(rotated_model, TOKENS)
    assert mx.abs(got - expected).max().item() < 1e-4 * mx.abs(expected).max().item()
    layer = dict(mx.load(str(rotated / "model-layer-00000.safetensors")))
    original = dict(mx.load(str(source / "model.safetensors")))
    v = "model.layers.0.self_attn.v_proj.weight"
    assert not mx.allclose(layer[v], original[v]).item()  # rotated, not copied


def test_a_size_target_pays_for_the_untied_head_and_plans_only_from_a_store_rotated_alike(tmp_path, tokenizer_dir):
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS["qwen2"], tokenizer_dir, row_spread=0.5)
    fast = {"gptq": False, "calibration_max_tokens": 256}
    first = squishlike.compress(source, tmp_path / "at6", bpw=6.0, rotate="hadamard", **fast)
    manifest = NpyDir(first).manifest
    params = manifest.extra["rotation"]["parameters"]  # the source's: the untied head is not counted
    assert params < sum(np.prod(e.shape) for e in manifest.tensors.values())
    raw = json.loads((first / "manifest.json").read_text())  # the stored tensors' bytes, as mlx_lm counts them
    stored = sum(part["size"] for entry in raw["tensors"].values() for part in entry["files"].values())
    assert 6.0 * 0.99 <= stored * 8 / params <= 6.0 * 1.01
    second = squishlike.compress(source, tmp_path / "at5", bpw=5.0, rotate="hadamard", sensitivity_from=first, **fast)
    assert NpyDir(second).manifest.extra["bpw"]["measured_in"] == str(first)
    with pytest.raises(FormatError, match="rotated otherwise"):
        squishlike.compress(source, tmp_path / "out", bpw=5.0, sensitivity_from=first, **fast)
    assert not (tmp_path / "out").exists()
