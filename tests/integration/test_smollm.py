"""The embedded default, SmolLM2-135M (docs/format.md §13), end to end: compress, every tier, the invariant, Paris."""

from __future__ import annotations

import pytest
from mlx_lm import generate
from support.options import ROUND_TO_NEAREST
from support.tiny_models import assert_same_weights, disk_bytes

import squishlike
from squishlike.cpu_layers import CpuQuantizedLinear
from squishlike.npydir import NpyDir
from squishlike.tiers import order

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stores(smollm_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm")
    return {
        fmt: squishlike.compress(smollm_gguf, root / fmt, scheme=fmt, tiers=("mlx", "finalized", "int8", "int4"),
                                  **ROUND_TO_NEAREST)
        for fmt in ("int8", "int4")
    }


def answer(model, tokenizer) -> str:
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return generate(model, tokenizer, prompt, max_tokens=12)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_every_tier_identical_and_answers_paris(stores, fmt):
    out = stores[fmt]
    cold, tokenizer = squishlike.load(out)  # builds the caches
    assert "Paris" in answer(cold, tokenizer)
    tiers = ["mlx", "finalized", "cold", fmt]  # int8 and int4 stores have their native tier of the same name
    # Every tier holds the very weights that just answered (the 4-bit and 8-bit tiers as exact repacks), so each
    # answers the same; generating again through CPU quantized matmuls would only cost time.
    for tier in tiers:
        model, _ = squishlike.load(out, tier=tier)
        assert_same_weights(cold, model)


def test_store_is_smaller_and_records_the_source(stores, smollm_gguf):
    store = NpyDir(stores["int4"])
    assert store.manifest.source.format == "gguf"
    assert store.manifest.model_type == "llama"
    assert len([n for n in store.entries if n.startswith("layers.")]) == 30 * 9
    int4_bytes = sum(r.size for r in store.part_files().values())
    int8_bytes = sum(r.size for r in NpyDir(stores["int8"]).part_files().values())
    assert int4_bytes < int8_bytes
    assert "output.weight" not in store.entries  # tied embeddings


def test_a_first_cpu_load_keeps_the_disk_within_the_budget(smollm_gguf, tmp_path, monkeypatch):
    """The default INT4 store on CPU is read straight from the store as the int4 model, so nothing is written."""
    monkeypatch.setattr(order, "device_kind", lambda: "cpu")
    out = squishlike.compress(smollm_gguf, tmp_path / "int4", scheme="int4", **ROUND_TO_NEAREST)
    store_bytes = disk_bytes(out)
    model, tokenizer = squishlike.load(out)
    assert "Paris" in answer(model, tokenizer)
    assert disk_bytes(out) <= 1.1 * store_bytes
    assert any(isinstance(m, CpuQuantizedLinear) for _, m in model.named_modules())

