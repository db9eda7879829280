"""Tiny configs of mlx_lm architectures for the architecture sweep (tests/integration/test_arch_sweep.py).

Every model type mlx_lm ships is either swept or listed in NOT_SWEPT with the reason. A swept type's config is
generated from its ModelArgs (`tiny_config`): each field named in TINY takes its tiny value, every other required
field its plainest value (False, 1, empty), every optional one mlx_lm's default; the hand-made configs below
(HAND) replace the generated ones where a family needs more. Each builds with random weights through
tiny_models.make_hf_model (the model's own parameter names, which its sanitize leaves as they are, as in an
mlx_lm.convert output). Shapes divide by every group size (32, 64, 128), so each linear weight can take each scheme.
All float32: on mlx[cpu] gather_mm (MoE experts) runs in float32 only.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import mlx_lm.models
from mlx_lm.utils import _get_classes

from .tiny_models import BASE

_B = {**BASE, "tie_word_embeddings": False}
# Mixture of experts: 4 experts, 2 per token, experts of 128 columns.
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)

HAND: dict[str, dict] = {
    # Families with a rule table (squishlike/arch), named canonically.
    "llama": {**_B, "model_type": "llama"},
    "qwen3": {**_B, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 512, "n_ctx": 512,
             "layer_norm_epsilon": 1e-5, "vocab_size": 384},
    # Dense decoders, under mlx_lm's names.
    "phi3": {**_B, "model_type": "phi3"},
    "gemma": {**_B, "model_type": "gemma", "head_dim": 32},
    "gemma2": {**_B, "model_type": "gemma2", "head_dim": 32, "query_pre_attn_scalar": 32,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "phi": {"model_type": "phi", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 384, "partial_rotary_factor": 0.5,
            "layer_norm_eps": 1e-5,
            "max_position_embeddings": 512},
    "starcoder2": {**_B, "model_type": "starcoder2", "norm_epsilon": 1e-5},
    "stablelm": {**_B, "model_type": "stablelm", "use_qkv_bias": True, "partial_rotary_factor": 0.25,
                 "layer_norm_eps": 1e-5},
    "cohere": {**_B, "model_type": "cohere", "layer_norm_eps": 1e-5, "logit_scale": 0.0625,
               "tie_word_embeddings": True},
    "olmo2": {**_B, "model_type": "olmo2"},
    "internlm2": {**_B, "model_type": "internlm2", "bias": False},
    "exaone": {**_B, "model_type": "exaone", "num_layers": 2, "layer_norm_epsilon": 1e-5},
    "granite": {**_B, "model_type": "granite", "logits_scaling": 2.0, "attention_multiplier": 0.1,
                "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_bias": False,
                "mlp_bias": False},
    "minicpm": {**_B, "model_type": "minicpm", "dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 4.0},
    "gpt_neox": {**_B, "model_type": "gpt_neox", "layer_norm_eps": 1e-5, "rotary_emb_base": 10000,
                 "rotary_pct": 0.25},
    "smollm3": {**_B, "model_type": "smollm3"},
    "glm4": {**_B, "model_type": "glm4", "attention_bias": False, "head_dim": 32, "partial_rotary_factor": 0.5},
    "helium": {**_B, "model_type": "helium", "attention_bias": False, "head_dim": 32, "mlp_bias": False},
    "nemotron": {**_B, "model_type": "nemotron", "hidden_act": "relu2", "norm_eps": 1e-5,
                 "partial_rotary_factor": 0.5},
    "olmo3": {**_B, "model_type": "olmo3", "sliding_window": 64,
              "layer_types": ["sliding_attention", "full_attention"]},
    "seed_oss": {**_B, "model_type": "seed_oss", "head_dim": 32},
    # Mixture of experts.
    "mixtral": {**_B, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**_B, **_MOE, "model_type": "qwen3_moe", "head_dim": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True},
    "qwen2_moe": {**_B, **_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 128},
    "olmoe": {**_B, **_MOE, "model_type": "olmoe"},
    "deepseek_v3": {**_B, "model_type": "deepseek_v3", "moe_intermediate_size": 128, "n_routed_experts": 4,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32,
                    "v_head_dim": 32, "qk_nope_head_dim": 32, "routed_scaling_factor": 1.0},
    "gpt_oss": {**_B, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 32,
                "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    "granitemoe": {**_B, "model_type": "granitemoe", "logits_scaling": 2.0, "attention_multiplier": 0.1,
                   "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_bias": False,
                   "num_local_experts": 4, "num_experts_per_tok": 2},
    # State-space and hybrid.
    "mamba": {"model_type": "mamba", "vocab_size": 384, "hidden_size": 128, "intermediate_size": 256,
              "state_size": 16, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
              "use_conv_bias": True, "time_step_rank": 8, "tie_word_embeddings": False},
    "mamba2": {"model_type": "mamba2", "num_heads": 8, "head_dim": 32, "vocab_size": 384, "hidden_size": 128,
               "intermediate_size": 256, "state_size": 16, "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5,
               "conv_kernel": 4, "n_groups": 1, "use_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": False, "time_step_limit": [0.0, 100.0], "time_step_rank": 8},
    "falcon_h1": {**_B, "model_type": "falcon_h1", "head_dim": 32, "mamba_d_ssm": 256, "mamba_n_heads": 8,
                  "mamba_d_head": 32, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1},
    "recurrent_gemma": {**_B, "model_type": "recurrent_gemma", "attention_bias": False, "conv1d_width": 4,
                        "logits_soft_cap": 30.0, "attention_window_size": 64, "num_hidden_layers": 3,
                        "block_types": ["recurrent", "recurrent", "attention"], "lru_width": 128},
}

# The sweep's default-suite share (the rest runs with `-m archsweep`): the table families' fast paths, one model
# of each kind, and two a load once refused (apertus's 0-d parameters, ministral3's head tied by default).
DEFAULT = ("llama", "gpt2", "phi3", "gemma2", "mixtral", "qwen3_moe", "mamba2", "falcon_h1", "apertus", "ministral3")

# Sizes that divide by every group size (32, 64, 128), so each linear weight can take each scheme.
TINY: dict[str, object] = {
    "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 384, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # the same sizes under other families' names
    "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 512, "n_ctx": 512, "num_layers": 2, "d_model": 128,
    "n_heads": 4, "n_layers": 2, "dim": 128, "ffn_dim": 256, "num_heads": 4, "n_inner": 256, "d_ff": 256,
    "model_dim": 128,  # phixtral's (its experts are 4 x model_dim wide; mlx_lm's default is 2560)
    # mixture of experts: 4 experts, 2 per token, experts of 128 columns
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2,
    "moe_intermediate_size": 128, "n_shared_experts": 1, "shared_expert_intermediate_size": 128,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # multi-head latent attention
    "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "o_lora_rank": 64, "o_groups": 2, "index_head_dim": 32, "index_n_heads": 4,
    # state space
    "state_size": 16, "conv_kernel": 4, "time_step_rank": 8, "sliding_window": 64,
}

# What a family needs beyond its ModelArgs' fields at their tiny or plainest values: a layer pattern for two layers
# (one of each kind), the sizes of its own parts, the RoPE parameters it reads without a default.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_TWO_KINDS = ["sliding_attention", "full_attention"]
_KDA = {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4}
_LLAMA_4_SCALED = {**_ROPE, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 512}
OVERRIDES: dict[str, dict] = {
    # no tie_word_embeddings: the model's own default (True) is what the sweep checks
    "ministral3": {"rope_parameters": _LLAMA_4_SCALED},
    "afm7": {"hidden_dim": 128, "num_kv_reuse_layers": 1, "num_kv_heads": 2, "hidden_dim_scale_factor": 2.0},
    "afmoe": {"layer_types": _TWO_KINDS, "num_dense_layers": 1},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2},
    "cohere2": {"sliding_window_pattern": 2},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 256, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "deepseek_v2": {"rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512},
                    "n_shared_experts": 1, "num_experts_per_tok": 2},
    "exaone4": {"sliding_window_pattern": "LG", "layer_types": _TWO_KINDS},
    "exaone_moe": {"layer_types": _TWO_KINDS, "is_moe_layer": [False, True], "num_shared_experts": 1},
    "gear": {"layer_types": _TWO_KINDS},
    "gemma3n": {"text_config": {"layer_types": _TWO_KINDS, "intermediate_size": [256, 256],
                                "activation_sparsity_pattern": [0.0, 0.0], "num_kv_shared_layers": 0,
                                "vocab_size_per_layer_input": 384, "hidden_size_per_layer_input": 32,
                                "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0,
                                "altup_num_inputs": 2, "altup_active_idx": 0, "altup_coef_clip": 120.0,
                                "laurel_rank": 32}},
    "gemma3_text": {"sliding_window_pattern": 2, "query_pre_attn_scalar": 32},
    "gemma4_text": {"sliding_window_pattern": 2, "num_kv_shared_layers": 0, "global_head_dim": 32,
                    "hidden_size_per_layer_input": 32, "vocab_size_per_layer_input": 384},
    "glm_moe_dsa": {"rope_parameters": _ROPE, "index_topk": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "moe_layer_freq": 1},
    "gptj": {"rotary_dim": 16},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 32,
                         "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "mamba_proj_bias": False, "shared_intermediate_size": 128},
    "hunyuan": {"rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1.0}, "num_shared_expert": 1,
                "use_mixed_mlp_moe": True, "cla_share_factor": 2},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2,
              "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2},
    "kimi_linear": {"linear_attn_config": _KDA, "model_max_length": 512, "num_experts_per_token": 2},
    "kimi_k3": {"text_config": {"linear_attn_config": _KDA, "num_experts_per_token": 2}},
    "lfm2": {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "block_dim": 128, "block_ff_dim": 256,
             "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "num_dense_layers": 1},
    # its forward reads the cache of layer 3: four layers
    "llama4": {"text_config": {"num_hidden_layers": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "attention_chunk_size": 64,
                               "intermediate_size_mlp": 256}},
    "llama4_text": {"no_rope_layers": [1, 0], "intermediate_size_mlp": 256},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 256,
                      "expert_ffn_hidden_size": 128, "zero_expert_num": 1, "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True, "routed_scaling_factor": 1.0},
    "longcat_flash_ngram": {"ffn_hidden_size": 256, "expert_ffn_hidden_size": 128, "zero_expert_num": 1,
                            "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "routed_scaling_factor": 1.0,
                            "ngram_vocab_size_ratio": 2},
    "mellum": {"layer_types": _TWO_KINDS, "rope_parameters": {t: _ROPE for t in _TWO_KINDS}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 1], "sliding_window_size": 64,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 1.0,
                      "layernorm_epsilon": 1e-5, "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "swa_head_dim": 32, "swa_v_head_dim": 32,
                      "partial_rotary_factor": 0.5},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 512}, "dim_model_base": 64,
                 "scale_depth": 1.4, "scale_emb": 4.0},
    "minimax": {"rotary_dim": 16, "shared_intermediate_size": 128},
    "minimax_m3_vl": {"text_config": {"dense_intermediate_size": 256, "shared_intermediate_size": 128}},
    "mistral4": {"rope_parameters": _LLAMA_4_SCALED, "routed_scaling_factor": 1.0},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.5}},
                                       {"attention": {"no_op": True}, "ffn": {"replace_with_linear": True}}]},
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "-", "E"], "mamba_num_heads": 8, "mamba_head_dim": 32,
                   "ssm_state_size": 16, "n_groups": 1, "moe_shared_expert_intermediate_size": 128,
                   "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0},
    "openelm": {"num_transformer_layers": 2, "ffn_dim_divisor": 128, "num_query_heads": [4, 4],
                "num_kv_heads": [2, 2], "ffn_multipliers": [2.0, 2.0]},
    "plamo": {"n_shared_head": 2},
    "phixtral": {"num_vocab": 384},
    "plamo2": {"mamba_num_heads": 4, "hidden_size_per_head": 32},
    "qwen": {"kv_channels": 32, "intermediate_size": 512},  # its MLP is half intermediate_size wide
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                   "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "decoder_sparse_step": 1,
                   "partial_rotary_factor": 0.5, "full_attention_interval": 2},
    "qwen3_5": {"text_config": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                                "linear_value_head_dim": 32, "full_attention_interval": 2, "num_experts": 0,
                                "rope_parameters": {**_ROPE, "mrope_section": [2, 1, 1],
                                                    "partial_rotary_factor": 0.25}}},
    "spark2_5": {"layer_types": _TWO_KINDS, "rope_parameters": {t: _ROPE for t in _TWO_KINDS}},
}
OVERRIDES["qwen3_5_moe"] = {"text_config": {**OVERRIDES["qwen3_5"]["text_config"], "num_experts": 4}}

# mlx_lm model types the sweep leaves out: those that cannot run here, and why.
_NO_CPU = "mlx_lm runs it with a Metal kernel; on mlx[cpu] it fails with 'No Metal back-end'"
NOT_SWEPT: dict[str, str] = {
    "bitnet": _NO_CPU,
    "muse_spark": _NO_CPU,
    "olmo": "mlx_lm's olmo imports the ai2-olmo package, which is not installed",
    "phi3small": "its model hard-codes vocabulary ids beyond a tiny vocabulary: mlx_lm crashes (segfault)",
    "prism_hadamard_qwen35": "mlx_lm builds it only from a pre-quantized Hadamard pack",
}


def model_types() -> list[str]:
    """Every model type mlx_lm 0.32 ships a module for."""
    skip = {"__init__", "base", "cache", "activations", "rope_utils", "switch_layers", "pipeline", "bitlinear_layers",
            "gated_delta", "ssm", "mla"}
    return sorted(p.stem for p in Path(mlx_lm.models.__file__).parent.glob("*.py") if p.stem not in skip)


# Multimodal wrappers: the ModelArgs class (module.Class in mlx_lm.models) their `text_config` fills. The sweep
# builds that text config as it builds a model's (tiny values, plainest required ones), under the wrapper's
# OVERRIDES["text_config"] and the text model type's own OVERRIDES.
TEXT_ARGS: dict[str, str] = {
    "gemma3": "gemma3_text.ModelArgs", "gemma3n": "gemma3n.TextConfig", "gemma4": "gemma4_text.ModelArgs",
    "qwen2_vl": "qwen2.ModelArgs", "qwen3_vl": "qwen3.ModelArgs", "qwen3_vl_moe": "qwen3_moe.ModelArgs",
    "qwen3_5": "qwen3_5.TextModelArgs", "qwen3_5_moe": "qwen3_5.TextModelArgs", "mistral3": "ministral3.ModelArgs",
    "pixtral": "llama.ModelArgs", "lfm2-vl": "lfm2.ModelArgs", "llama4": "llama4.TextArgs",
    "kimi_vl": "kimi_vl.TextArgs", "kimi_k25": "deepseek_v3.ModelArgs", "kimi_k3": "kimi_k3.TextArgs",
    "minimax_m3_vl": "minimax_m3_vl.TextArgs",
}


def tiny_config(model_type: str) -> dict:
    _, model_args = _get_classes({"model_type": model_type})
    overrides = dict(OVERRIDES.get(model_type, {}))
    config = _tiny_fields(model_args)
    if model_type in TEXT_ARGS:
        module, name = TEXT_ARGS[model_type].split(".")
        text_type = module if name == "ModelArgs" else model_type
        text_args = getattr(importlib.import_module(f"mlx_lm.models.{module}"), name)
        config["text_config"] = {**_tiny_fields(text_args), **OVERRIDES.get(text_type, {}),
                                 **overrides.pop("text_config", {}), "model_type": text_type}
    return {**config, **overrides, "model_type": model_type}


def _tiny_fields(model_args: type) -> dict:
    """Each field named in TINY at its tiny value, every other required one at its plainest (False, 1, empty)."""
    config = {}
    for f in dataclasses.fields(model_args):
        if f.name in TINY:
            config[f.name] = TINY[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            config[f.name] = _neutral(f.type)  # a required flag or size mlx_lm gives no default: the plainest
    return config


def _neutral(annotation) -> object:
    # ModelArgs modules use `from __future__ import annotations` or not: the type is a string or a class.
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for prefix, value in (("bool", False), ("int", 1), ("float", 1.0), ("str", ""), ("list", []), ("List", []),
                          ("dict", {}), ("Dict", {})):
        if name.startswith(prefix):
            return value
    return None


# Swept types that fail a check today, and how: each runs as a strict xfail, so a fix shows.
KNOWN_FAILING: dict[str, str] = {}

# The types whose generated config (with its OVERRIDES) builds.
GENERATED = (
    "ministral3",
    "Klear", "apertus", "bailing_hybrid", "bailing_moe", "bailing_moe_linear", "bailing_moe_v3", "deepseek",
    "deepseek_v32", "deepseek_v41", "dots1", "ernie4_5", "ernie4_5_moe", "glm", "glm4_moe",
    "glm4_moe_lite", "gpt_bigcode", "hunyuan_v1_dense", "internlm3", "iquestloopcoder",
    "laguna", "lille-130m", "mimo", "muse_glimmer", "nanbeige", "nanochat", "olmo_hybrid", "phimoe",
    "phixtral", "plamo2", "plamo3", "qwen2", "rwkv7", "solar_open", "step3p5", "talkie", "telechat3", "youtu_llm",
    "afm7", "afmoe", "baichuan_m1", "cohere2", "dbrx", "deepseek_v2", "exaone4", "exaone_moe", "gear",
    "gemma3_text", "gemma4_text", "glm_moe_dsa", "gptj", "granitemoehybrid", "hunyuan", "jamba", "kimi_linear",
    "lfm2", "lfm2_moe", "llama4_text", "longcat_flash", "longcat_flash_ngram", "mellum", "mimo_v2_flash",
    "minicpm3", "minimax", "mistral4", "nemotron-nas", "nemotron_h", "openelm", "plamo", "qwen", "qwen3_next",
    "spark2_5",
    # multimodal wrappers (TEXT_ARGS)
    *TEXT_ARGS,
)
ARCH_CONFIGS: dict[str, dict] = {**HAND, **{t: tiny_config(t) for t in GENERATED}}
