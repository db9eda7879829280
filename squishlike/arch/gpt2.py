"""GPT-2: learned position embeddings, LayerNorms with biases, one fused QKV projection, tied output.

GPT-2's extra canonical rows (names follow docs/format.md §10):
- `position_embedding.weight`: the learned positions (`wpe`);
- `layers.{n}.attention.qkv.{weight,bias}`: the fused Q/K/V projection (`c_attn`), rows Q, then K, then V;
- `.bias` rows of every norm and projection.

HF stores GPT-2's projections as Conv1D, `[in, out]`; canonical (mlx_lm after `sanitize`, and GGUF, whose converter
transposes them) is `[out, in]`. HF's `h.{n}.attn.bias` / `h.{n}.attn.masked_bias` are causal-mask buffers, and
GGUF's `output.weight` is a copy of `token_embd.weight`: neither has a row, so neither is read. mlx_lm's GPT-2
always ties its output to `wte`.
"""

from __future__ import annotations

from . import Adapter, Architecture, Rule, rule


def _rows(canonical: str, hf: str, gguf: str) -> list[Rule]:
    """Weight and bias rows; mlx_lm's names are HF's under `model.`."""
    return [rule(f"{canonical}.{p}", f"{hf}.{p}", f"{gguf}.{p}", f"model.{hf}.{p}") for p in ("weight", "bias")]


CONV1D_TRANSPOSE = Adapter(
    naming="hf",
    pattern=r"layers\.\d+\.(attention\.(qkv|output)|ffn\.(up|down))\.weight",
    to_canonical=lambda name, w, config: w.T,
    from_canonical=lambda name, w, config: w.T,
)

GPT2 = Architecture(
    model_types=("gpt2",),
    gguf_arch="gpt2",
    rules=(
        rule("token_embedding.weight", "wte.weight", "token_embd.weight", "model.wte.weight"),
        rule("position_embedding.weight", "wpe.weight", "position_embd.weight", "model.wpe.weight"),
        *_rows("layers.{n}.attention_norm", "h.{n}.ln_1", "blk.{n}.attn_norm"),
        *_rows("layers.{n}.attention.qkv", "h.{n}.attn.c_attn", "blk.{n}.attn_qkv"),
        *_rows("layers.{n}.attention.output", "h.{n}.attn.c_proj", "blk.{n}.attn_output"),
        *_rows("layers.{n}.ffn_norm", "h.{n}.ln_2", "blk.{n}.ffn_norm"),
        *_rows("layers.{n}.ffn.up", "h.{n}.mlp.c_fc", "blk.{n}.ffn_up"),
        *_rows("layers.{n}.ffn.down", "h.{n}.mlp.c_proj", "blk.{n}.ffn_down"),
        *_rows("output_norm", "ln_f", "output_norm"),
    ),
    adapters=(CONV1D_TRANSPOSE,),
    config_aliases={
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_inner": "intermediate_size",
        "n_positions": "max_position_embeddings",
        "n_ctx": "max_position_embeddings",
        "layer_norm_epsilon": "layer_norm_eps",
    },
)

ARCHITECTURES = [GPT2]
