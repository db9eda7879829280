"""The default store against mlx_lm's own conversion of the same model: no more bytes at rest than
`mlx_lm.convert -q` at the same bits (the weights, and on SmolLM2 every file of the directory), every tier holding
the cold path's weights, and on SmolLM2 a default INT4 closer to the source than plain round-to-nearest at no more
bytes."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from test_tiers import ALL
from support.tiny_models import TINY_CONFIGS, assert_same_weights, make_hf_model

import squishlike
from squishlike import evaluation as ev
from squishlike.exporter import export
from squishlike.npydir import NpyDir


def weights_at_rest(directory) -> int:
    """Bytes of the weights themselves: the arrays of a store's tensors/ (before its first load builds caches) or
    of mlx_lm's safetensors, without the files' headers (128 bytes per .npy part, one JSON header per safetensors
    file) and side files, which benchmarks/README.md counts separately."""
    arrays = [np.load(p, mmap_mode="r") for p in directory.glob("tensors/*.npy")]
    arrays += [np.asarray(a.view(mx.uint8)) for f in directory.glob("*.safetensors") for a in mx.load(str(f)).values()]
    return sum(a.nbytes for a in arrays)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an own lm_head, and one tied to the embedding
def test_default_int4_no_bigger_than_mlx_lm_4bit_and_same_in_every_tier(tmp_path, tokenizer_dir, arch):
    # A vocabulary of a real model's proportions (the embedding a large share of the weights), so that the weights,
    # not the tokenizer files both directories hold, make most of the bytes.
    src = make_hf_model(tmp_path / arch, {**TINY_CONFIGS[arch], "vocab_size": 8192}, tokenizer_dir)
    mlx_out = tmp_path / "mlx_lm"
    mlx_lm.convert(str(src), str(mlx_out), quantize=True, q_bits=4, q_group_size=64)
    out = squishlike.compress(src, tmp_path / "store", scheme="int4", tiers=ALL, calibration_max_tokens=512)
    assert weights_at_rest(out) <= weights_at_rest(mlx_out)

    store = NpyDir(out)
    heads = [e for n, e in store.entries.items() if n in ("token_embedding.weight", "output.weight")]
    assert heads and all(e.scheme == "int4" for e in heads)  # quantized, as mlx_lm.convert -q does
    assert any("GPTQ" in e.reason for e in store.entries.values())
    cold, _ = squishlike.load(out, tier="cold")
    for tier in ("int4", "mlx", "finalized"):
        assert_same_weights(cold, squishlike.load(out, tier=tier)[0])


def every_file(directory) -> int:
    """Bytes of every file under `directory`: for a store, taken before any load (so no cache)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def smollm2_int4(tmp_path_factory, smollm_gguf) -> dict:
    """SmolLM2's default INT4 store (calibrated on 512 tokens, what a test can afford) and a round-to-nearest one at
    mlx_lm's grid: name -> (directory, its every_file bytes as compress left it)."""
    root = tmp_path_factory.mktemp("smollm2-int4")
    stores = {
        "default": squishlike.compress(smollm_gguf, root / "default", scheme="int4", calibration_max_tokens=512),
        "rtn": squishlike.compress(smollm_gguf, root / "rtn", scheme="int4", group_size=64, awq=False, gptq=False,
                                   clip_search=False),
    }
    return {name: (path, every_file(path)) for name, path in stores.items()}


def test_default_stores_of_smollm2_no_bigger_than_mlx_lm_convert(smollm2_int4, smollm_gguf, tmp_path):
    """Every file, tokenizer and manifest included, against `mlx_lm.convert -q` of the same model (the GGUF exported
    to HF) at the same bits and group size, with bfloat16 scales (as mlx-community's models and the store hold them;
    convert's float32 default would be the bigger baseline)."""
    hf = export(smollm_gguf, "hf", tmp_path / "hf")
    int8 = squishlike.compress(smollm_gguf, tmp_path / "int8", scheme="int8")
    for bits, store_bytes in ((4, smollm2_int4["default"][1]), (8, every_file(int8))):
        mlx_out = tmp_path / f"mlx_lm-{bits}bit"
        mlx_lm.convert(str(hf), str(mlx_out), quantize=True, q_bits=bits, q_group_size=64, dtype="bfloat16")
        assert store_bytes <= every_file(mlx_out), (bits, store_bytes, every_file(mlx_out))


def test_default_int4_closer_to_smollm2_than_round_to_nearest(smollm2_int4, smollm_gguf):
    """KL to the source on real prose: the default (AWQ, GPTQ, clip search) against plain RTN at mlx_lm's grid."""
    (calibrated, _), (rtn, _) = smollm2_int4["default"], smollm2_int4["rtn"]
    assert weights_at_rest(calibrated) <= weights_at_rest(rtn)

    reference, tokenizer = ev.load_float32(smollm_gguf)
    windows = ev.token_windows(tokenizer, ev.load_text("eval_prose"), max_tokens=256)
    cache = ev.ReferenceCache(reference, windows)
    kl = {path.name: ev.compare(ev.prepare_for_eval(squishlike.load(path, tier="cold")[0]), cache, windows)["kl_mean"]
          for path in (calibrated, rtn)}
    assert kl["default"] < 0.8 * kl["rtn"], kl
