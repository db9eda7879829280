"""Gemma 3 (text): four norms per layer, per-head Q/K norms, GELU MLP; tied embeddings by default.

Gemma's RMSNorm multiplies by (1 + weight). HF and MLX store `weight`; llama.cpp's converter bakes the 1 in, so a
GGUF norm weight is 1 larger. Its Q/K rows are not permuted (NEOX RoPE).
"""

from __future__ import annotations

from . import Adapter, Architecture, Need, Rule, rule
from .llama import ATTENTION_NORM, EMBEDDING, OUTPUT, QK_NORMS, attention, ffn


def _layer_norm(canonical: str, hf_suffix: str, gguf_suffix: str) -> Rule:
    return rule(f"layers.{{n}}.{canonical}", f"model.layers.{{n}}.{hf_suffix}", f"blk.{{n}}.{gguf_suffix}")


NORM_OFFSET = Adapter(
    naming="gguf",
    pattern=r".*norm\.weight",
    to_canonical=lambda name, w, config: w - 1,
    from_canonical=lambda name, w, config: w + 1,
)


def _gguf_config(get, config: dict) -> dict:
    # What a Gemma 3 GGUF does not say, llama.cpp hard-codes: queries are scaled by 1/sqrt(head_dim), except in the
    # 27B (62 layers): 1/sqrt(hidden / heads). A sliding-window pattern or local RoPE base the GGUF leaves out stays
    # out of the config (None), so mlx_lm's ModelArgs default holds, as llama.cpp's does (every 6th layer global,
    # base 10000).
    if config["num_hidden_layers"] == 62:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        query_pre_attn_scalar = config["head_dim"]
    return {
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": get("attention.sliding_window_pattern"),
        "rope_local_base_freq": get("rope.freq_base_swa"),
    }


GEMMA3_TEXT = Architecture(
    model_types=("gemma3_text",),
    gguf_arch="gemma3",
    rules=(
        EMBEDDING,
        ATTENTION_NORM,
        *attention(bias=Need.OPTIONAL),
        *QK_NORMS,
        _layer_norm("post_attention_norm.weight", "post_attention_layernorm.weight", "post_attention_norm.weight"),
        _layer_norm("ffn_norm.weight", "pre_feedforward_layernorm.weight", "ffn_norm.weight"),
        *ffn(bias=Need.OPTIONAL),
        _layer_norm("post_ffn_norm.weight", "post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        *OUTPUT,
    ),
    adapters=(NORM_OFFSET,),
    gguf_config=_gguf_config,
)

ARCHITECTURES = [GEMMA3_TEXT]
