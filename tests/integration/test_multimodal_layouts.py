"""Multimodal checkpoints in their real Hugging Face layout: squishlike reads their text model as mlx_lm.load does.

The checkpoints here have the names and config.json shape of the real ones, vision weights included, in two
safetensors shards with an index: Gemma 3 (Gemma3ForConditionalGeneration: `language_model.model.`,
`vision_tower.vision_model.`, `multi_modal_projector.`; config with text_config and vision_config) and Qwen2-VL
(Qwen2VLForConditionalGeneration: `model.` and `lm_head.`, `visual.`; the text fields at the top of config.json,
with vision_config). mlx_lm's models of both are text-only: their sanitize drops the vision tower, and so must
every path of squishlike's.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.utils import sharded_load as mlx_lm_sharded_load
import pytest
from support.arch_sweep import ARCH_CONFIGS
from support.tiny_models import assert_same_weights, flat_params, make_hf_model

import squishlike
from squishlike.errors import UnsupportedArchitectureError
from squishlike.npydir import NpyDir

TOKENS = mx.array([[(5 * i + 1) % 300 for i in range(48)]])
VISION = 64  # the tiny vision towers' width


def siglip_tower() -> dict[str, tuple[int, ...]]:
    tower = "vision_tower.vision_model."
    shapes = {f"{tower}embeddings.patch_embedding.weight": (VISION, 3, 14, 14),
              f"{tower}embeddings.patch_embedding.bias": (VISION,),
              f"{tower}embeddings.position_embedding.weight": (16, VISION),
              f"{tower}post_layernorm.weight": (VISION,), f"{tower}post_layernorm.bias": (VISION,),
              "multi_modal_projector.mm_input_projection_weight": (VISION, 128),
              "multi_modal_projector.mm_soft_emb_norm.weight": (VISION,)}
    for layer in range(2):
        block = f"{tower}encoder.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{block}self_attn.{proj}.weight": (VISION, VISION), f"{block}self_attn.{proj}.bias": (VISION,)}
        shapes |= {f"{block}layer_norm1.weight": (VISION,), f"{block}layer_norm2.weight": (VISION,),
                   f"{block}mlp.fc1.weight": (2 * VISION, VISION), f"{block}mlp.fc2.weight": (VISION, 2 * VISION)}
    return shapes


def qwen2_vl_visual() -> dict[str, tuple[int, ...]]:
    shapes = {"visual.patch_embed.proj.weight": (VISION, 3, 2, 14, 14), "visual.merger.ln_q.weight": (VISION,),
              "visual.merger.mlp.0.weight": (4 * VISION, 4 * VISION), "visual.merger.mlp.2.weight": (128, 4 * VISION)}
    for layer in range(2):
        block = f"visual.blocks.{layer}."
        shapes |= {f"{block}norm1.weight": (VISION,), f"{block}norm2.weight": (VISION,),
                   f"{block}attn.qkv.weight": (3 * VISION, VISION), f"{block}attn.qkv.bias": (3 * VISION,),
                   f"{block}attn.proj.weight": (VISION, VISION), f"{block}mlp.fc1.weight": (2 * VISION, VISION),
                   f"{block}mlp.fc2.weight": (VISION, 2 * VISION)}
    return shapes


GEMMA3 = {
    "config": {**ARCH_CONFIGS["gemma3"], "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 4,
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": VISION, "num_hidden_layers": 2,
                                 "intermediate_size": 2 * VISION, "num_attention_heads": 4, "patch_size": 14,
                                 "image_size": 56}},
    "hf_name": lambda name: name,  # mlx_lm's names are the checkpoint's: language_model.model.layers...
    "vision": siglip_tower(),
}
QWEN2_VL = {
    # the text model's fields at the top, as Qwen2-VL's own config.json has them
    "config": {**ARCH_CONFIGS["qwen2_vl"]["text_config"], "model_type": "qwen2_vl", "tie_word_embeddings": False,
               "architectures": ["Qwen2VLForConditionalGeneration"],
               "vision_config": {"depth": 2, "embed_dim": VISION, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 2,
                                 "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}},
    "hf_name": lambda name: name.removeprefix("language_model."),  # model.layers..., lm_head
    "vision": qwen2_vl_visual(),
}


def real_layout(directory: Path, checkpoint: dict, tokenizer_dir: Path) -> Path:
    """A random-weight checkpoint in its real HF layout: text weights under the checkpoint's names, vision weights,
    two shards and their index."""
    src = make_hf_model(directory, checkpoint["config"], tokenizer_dir, row_spread=1.5)
    text = {checkpoint["hf_name"](name): value for name, value in mx.load(str(src / "model.safetensors")).items()}
    vision = {name: mx.random.normal(shape) * 0.02 for name, shape in checkpoint["vision"].items()}
    (src / "model.safetensors").unlink()
    index = {}
    for i, shard in enumerate((text, vision)):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(src / file), shard, metadata={"format": "pt"})
        index |= dict.fromkeys(shard, file)
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return src


def logits(model) -> mx.array:
    return model(TOKENS)[0]


@pytest.mark.parametrize("checkpoint", [GEMMA3, QWEN2_VL], ids=["gemma3", "qwen2_vl"])
def test_real_layout_loads_compresses_and_exports_as_mlx_lm_reads_it(checkpoint, tmp_path, tokenizer_dir):
    src = real_layout(tmp_path / "src", checkpoint, tokenizer_dir)
    reference, _ = mlx_lm.load(str(src))
    expected = logits(reference)

    loaded, _ = squishlike.load(src)
    assert_same_weights(reference, loaded)
    assert mx.array_equal(logits(loaded), expected).item()

    store = NpyDir(squishlike.compress(src, tmp_path / "int8", tiers=()))
    assert set(store.entries) == set(flat_params(reference))  # the text model's, no vision tensor
    from_store, _ = squishlike.load(store.path)
    agreement = mx.mean(mx.argmax(logits(from_store), -1) == mx.argmax(expected, -1)).item()
    assert agreement >= 0.9, agreement

    exported, _ = mlx_lm.load(str(squishlike.export(src, "mlx", tmp_path / "mlx")))
    assert_same_weights(reference, exported)


def test_sharded_load_refuses_what_mlx_lm_cannot_shard(tmp_path, tokenizer_dir):
    """mlx_lm's gemma3 model has neither shard() nor pipeline(): mlx_lm.sharded_load refuses it, and so does
    squishlike's, with a typed error naming the type, before any weight is read."""
    src = real_layout(tmp_path / "src", GEMMA3, tokenizer_dir)
    with pytest.raises(ValueError, match="does not support any sharding"):
        mlx_lm_sharded_load(str(src))
    with pytest.raises(UnsupportedArchitectureError, match="cannot shard a gemma3 model"):
        squishlike.sharded_load(src)
