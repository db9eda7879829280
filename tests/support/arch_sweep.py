"""Tiny configs of mlx_lm architectures for the architecture sweep (tests/integration/test_arch_sweep.py).

Each builds with random weights through tiny_models.make_hf_model (the model's own parameter names, which its
sanitize leaves as they are, as in an mlx_lm.convert output). Shapes divide by every group size (32, 64, 128),
so each linear weight can take each scheme. All float32: on mlx[cpu] gather_mm (MoE experts) runs in float32 only.
"""

from __future__ import annotations

from .tiny_models import BASE

_B = {**BASE, "tie_word_embeddings": False}
# Mixture of experts: 4 experts, 2 per token, experts of 128 columns.
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)

ARCH_CONFIGS: dict[str, dict] = {
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

# The sweep's default-suite share (the rest runs with `-m archsweep`): the table families' fast paths and one
# model of each kind the issue names.
DEFAULT = ("llama", "gpt2", "phi3", "gemma2", "mixtral", "qwen3_moe", "mamba2", "falcon_h1")

# mlx_lm architectures the sweep leaves out, and why.
NOT_SWEPT: dict[str, str] = {
    "bitnet": "its BitLinear layers run a Metal kernel; on mlx[cpu] mlx_lm fails with 'No Metal back-end'",
}
